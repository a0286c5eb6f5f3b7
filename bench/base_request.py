"""A whole base-profile request on one GPU with the levers, against diffusers' lossless run of the same request on the
same GPU (the issue's goal: >= 6x). Prints ONE JSON line on stdout (logs go to stderr).

    # one H200: ours with every lever (a 10 s 1344x768 request, 50 grid points = 49 forwards), then diffusers' DiT
    python bench/base_request.py --checkpoint /tmp/h3-synthetic --tag levers --adaln-table on \\
        --encoder-resident-layers 2 --vae-staged on --fp8 on --sparse-attention 25 --quality high
    # CPU smoke run on the tiny checkpoint
    python bench/base_request.py --checkpoint .cache/tiny-ckpt --size 320x256 --seconds 5 --steps 5 --dtype fp32

Why diffusers is timed per forward: its whole 10 s request is 49 calls of a ~16 s transformer forward (plus its text
encode and VAE decode), which outlasts one 10-minute command, and its three models (~138 GB in bf16) do not fit one
H200 together. So, in a child process after ours has exited, diffusers' `MiniMaxH3Transformer3DModel` is built from
the checkpoint's transformer config (random bf16 weights made on the device: a dense forward's time does not depend
on the values; the fp32 modules in fp32, as released), with its best single-GPU settings (attention backend
`_native_cudnn` for bf16 on CUDA, regional compile of its repeated blocks on CUDA), and one model call at the
request's geometry (same packed length, same text tokens) is timed after warm-ups. H3 is guidance-distilled: the
denoise loop calls the model once per step, so diffusers' request costs at least forwards x forward_s;
`diffusers.request_s_lower_bound` is that product (its encode, decode and muxing left out, which favours diffusers)
and `speedup_vs_diffusers` = that bound / ours' t_client.

Ours runs in its own child first: `Pipeline.load(profile="base", levers)`, --warmups untimed requests, then one timed
request (`generate_latents` + `write_mp4`, as `h3serve generate`). Its final latents are saved as ours-TAG_latents.pt
in --out; "latents_pairs" compares every two runs of the same request there (a run with no levers, same --out, gives
the levers' deviation: random weights rank levers, they certify nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from h3serve.config.levers import LeverError, add_flags as add_lever_flags, check_combination, staging_conflict
from h3serve.config.levers import from_args as levers_from_args
from h3serve.config.vocab import DEFAULT_QUALITY, QUALITIES
from h3serve.errors import RequestError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_parallel import (DEFAULT_PROMPT, _device_info, _ours_once, _ours_stem, json_stdout,  # noqa: E402
                          latents_pairs, print_json, run_in_child)

TARGET = 6.0  # x diffusers' lossless request, one GPU (SGLang publishes 4.9-5.9x on 8 x H200)


def log(msg: str) -> None:
    print(f"[base_request] {msg}", file=sys.stderr, flush=True)


def _memory(device) -> dict:
    """This process's peaks: allocated device bytes (CUDA) and RSS."""
    from h3serve.runtime.device import process_memory

    m = process_memory(device)
    peak = m["max_allocated_bytes"]
    return {**m, "max_allocated_gib": None if peak is None else round(peak / 2**30, 3)}


def _request(cfg: dict):
    from h3serve.config.request import validate_request

    return validate_request(prompt=cfg["prompt"], seconds=cfg["seconds"], size=cfg["size"], seed=cfg["seed"],
                            steps=cfg["steps"], quality=cfg["quality"], profile="base", dtype=cfg["dtype"])


def _run_key(cfg: dict) -> dict:
    """What must match for two saved latents to be compared (the levers and quality may differ: that is the point)."""
    return {k: cfg[k] for k in ("checkpoint", "size", "seconds", "steps", "seed", "prompt", "dtype")}


# ---------------------------------------------------------------------------------------------------------------------
# Ours


def ours_run(cfg: dict) -> dict:
    import torch

    from h3serve.config.levers import Levers
    from h3serve.pipeline import Pipeline

    out, stem = Path(cfg["out"]), _ours_stem(cfg)
    req = _request(cfg)
    levers = Levers(**cfg["levers"])
    log(f"ours: loading (base, {cfg['dtype']}, {cfg['device']}, levers {list(levers.on)}, quality {cfg['quality']})")
    pipe = Pipeline.load(cfg["checkpoint"], profile="base", dtype=cfg["dtype"], device=cfg["device"], levers=levers)
    try:
        log(f"ours: loaded in {pipe.load_seconds:.2f} s; {cfg['warmups']} warm-up request(s)")
        for _ in range(cfg["warmups"]):
            _ours_once(pipe, req, out / f"{stem}_warmup.mp4")
        timings, latents = _ours_once(pipe, req, out / f"{stem}.mp4")
        log(f"ours: t_client {timings['t_client']:.3f} s")
        text_tokens = len(pipe.encoder.present(req.prompt).token_ids)
        memory = _memory(pipe.device)
    finally:
        pipe.close()
    torch.save({"video": latents.video.float().cpu(), "audio": latents.audio.float().cpu(), "run": _run_key(cfg)},
               out / f"{stem}_latents.pt")
    return {
        "tag": cfg["tag"], "levers": list(levers.on), "quality": cfg["quality"], "load_s": pipe.load_seconds,
        "stages": {"encoder_s": timings["encoder_s"], "dit_s": timings["dit_s"], "vae_decode_s": timings["vae_s"],
                   "mux_s": timings["mux_tail_s"]},
        "forwards": timings["dit_steps"], "forwards_computed": timings["dit_forwards_computed"],
        "t_client": timings["t_client"], "rtf": timings["t_client"] / (req.num_frames / req.fps),
        "text_tokens": text_tokens, "mp4": str(out / f"{stem}.mp4"), "latents_path": str(out / f"{stem}_latents.pt"),
        "memory": memory, "device_info": _device_info(cfg["device"]),
    }


