"""The AdaLN table at the released geometry. Prints one JSON line per part.

    python bench/adaln.py                                   # part bytes: bf16, the released config, CPU, no weights
    python bench/adaln.py --parts device --device cuda      # 50 random layers, the 10 s 1344x768 t2va forward
    python bench/adaln.py --parts device --device cpu --layers 2 --width 64 --frames 22 --height 64 --width-px 96

Part bytes: the DiT is built on the meta device and cast as the checkpoint is (bf16 + FP32_MODULES); its weight bytes on the
device are counted with the table off (everything resident) and on (the AdaLN projections and norm_out.linear on
the host: models/dit/adaln.py). The table's own bytes are counted from the schedules' timesteps vectors
(`schedule_inputs`): per entry L x 3*n_t x 6 x D + n_t x 2*D values in the model dtype, in host memory; one entry
is on the device per forward.

Part device: a random DiT (bench/levers.py's `build`) on the device; one forward at the geometry with the projections
resident, then the table is attached (projections detached to pinned host memory; entries for the base 50-point
t2va + fl2va schedule and the forward's own timesteps, each projection staged once) and the same forward runs from the
table. Reports device bytes allocated before / after, the build time, both forward times, the peak, and whether the
outputs are bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from h3serve.config.request import DEFAULT_STEPS
from h3serve.config.vocab import PROFILE_TASKS
from h3serve.models.dit.adaln import ADALN_WEIGHTS, AdaLNTable, schedule_inputs
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


def part_bytes(dtype_name: str) -> dict:
    dtype = DTYPES[dtype_name]
    config = H3DiTConfig()
    with torch.device("meta"):
        model = H3DiT(config)
    model.cast(dtype)
    named = [*model.named_parameters(), *model.named_buffers()]
    total = sum(t.numel() * t.element_size() for _, t in named)
    adaln = sum(t.numel() * t.element_size() for n, t in named if name_matches(n, ADALN_WEIGHTS))
    per_block = sum(p.numel() * p.element_size() for p in model.transformer_blocks[0].adaln_proj.parameters())
    element = torch.empty((), dtype=dtype).element_size()
    return {
        "part": "adaln_table_bytes", "dtype": dtype_name, "layers": config.num_layers,
        "dit_weight_bytes_on_device_table_off": total, "dit_weight_bytes_on_device_table_on": total - adaln,
        "adaln_weight_bytes_to_host": adaln, "adaln_proj_bytes_per_block": per_block,
        "norm_out_linear_bytes": adaln - config.num_layers * per_block,
        "table": {f"{profile}/{component}": table_bytes(config, profile, component, element)
                  for profile in ("base", "fasth3") for component in sorted(set(COMPONENT_FOR_TASK.values()))
                  if profile == "base" or component == "transformer"},
    }


def part_device(a) -> dict:
    from levers import alloc_gib, build, config_for, geometry, inputs, peak_gib, reset_peak, timed  # bench/levers.py

    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    cfg = config_for(a.width)
    model = build(cfg, a.layers, device, dtype)
    lf, lh, lw, au = geometry(a.frames, a.height, a.width_px)
    args = inputs(cfg, a.text_len, lf, lh, lw, au, device, dtype)
    out = {"part": "adaln_table_device", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else "cpu", "dtype": a.dtype, "layers": a.layers, "geometry": f"{a.frames}x{a.height}x{a.width_px}",
           "seq_len": args[-1].seq_len}
    with torch.no_grad():
        model(*inputs(cfg, 16, 2, 4, 6, 5, device, dtype))  # kernels loaded before anything is timed
        out["allocated_gib_table_off"] = alloc_gib(device)
        reset_peak(device)
        out["forward_s_table_off"], want = timed(lambda: model(*args), device)
        out["peak_gib_table_off"] = peak_gib(device)
        t0 = time.perf_counter()
        table = AdaLNTable.detach(model, device)
        out["detach_s"] = round(time.perf_counter() - t0, 3)
        video, audio = schedules_for("base", DEFAULT_STEPS["base"])
        table.build(model, [*schedule_inputs(video, audio, ["t2va", "fl2va"]), args[3].cpu()])
        out["build_s"], out["entries"] = round(table.build_seconds, 3), len(table.entries)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out["allocated_gib_table_on"] = alloc_gib(device)
        reset_peak(device)
        out["forward_s_table_on"], got = timed(lambda: model(*args), device)
        out["peak_gib_table_on"] = peak_gib(device)
    out["bitwise_equal"] = all(torch.equal(g, w) for g, w in zip(got, want))
    out["computed_on_miss"] = table.misses
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="bytes", help="bytes,device")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=50)
    ap.add_argument("--frames", type=int, default=243)
    ap.add_argument("--height", type=int, default=768)
    ap.add_argument("--width-px", type=int, default=1344)
    ap.add_argument("--text-len", type=int, default=256)
    ap.add_argument("--width", type=int, help="hidden size override (CPU smoke runs)")
    a = ap.parse_args()
    parts = a.parts.split(",")
    if "bytes" in parts:
        print(json.dumps(part_bytes(a.dtype)), flush=True)
    if "device" in parts:
        print(json.dumps(part_device(a)), flush=True)


if __name__ == "__main__":
    main()
