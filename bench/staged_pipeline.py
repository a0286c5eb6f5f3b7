"""The whole base pipeline (text encoder, DiT, both VAEs, the MP4 writer) in a device-memory budget: resident against
staged, one process, one GPU. Prints one JSON line per run and a summary.

    python bench/staged_pipeline.py --device cuda                    # 10 s 1344x768, cap 48 GiB, DiT r = 20
    python bench/staged_pipeline.py --device cpu --preset tiny --seconds 5 --size 256x256   # smoke (no cap)

Every model is built in memory with random weights at the released geometry (no checkpoint on disk: the full one
is ~143 GB): the 50 Qwen3-VL decoder layers H3 reads + vision tower, the 50-block DiT, the video and audio VAEs.
Runs, all through `Pipeline.generate` with the same request and seed:

  resident  every weight on the device (warm-up request first, at a small canvas);
  staged    the lossless levers: DiT layerwise offload (r blocks), the text decoder streamed (2 slots), both VAEs
            staged; then the process's device memory is capped (`torch.cuda.set_per_process_memory_fraction`) and
            the request runs again under the cap.

Reported: t_client and stage times, peak allocated device memory per run, the MP4's sha256 (the levers change no
output: the two files must be identical), the staged / resident ratio. `--steps` sets the grid (forwards = steps -
1): the full 49-forward base schedule takes ~13 min per run on one H200, so the default runs 2 forwards; the
staging costs are per request (the encoder's and VAEs' copies) or per forward (the DiT's, ~0.5 %), so the ratio at
2 forwards bounds the one at 49 from above.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from levers import build as build_dit  # noqa: E402  (bench/levers.py: the random DiT at the released geometry)

from h3serve.config.levers import Levers  # noqa: E402
from h3serve.config.request import validate_request  # noqa: E402
from h3serve.models.dit.engine import DiTEngine  # noqa: E402
from h3serve.models.encoder.model import ATTENTION, ENCODER_LAYERS, TextEncoder  # noqa: E402
from h3serve.models.vae.audio import AudioVAE  # noqa: E402
from h3serve.models.vae.video import VideoVAE  # noqa: E402
from h3serve.pipeline import Pipeline  # noqa: E402
from h3serve.testing import presets  # noqa: E402
from h3serve.testing.modules import random_video_vae  # noqa: E402
from h3serve.testing.tiny import build_tokenizer  # noqa: E402

GIB = float(1 << 30)


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def _random_(module: nn.Module, seed: int) -> nn.Module:
    """Fan-in-scaled normal weights, unit norms, zero biases (in place, on the module's device)."""
    g = torch.Generator(next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0) if name.endswith("weight") else p.zero_()
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()), generator=g)
    return module


def build_encoder(preset: str, device: torch.device, dtype: torch.dtype) -> TextEncoder:
    """Qwen3-VL truncated to the layers H3 reads (as TextEncoder.load builds it), random weights."""
    from transformers import Qwen3VLConfig, Qwen3VLModel  # lazy: seconds to import

    tok = build_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                     "<|vision_end|>")}
    text = presets.text_encoder_text_config(preset)
    text.setdefault("vocab_size", len(tok))
    text["num_hidden_layers"] = ENCODER_LAYERS
    if text.get("layer_types"):
        text["layer_types"] = list(text["layer_types"])[:ENCODER_LAYERS]
    config = Qwen3VLConfig(text_config=text, vision_config=presets.text_encoder_vision_config(preset),
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                           tie_word_embeddings=False)
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = ATTENTION
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built straight in the serving dtype (fp32 first would not fit)
    try:
        with torch.device(device):
            model = Qwen3VLModel(config)
    finally:
        torch.set_default_dtype(old)
    model.language_model.norm = nn.Identity()  # hidden_states[50] is taken before the final norm
    return TextEncoder(_random_(model, 1).eval().requires_grad_(False), tok, None)


def build_pipeline(preset: str, device: torch.device, dtype: torch.dtype) -> Pipeline:
    t0 = time.perf_counter()
    dit = build_dit(presets.transformer_config(preset), presets.transformer_config(preset)["num_layers"], device,
                    dtype)
    engine = DiTEngine({"transformer": dit}, device=device, profile="base")
    encoder = build_encoder(preset, device, dtype)
    video = VideoVAE(random_video_vae(preset, dtype, device).requires_grad_(False))
    from diffusers import AutoencoderKLMiniMaxH3Audio  # lazy: seconds to import

    cfg = presets.audio_vae_config(preset)
    with torch.device(device):
        audio_model = AutoencoderKLMiniMaxH3Audio(**cfg).eval().requires_grad_(False)
    audio = AudioVAE(audio_model)
    return Pipeline(checkpoint=Path("in-memory"), profile="base", dtype="bf16" if dtype == torch.bfloat16 else "fp32",
                    device=device, encoder=encoder, dit=engine, video_vae=video, audio_vae=audio,
                    load_seconds=time.perf_counter() - t0)


