"""The AdaLN table's byte counts at the released geometry, on the CPU without allocating a weight. Prints one JSON line.

    python bench/adaln.py                 # bf16, the released config (H3DiTConfig defaults)

The DiT is built on the meta device and cast as the checkpoint is (bf16 + FP32_MODULES); its weight bytes on the
device are counted with the table off (everything resident) and on (the AdaLN projections and norm_out.linear on
the host: models/dit/adaln.py). The table's own bytes are counted from the schedules' timesteps vectors
(`schedule_inputs`): per entry L x 3*n_t x 6 x D + n_t x 2*D values in the model dtype, in host memory; one entry
is on the device per forward.
"""

from __future__ import annotations

import argparse
import json

import torch

from h3serve.config.request import DEFAULT_STEPS
from h3serve.config.vocab import PROFILE_TASKS
from h3serve.models.dit.adaln import ADALN_WEIGHTS, schedule_inputs
from h3serve.models.dit.engine import COMPONENT_FOR_TASK
from h3serve.models.dit.model import H3DiT, H3DiTConfig
from h3serve.models.dit.scheduler import schedules_for
from h3serve.weights.load import name_matches

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def table_bytes(config: H3DiTConfig, profile: str, component: str, element: int) -> dict:
    video, audio = schedules_for(profile, DEFAULT_STEPS[profile])
    tasks = [t for t in PROFILE_TASKS[profile] if COMPONENT_FOR_TASK[t] == component]
    sizes = [(config.num_layers * 3 * ts.numel() * 6 * config.hidden_size + ts.numel() * 2 * config.hidden_size)
             * element for ts in schedule_inputs(video, audio, tasks)]
    return {"steps": DEFAULT_STEPS[profile], "tasks": tasks, "entries": len(sizes), "table_bytes": sum(sizes),
            "largest_entry_bytes": max(sizes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    config = H3DiTConfig()
    with torch.device("meta"):
        model = H3DiT(config)
    model.cast(dtype)
    named = [*model.named_parameters(), *model.named_buffers()]
    total = sum(t.numel() * t.element_size() for _, t in named)
    adaln = sum(t.numel() * t.element_size() for n, t in named if name_matches(n, ADALN_WEIGHTS))
    per_block = sum(p.numel() * p.element_size() for p in model.transformer_blocks[0].adaln_proj.parameters())
    element = torch.empty((), dtype=dtype).element_size()
    print(json.dumps({
        "part": "adaln_table_bytes", "dtype": args.dtype, "layers": config.num_layers,
        "dit_weight_bytes_on_device_table_off": total, "dit_weight_bytes_on_device_table_on": total - adaln,
        "adaln_weight_bytes_to_host": adaln, "adaln_proj_bytes_per_block": per_block,
        "norm_out_linear_bytes": adaln - config.num_layers * per_block,
        "table": {f"{profile}/{component}": table_bytes(config, profile, component, element)
                  for profile in ("base", "fasth3") for component in sorted(set(COMPONENT_FOR_TASK.values()))
                  if profile == "base" or component == "transformer"},
    }), flush=True)


if __name__ == "__main__":
    main()