# ---------------------------------------------------------------------------------------------------------------------
# diffusers: one transformer call at the request's geometry


def diffusers_forward(cfg: dict) -> dict:
    import torch
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.utils import logging as diffusers_logging

    from h3serve.models.dit import layout as L
    from h3serve.models.dit.model import FP32_MODULES
    from h3serve.runtime.device import TORCH_DTYPES

    diffusers_logging.set_verbosity_error()
    device, dtype = torch.device(cfg["device"]), TORCH_DTYPES[cfg["dtype"]]
    req = _request(cfg)
    config = {k: v for k, v in json.loads((Path(cfg["checkpoint"]) / "transformer" / "config.json").read_text()).items()
              if not k.startswith("_")}
    t0 = time.perf_counter()
    torch.manual_seed(cfg["seed"])
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in the run's dtype on the device: a full-size fp32 copy would not fit
    try:
        with torch.device(device):
            model = MiniMaxH3Transformer3DModel(**config).eval()
    finally:
        torch.set_default_dtype(default)
    for name in FP32_MODULES:
        getattr(model, name).float()
    attention = cfg["diffusers_attention"]
    if attention != "native":
        model.set_attention_backend(attention)
    if cfg["diffusers_compile"]:
        model.compile_repeated_blocks(fullgraph=True)
    build_s = time.perf_counter() - t0

    layout = L.build_t2va_layout(cfg["text_tokens"], req.latent_frames, req.latent_height, req.latent_width,
                                 req.audio_latents)
    timesteps, indices = L.row_timesteps(layout, 0.5, 0.5)  # on the CPU layout, like the engine's
    timesteps, indices, layout = timesteps.to(device), indices.to(device), layout.to(device)
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    video = torch.randn(1, layout.num_video_rows, config["in_channels"] * 4, generator=g).to(device)
    audio = torch.randn(1, layout.num_audio_rows, config["audio_in_channels"], generator=g).to(device)
    text = torch.randn(1, cfg["text_tokens"], config["text_dim"], generator=g).to(device, dtype)

    def call():
        t = time.perf_counter()
        with torch.no_grad():
            model(video, audio, text, timesteps, indices, layout.token_tags, layout.position_ids, layout.video_indices,
                  layout.audio_indices, layout.text_indices, return_dict=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t

    warm = [call() for _ in range(cfg["diffusers_warmups"])]
    runs = [call() for _ in range(cfg["diffusers_iters"])]
    forward_s = statistics.median(runs)
    forwards = req.num_forwards
    return {
        "what": "one MiniMaxH3Transformer3DModel call at the request's geometry, random weights of the checkpoint's "
                "config; request_s_lower_bound = forwards x forward_s (text encode, VAE decode and muxing left out)",
        "attention": attention, "compiled": cfg["diffusers_compile"], "build_s": build_s,
        "warmup_s": warm, "forward_s_runs": runs, "forward_s": forward_s, "forwards": forwards,
        "request_s_lower_bound": forwards * forward_s, "seq_len": int(layout.token_tags.numel()),
        "memory": _memory(device),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Driver


def _parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="diffusers-format H3 folder (a synthetic one at full size)")
    ap.add_argument("--size", default="1344x768", help="WxH (default 1344x768)")
    ap.add_argument("--seconds", default="10", help="requested duration; raised to 17n+5 frames (10 -> 243)")
    ap.add_argument("--steps", type=int, default=50, help="grid points of the base schedule (forwards = steps - 1)")
    ap.add_argument("--quality", default=DEFAULT_QUALITY, choices=QUALITIES,
                    help=f"ours: high = step reuse (lossy; default {DEFAULT_QUALITY})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    ap.add_argument("--warmups", type=int, default=0, help="ours: untimed requests first (default 0)")
    ap.add_argument("--tag", default="", help="ours: names its files ours-TAG_* in --out")
    add_lever_flags(ap)
    ap.add_argument("--diffusers-attention", default=None,
                    help="diffusers' attention backend (default: _native_cudnn on CUDA bf16, native otherwise)")
    ap.add_argument("--diffusers-compile", action=argparse.BooleanOptionalAction, default=None,
                    help="regional compile of diffusers' repeated blocks (default: on with CUDA, off on the CPU)")
    ap.add_argument("--diffusers-warmups", type=int, default=1, help="untimed forwards first (compiles)")
    ap.add_argument("--diffusers-iters", type=int, default=2, help="timed forwards (median)")
    ap.add_argument("--skip-ours", action="store_true",
                    help="diffusers only; ours' result is read from --out if an earlier run with this --tag left it")
    ap.add_argument("--skip-diffusers", action="store_true")
    ap.add_argument("--text-tokens", type=int, default=None,
                    help="diffusers: text rows of the packed sequence (default: what ours' tokenizer made of --prompt)")
    ap.add_argument("--out", default=None, help="where MP4s, latents and results go (default: a temp dir)")
    return ap.parse_args(argv)


def _config(args: argparse.Namespace) -> dict:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    levers = levers_from_args(args)
    try:
        levers.check()
        check_combination("base", levers)
        if staging_conflict(levers, 1) is not None:
            raise LeverError("--vae-staged", staging_conflict(levers, 1))
    except LeverError as e:
        raise SystemExit(f"ours: {e}") from None
    if args.steps < 2:
        raise SystemExit(f"--steps {args.steps}: at least 2 grid points (one forward)")
    if min(args.diffusers_iters, args.warmups + 1, args.diffusers_warmups + 1) < 1:
        raise SystemExit("--diffusers-iters must be >= 1; --warmups and --diffusers-warmups >= 0")
    compile_ = device == "cuda" if args.diffusers_compile is None else args.diffusers_compile
    cfg = {
        "checkpoint": str(Path(args.checkpoint).resolve()), "size": args.size, "seconds": args.seconds,
        "steps": args.steps, "quality": args.quality, "seed": args.seed, "prompt": args.prompt, "dtype": args.dtype,
        "device": device, "warmups": args.warmups, "tag": args.tag, "levers": dataclasses.asdict(levers),
        "diffusers_attention": args.diffusers_attention or ("_native_cudnn" if device == "cuda" and args.dtype == "bf16"
                                                            else "native"),
        "diffusers_compile": bool(compile_), "diffusers_warmups": args.diffusers_warmups,
        "diffusers_iters": args.diffusers_iters, "text_tokens": args.text_tokens,
    }
    try:
        _request(cfg)
    except RequestError as e:
        raise SystemExit(f"request: {e}") from None
    out = Path(args.out or tempfile.mkdtemp(prefix="base_request-"))
    out.mkdir(parents=True, exist_ok=True)
    return {**cfg, "out": str(out.resolve())}


def main(argv=None) -> int:
    real_stdout = json_stdout()
    args = _parse(argv)
    cfg = _config(args)

    import torch

    req = _request(cfg)
    result: dict = {
        "bench": "base_request", "device": None, "torch": torch.__version__, "dtype": cfg["dtype"],
        "geometry": {"width": req.width, "height": req.height, "frames": req.num_frames,
                     "seconds": req.num_frames / req.fps},
        "steps": cfg["steps"], "forwards": req.num_forwards, "profile": "base", "target": TARGET,
        "checkpoint": cfg["checkpoint"], "out": cfg["out"], "argv": sys.argv[1:] if argv is None else argv,
    }
    saved = Path(cfg["out"]) / f"{_ours_stem(cfg)}_result.json"
    if not args.skip_ours:
        result["ours"] = run_in_child(ours_run, cfg, _ours_stem(cfg))
    elif saved.exists():
        result["ours"] = {**json.loads(saved.read_text()), "reused": saved.name}
    ours = result.get("ours", {})
    if "device_info" in ours:
        result["device"] = ours.pop("device_info")
    if not args.skip_diffusers:
        cfg["text_tokens"] = cfg["text_tokens"] or ours.get("text_tokens")
        if cfg["text_tokens"] is None:
            result["diffusers"] = {"error": "no text token count: run ours first (same --out and --tag) or pass "
                                            "--text-tokens"}
        else:
            result["diffusers"] = run_in_child(diffusers_forward, cfg, "diffusers")
    theirs = result.get("diffusers", {})
    failed = [k for k in ("ours", "diffusers") if "error" in result.get(k, {})]
    if not failed and "t_client" in ours and "request_s_lower_bound" in theirs:
        result["speedup_vs_diffusers"] = theirs["request_s_lower_bound"] / ours["t_client"]
        result["speedup_dit_vs_diffusers"] = theirs["request_s_lower_bound"] / ours["stages"]["dit_s"]
        result["meets_target"] = result["speedup_vs_diffusers"] >= TARGET
    result["latents_pairs"] = latents_pairs(Path(cfg["out"]))
    print_json(real_stdout, result)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