def host_available_gib() -> float | None:
    """MemAvailable of the host (the pinned copies live there)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return None


def run(pipe: Pipeline, req, out: Path, device: torch.device, tag: str) -> dict:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    result = pipe.generate(req, out)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    rec = {"run": tag, "t_client": result.timings["t_client"],
           "timings": {k: v for k, v in result.timings.items() if isinstance(v, (int, float))},
           "peak_allocated_gib": peak, "mp4_bytes": result.bytes,
           "mp4_sha256": hashlib.sha256(out.read_bytes()).hexdigest()}
    print(json.dumps(rec), flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="full")
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--size", default="1344x768")
    ap.add_argument("--steps", type=int, default=3, help="grid points (forwards = steps - 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dit-resident-blocks", type=int, default=20)
    ap.add_argument("--encoder-resident-layers", type=int, default=2)
    ap.add_argument("--cap-gib", type=float, default=48.0)
    ap.add_argument("--out", default="out/staged")
    a = ap.parse_args()
    device = torch.device(a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16
    meta = {"bench": "staged_pipeline", "torch": torch.__version__, "argv": sys.argv[1:],
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    pipe = build_pipeline(a.preset, device, dtype)
    weights = {name: sum(p.numel() * p.element_size() for p in m.parameters()) for name, m in (
        ("dit", pipe.dit.models["transformer"]), ("encoder", pipe.encoder.model), ("video_vae", pipe.video_vae.model),
        ("audio_vae", pipe.audio_vae.model))}
    meta["weight_bytes"] = weights
    meta["build_s"] = pipe.load_seconds
    log("built", meta)
    prompt = "A red kite dances over a windy beach at golden hour; the waves roll in, gulls cry."
    small = validate_request(prompt=prompt, seconds=5, size="256x256", steps=2, seed=1)
    req = validate_request(prompt=prompt, seconds=a.seconds, size=a.size, steps=a.steps, seed=a.seed)
    pipe.generate(small, out / "warmup.mp4")  # kernels compiled, autotuned once
    resident = run(pipe, req, out / "resident.mp4", device, "resident")

    levers = Levers(resident_blocks=a.dit_resident_blocks, encoder_resident_layers=a.encoder_resident_layers,
                    vae_staged=True).check()
    host_before = host_available_gib()
    t0 = time.perf_counter()
    pipe.dit.apply_offload(levers)
    pipe.encoder.apply_levers(fp8=levers.fp8, resident_layers=levers.encoder_resident_layers)
    pipe.video_vae.stage()   # the same models staged after the resident run (a fresh load would pass staged=True)
    pipe.audio_vae.stage()
    staging_s = time.perf_counter() - t0
    cap = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        cap = {"cap_gib": a.cap_gib, "fraction": a.cap_gib * GIB / total,
               "allocated_after_staging_gib": torch.cuda.memory_allocated(device) / GIB}
        torch.cuda.set_per_process_memory_fraction(cap["fraction"], device.index or torch.cuda.current_device())
        log("staged in", staging_s, "s;", cap)
    pipe.generate(small, out / "warmup-staged.mp4")  # the staged paths' first call
    staged = run(pipe, req, out / "staged.mp4", device, "staged")
    summary = {**meta, "request": {"seconds": a.seconds, "size": a.size, "steps": a.steps,
                                   "forwards": req.num_forwards, "frames": req.num_frames},
               "levers": {"dit_resident_blocks": a.dit_resident_blocks,
                          "encoder_resident_layers": a.encoder_resident_layers, "vae_staged": True},
               "staging_s": staging_s, "cap": cap,
               "host_available_gib": {"before_staging": host_before, "after_staging": host_available_gib()}, "resident": resident, "staged": staged,
               "ratio_t_client": staged["t_client"] / resident["t_client"],
               "same_mp4": staged["mp4_sha256"] == resident["mp4_sha256"],
               "within_cap": (staged["peak_allocated_gib"] or 0) <= a.cap_gib,
               "target": {"ratio_max": 1.10, "cap_gib": a.cap_gib}}
    summary["meets_target"] = bool(summary["ratio_t_client"] <= 1.10 and summary["same_mp4"]
                                   and summary["within_cap"])
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
