"""`h3serve` command line: generate | serve | checkpoint | render | operator.

Every user-facing failure is one line on stderr and a non-zero exit; set H3SERVE_DEBUG=1 for tracebacks.

Each command imports its machinery inside its own function: `h3serve --help`, `render` and `operator` must not
pay for torch, grpc or the models, and `generate` must not pay for the services (these are the only lazy imports
of the faces; none of them dodges a cycle).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from h3serve.config.levers import CLI_NAMES, LeverError, Levers, check_combination, staging_conflict
from h3serve.config.parallel import ParallelDegrees
from h3serve.config.stage import API_KEY_ENV, API_KEYS_ENV, StageConfig
from h3serve.config.vocab import (DEFAULT_DTYPE, DIT_LAYERS, DTYPES, ENCODER_LAYERS, EXIT_USER_ERROR, GRPC_PORT,
                                  HTTP_PORT, MIN_RESIDENT_BLOCKS,
                                  MODEL_STAGES, OFFLOAD_MODES, TRANSPORTS)
from h3serve.errors import H3Error

EXIT_INTERNAL = 3
EXIT_SIGPIPE = 128 + 13   # what a shell reports for a tool that SIGPIPE ended


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate one MP4 in this process (embedded pipeline), or on a server")
    p.add_argument("--checkpoint", default=None, help="diffusers-format H3 folder (embedded; required without "
                                                      "--server)")
    p.add_argument("--server", default=None, metavar="HOST:PORT",
                   help="generate on a running gateway (h3serve serve) instead of in this process")
    p.add_argument("--timeout", type=float, default=None, help="with --server: the request's deadline in seconds")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="with --server: verify the gateway's TLS certificate against this CA (default: plaintext)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"with --server: the caller's API key (default ${API_KEY_ENV})")
    p.add_argument("--prompt", required=True)
    p.add_argument("--seconds", default="5", help="requested duration, 4.5-14.375 s (raised to the next 17n+5 frames, 124..345)")
    p.add_argument("--size", default=None, help="WxH, sides multiples of 32 (default: 16:9 canvas 1344x768)")
    p.add_argument("--seed", default="0")
    p.add_argument("--task", default="t2va", help="t2va | fl2va | ref2va")
    p.add_argument("--profile", default="base", help="base | fasth3")
    p.add_argument("--steps", default=None, help="sigma grid points incl. the terminal 0 (base default 50)")
    p.add_argument("--quality", default=None, help="lossless (default) | high: step reuse (profile base)")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, help=" | ".join(DTYPES))
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when present)")
    for flag, what in (("--encoder-tp", "text encoder tensor-parallel degree"),
                       ("--ulysses", "DiT Ulysses degree (divides the DiT's heads)"),
                       ("--ring", "DiT Ring degree (ulysses x ring = DiT ranks)"),
                       ("--vae-pp", "VAE patch-parallel degree (1 or ulysses x ring)")):
        p.add_argument(flag, type=int, default=1, help=f"{what}; >1 starts one process per rank (default 1)")
    p.add_argument("--adapter", default=None, help="FastH3 adapter (fastvideo-lora-v2 safetensors)")
    p.add_argument("--adapter-sha256", default=None, help="expected sha256 of --adapter (required with it)")
    p.add_argument("--checkpoint-manifest-sha256", default=None, metavar="HEX",
                   help="pin: the sha256 of the checkpoint's h3serve-manifest.json; every file is checked first")
    p.add_argument("--first-image", default=None, help="fl2va: first keyframe image")
    p.add_argument("--last-image", default=None, help="fl2va: last keyframe image")
    p.add_argument("--reference", action="append", default=[], metavar="KIND:PATH",
                   help="ref2va reference, repeatable: image:PATH or audio:PATH (wav)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("-o", "--output", required=True, help="MP4 path to write")
    _add_levers(p)
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from h3serve.config.request import validate_request

    t0 = time.perf_counter()
    raw = dict(prompt=args.prompt, seconds=args.seconds, size=args.size, seed=args.seed, task=args.task,
               profile=args.profile, steps=args.steps, dtype=args.dtype, first_image=args.first_image,
               last_image=args.last_image, references=args.reference or None, quality=args.quality)
    request = validate_request(**{k: v for k, v in raw.items() if v is not None})
    _check_output(args.output)
    levers = _levers(args)
    if args.server:
        if levers.any:
            raise H3Error("--server: the levers are the deployment's (h3serve serve flags), not a request's")
        return _generate_remote(args, t0)
    if not args.checkpoint:
        raise H3Error("generate needs --checkpoint DIR (embedded) or --server HOST:PORT (a running gateway)")
    if args.profile == "fasth3" and not (args.adapter and args.adapter_sha256):
        raise H3Error("profile=fasth3 needs --adapter FILE and --adapter-sha256 HEX (the fused FastH3 adapter)")
    if args.adapter and args.profile != "fasth3":
        raise H3Error("--adapter is only used with --profile fasth3 (per-request LoRA is not supported)")

    if args.checkpoint_manifest_sha256:
        from h3serve.weights.manifest import verify_manifest

        verify_manifest(args.checkpoint, args.checkpoint_manifest_sha256)

    degrees = ParallelDegrees(args.encoder_tp, args.ulysses, args.ring, args.vae_pp)
    if not degrees.trivial:   # before any rank starts: one visible device per rank on CUDA
        from h3serve.runtime.device import check_ranks_fit

        check_ranks_fit(degrees, args.device)

    from h3serve.pipeline import Pipeline

    _interrupt_twice("stopping: the pipeline and its ranks")
    pipe = Pipeline.load(
        args.checkpoint, profile=args.profile, adapter=args.adapter, adapter_sha256=args.adapter_sha256,
        dtype=args.dtype, device=args.device, tasks=(request.task,), encoder_tp=args.encoder_tp,
        ulysses=args.ulysses, ring=args.ring, vae_pp=args.vae_pp, levers=levers,
    )
    try:
        result = pipe.generate(request, args.output, progress=not args.no_progress)
    finally:
        pipe.close()
    timings = dict(result.timings)
    timings["load_s"] = pipe.load_seconds
    timings["wall_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"output": str(result.path), "frames": result.num_frames, "size": result.size,
                          "timings": timings}))
    else:
        print(f"wrote {result.path.resolve()} ({result.num_frames} frames, {result.size}, {result.bytes} bytes)")
        print("  " + "  ".join(f"{k}={v}" if isinstance(v, int) else f"{k}={v:.3f}" for k, v in timings.items()))
    return 0


def _interrupt_twice(what: str) -> None:
    """Ctrl-C says at once what it stops (then KeyboardInterrupt unwinds, closing the ranks); a second Ctrl-C ends
    the process at once."""
    import signal

    def on_sigint(_signum, _frame):
        if getattr(on_sigint, "seen", False):
            os.write(2, b"h3serve: interrupted again; exiting now\n")
            os._exit(130)
        on_sigint.seen = True
        os.write(2, f"h3serve: interrupted; {what} (Ctrl-C again to exit at once)\n".encode())
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)


def _check_output(path: str) -> None:
    """`-o` names a file that can be created, checked by creating it (os.access trusts root, and /proc says yes):
    the work it would hold is never spent on a path that cannot take it."""
    out_dir = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path) or not os.path.isdir(out_dir):
        raise H3Error(f"--output {path}: expected a file path in an existing, writable folder")
    existed = os.path.exists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise H3Error(f"--output {path}: cannot write there ({exc.strerror}); expected a file path in an existing, "
                      "writable folder") from None
    if not existed:
        os.unlink(path)


def _generate_remote(args: argparse.Namespace, t0: float) -> int:
    """`generate --server`: the same request through the SDK; the server's profile, dtype and device apply."""
    from h3serve.client import Client

    server_side = {"--device": args.device, "--adapter": args.adapter, "--adapter-sha256": args.adapter_sha256,
                   "--checkpoint": args.checkpoint,
                   "--checkpoint-manifest-sha256": args.checkpoint_manifest_sha256,
                   "--dtype": None if args.dtype == DEFAULT_DTYPE else args.dtype,
                   "--profile": None if args.profile == "base" else args.profile}
    given = [flag for flag, value in server_side.items() if value is not None]
    if given:
        raise H3Error(f"{', '.join(given)}: set on the server (h3serve serve), not with --server")
    fields = dict(seconds=float(args.seconds) if args.seconds is not None else None, size=args.size,
                  seed=int(args.seed) if args.seed is not None else None, task=args.task,
                  num_inference_steps=int(args.steps) if args.steps is not None else None,
                  first_image=args.first_image, last_image=args.last_image,   # the files' bytes go to the server
                  references=args.reference or None, quality=args.quality)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=100, desc="generate", unit="%", leave=False, file=sys.stderr)

    def on_progress(p) -> None:
        if bar is not None:
            bar.set_description(p.stage)
            bar.update(max(0.0, p.percent - bar.n))

    try:
        credentials = None
        if args.tls_ca:
            import grpc

            with open(args.tls_ca, "rb") as f:
                credentials = grpc.ssl_channel_credentials(f.read())
        with Client(args.server, api_key=args.api_key, credentials=credentials) as client:
            result = client.generate(args.prompt, output=args.output, timeout=args.timeout, on_progress=on_progress,
                                     **{k: v for k, v in fields.items() if v is not None})
    finally:
        if bar is not None:
            bar.close()
    timings = dict(result.timings)
    timings["wall_s"] = time.perf_counter() - t0
    acc = result.accepted
    size = f"{acc.width}x{acc.height}" if acc else ""
    frames = acc.num_frames if acc else 0
    if args.json:
        print(json.dumps({"output": str(result.path), "frames": frames, "size": size, "request_id": result.request_id,
                          "sha256": result.sha256, "timings": timings}))
    else:
        print(f"wrote {result.path.resolve()} ({frames} frames, {size}, {result.mp4_bytes} bytes)")
        print("  " + "  ".join(f"{k}={v:.3f}" for k, v in timings.items()))
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the stages as gRPC services (and the gateway's HTTP API)")
    _serve_arguments(p)
    p.set_defaults(func=_cmd_serve)


def _on_off(text: str) -> bool:
    value = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}.get(str(text).lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} must be on or off")
    return value


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    """`h3serve serve`'s flags; each --NAME fills StageConfig.NAME (defaults shown are StageConfig's)."""
    d = StageConfig()
    p.add_argument("--checkpoint", default=None, help="diffusers-format H3 folder (encoder, dit, vae stages)")
    p.add_argument("--stages", default="all", help="all, or a comma list of encoder,dit,vae,muxer,gateway")
    p.add_argument("--port", type=int, default=GRPC_PORT,
                   help="gRPC port: of the one stage, or of the gateway with stages at +1..+4 (0: free ports)")
    p.add_argument("--http-port", type=int, default=None,
                   help=f"HTTP API port of the gateway (0: a free port; default {HTTP_PORT} with the gateway, else none)")
    p.add_argument("--host", default=d.host, help="bind address (default loopback)")
    p.add_argument("--http-host", default=d.http_host)
    p.add_argument("--http-max-connections", type=int, default=d.http_max_connections,
                   help="gateway: HTTP connections held at once (more are answered 503 and closed)")
    p.add_argument("--http-header-timeout-s", type=float, default=d.http_header_timeout_s,
                   help="gateway: seconds a request's HTTP headers may take to arrive (then 408, closed)")
    p.add_argument("--http-body-timeout-s", type=float, default=d.http_body_timeout_s,
                   help="gateway: seconds a request body may go without a byte (then the connection is closed)")
    p.add_argument("--decode-workers", type=int, default=d.decode_workers,
                   help="gateway: threads that decode uploaded images and audio (a pool of their own)")
    p.add_argument("--decode-per-caller", type=int, default=d.decode_per_caller,
                   help="gateway: of those, how many one caller's uploads may use at once")
    p.add_argument("--advertise", default=None, help="address peers use to reach this stage (default host:port)")
    p.add_argument("--profile", default=d.profile, help="base | fasth3")
    p.add_argument("--adapter", default=None, help="FastH3 adapter (profile fasth3)")
    p.add_argument("--adapter-sha256", default=None)
    p.add_argument("--checkpoint-manifest-sha256", default=None, metavar="HEX",
                   help="pin: the sha256 of the checkpoint's h3serve-manifest.json (h3serve checkpoint manifest); "
                        "each model stage checks the files it loads before loading")
    p.add_argument("--dtype", default=d.dtype, help="fp32 | bf16")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per stage engine (0: default)")
    p.add_argument("--grace-s", type=float, default=d.grace_s, help="SIGTERM: seconds to finish in-flight work")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up request before SERVING")
    for flag, what in (("--encoder-tp", "encoder tensor-parallel degree"),
                       ("--ulysses", "DiT Ulysses degree (divides the DiT's heads)"),
                       ("--ring", "DiT Ring degree (ulysses x ring = DiT ranks)"),
                       ("--vae-pp", "VAE patch-parallel degree (1 or ulysses x ring)")):
        p.add_argument(flag, type=int, default=1,
                       help=f"{what}; >1 runs that stage as one process per rank, rank 0 serving gRPC (default 1)")
    for s in MODEL_STAGES + ("muxer",):
        p.add_argument(f"--{s}", default=None, metavar="HOST:PORT", help=f"gateway: address of the {s} stage")
    p.add_argument("--queue-size", type=int, default=d.queue_size, help="gateway: requests that may wait")
    p.add_argument("--max-inflight", type=int, default=d.max_inflight, help="gateway: requests run at once")
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s,
                   help="gateway: deadline of a request whose caller set none")
    p.add_argument("--jobs-dir", default=None,
                   help="gateway: HTTP jobs (records and MP4s) kept in this directory across restarts; with "
                        "--job-store, where MP4s are spooled (default: a temp dir, removed at exit)")
    p.add_argument("--job-store", default=None, metavar="s3://BUCKET/PREFIX",
                   help="gateway: HTTP jobs in an S3 bucket shared by every replica (endpoint and credentials: "
                        "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION)")
    p.add_argument("--job-ttl-s", type=float, default=d.job_ttl_s, help="gateway: finished jobs kept this long")
    p.add_argument("--max-jobs", type=int, default=d.max_jobs, help="gateway: finished jobs kept at most")
    p.add_argument("--api-keys-file", default=os.environ.get(API_KEYS_ENV), metavar="FILE",
                   help=f"gateway: callers' API keys, one 'NAME sha256:HEX' a line, re-read when it changes "
                        f"(default ${API_KEYS_ENV}; see docs/security.md)")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="this process's certificate: TLS on its gRPC server (and the gateway's HTTPS); plaintext "
                        "is then refused")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the key of --tls-cert")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="the deployment's CA: stages require peer certificates it signed (mTLS) and verify theirs")
    p.add_argument("--tls-peer-name", default=None, metavar="NAME",
                   help="the name checked in a peer's certificate instead of the host dialled (pods dialled by IP)")
    p.add_argument("--peers", default=None, metavar="LIST",
                   help="what a stage may dial when a request names an address: IP:PORT, NAME:PORT (an IP the name "
                        "resolves to, that port) or NET/LEN, comma separated (the launcher and the operator set it; "
                        "unset: any)")
    p.add_argument("--no-auth", action="store_true",
                   help="gateway: serve without API keys even on a non-loopback address (without keys the "
                        "gateway otherwise listens on loopback only)")
    p.add_argument("--no-peer-auth", action="store_true",
                   help="encoder, dit, vae, muxer: listen on a non-loopback address without mTLS (only where a "
                        "network policy fences the port; otherwise give --tls-cert, --tls-key and --tls-ca)")
    p.add_argument("--max-sync-bytes", type=int, default=d.max_sync_bytes,
                   help="gateway: largest MP4 GenerateSync returns in one message")
    p.add_argument("--transport", default=d.transport, choices=TRANSPORTS,
                   help="VAE -> muxer frame transport: grpc, or nixl (falls back to grpc with a warning when NIXL "
                        "cannot be loaded or the peers cannot connect)")
    p.add_argument("--model-name", default=None, help="gateway: model id reported and accepted in requests")
    p.add_argument("--fasth3-dit", default=None, metavar="HOST:PORT",
                   help="gateway of a base deployment: a FastH3 DiT pool (profile fasth3), used for model FastH3")
    p.add_argument("--fasth3-adapter", default=None,
                   help="launcher of a base deployment: also run a FastH3 DiT pool with this adapter on this host")
    p.add_argument("--fasth3-adapter-sha256", default=None)
    p.add_argument("--tasks", default=d.tasks,
                   help="tasks served: a comma list of t2va, fl2va, ref2va (ref2va: the DiT also loads "
                        "transformer_ref/, as large as transformer/)")
    p.add_argument("--encoder-cache-bytes", type=int, default=d.encoder_cache_bytes,
                   help="encoder: bytes of encodings cached for repeated prompts / references (0: off)")
    p.add_argument("--frame-format", default=d.frame_format, choices=("yuv420p", "rgb24"),
                   help="vae: frames to the muxer as yuv420p planes made on the device, or rgb24")
    p.add_argument("--mux-threads", type=int, default=d.mux_threads, help="muxer: x264 threads (fixed)")
    p.add_argument("--crf", type=int, default=d.crf)
    p.add_argument("--preset", default=d.preset)
    p.add_argument("--session-ttl-s", type=float, default=d.session_ttl_s,
                   help="muxer: an unfetched session is dropped after this long")
    p.add_argument("--max-session-ttl-s", type=float, default=d.max_session_ttl_s,
                   help="muxer: the largest TTL a session may ask for")
    p.add_argument("--max-sessions", type=int, default=d.max_sessions,
                   help="muxer: sessions held at once (more are refused as RESOURCE_EXHAUSTED)")
    p.add_argument("--max-sessions-per-peer", type=int, default=d.max_sessions_per_peer,
                   help="muxer: sessions one caller (by its address: a gateway replica) holds at once")
    p.add_argument("--tmp-dir", default=None, help="muxer: where MP4s are assembled")
    p.add_argument("--start-timeout", type=float, default=600.0, help="launcher: seconds to wait for health")
    p.add_argument("--no-restart", action="store_true", help="launcher: stop everything when a stage dies")
    p.add_argument("--json", action="store_true", help="launcher: print endpoints and events as JSON lines")
    _add_levers(p)


def _add_levers(p: argparse.ArgumentParser) -> None:
    """The capacity and speed levers (config/levers.py): the same flags for `serve` and the embedded `generate`."""
    d = StageConfig()
    p.add_argument("--dit-resident-blocks", type=int, default=None, metavar="R",
                   help=f"dit: layerwise offload, R DiT blocks on the GPU ({MIN_RESIDENT_BLOCKS}..{DIT_LAYERS}), the "
                        "rest streamed from pinned host memory (default: all resident)")
    p.add_argument("--dit-offload-mode", default=d.dit_offload_mode, choices=OFFLOAD_MODES,
                   help="dit: with several ranks, each pins the whole host copy (local) or a shard (allgather)")
    p.add_argument("--encoder-resident-layers", type=int, default=None, metavar="R",
                   help=f"encoder: layerwise offload, R text decoder layers on the GPU ({MIN_RESIDENT_BLOCKS}.."
                        f"{ENCODER_LAYERS}), the rest streamed from pinned host memory (default: all resident)")
    p.add_argument("--vae-staged", type=_on_off, default=d.vae_staged, metavar="on|off",
                   help="vae: both VAEs in pinned host memory, copied to the GPU for each request (default off)")
    p.add_argument("--fp8", type=_on_off, default=d.fp8, metavar="on|off",
                   help="dit, encoder: FP8 linear layers in the DiT blocks and the text decoder (lossy; default off)")
    p.add_argument("--fp8-attention", type=_on_off, default=d.fp8_attention, metavar="on|off",
                   help="dit: FP8 attention, FlashAttention-3's FP8 forward (lossy; default off)")


def _levers(args: argparse.Namespace) -> Levers:
    """The levers the flags ask for, checked (range, the combination rule, the VAE's degree) before anything loads."""
    levers = Levers(args.dit_resident_blocks, args.dit_offload_mode, args.fp8, args.fp8_attention,
                    args.encoder_resident_layers, args.vae_staged).check()
    check_combination(args.profile, levers, names=CLI_NAMES)
    conflict = staging_conflict(levers, args.vae_pp)
    if conflict is not None:
        raise LeverError("--vae-staged", conflict)
    return levers


def _servicer(stage: str):
    """The servicer class of the one stage this process runs (a launcher imports none: its children do)."""
    if stage == "gateway":
        from h3serve.services.gateway.server import GatewayServicer
        return GatewayServicer
    if stage == "encoder":
        from h3serve.services.encoder import EncoderServicer
        return EncoderServicer
    if stage == "dit":
        from h3serve.services.dit import DiTServicer
        return DiTServicer
    if stage == "vae":
        from h3serve.services.vae import VAEServicer
        return VAEServicer
    from h3serve.services.muxer import MuxerServicer
    return MuxerServicer


def _gateway_exposure(config) -> None:
    """The gateway's host/key rule, checked before any stage starts (the gateway checks it again when it loads)."""
    from h3serve.services.gateway.auth import check_exposure

    check_exposure(config.api_keys_file, config.no_auth,
                   (config.host,) + ((config.http_host,) if config.http_port is not None else ()))


def _cmd_serve(args: argparse.Namespace) -> int:
    # lazy: torch, grpc and the models load only for the command that runs
    from h3serve.runtime.launcher import serve_main

    _levers(args)  # before anything starts
    return serve_main(args, _servicer, prechecks={"gateway": _gateway_exposure})


def _add_checkpoint(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="make or inspect checkpoints and adapters")
    csub = p.add_subparsers(dest="checkpoint_cmd", required=True)

    init = csub.add_parser("init", help="write a random checkpoint in the diffusers layout")
    init.add_argument("--preset", default="tiny", choices=["tiny", "tiny8", "full"],
                      help="tiny (2 DiT heads), tiny8 (8 DiT heads, 8 encoder heads / KV heads: degree 8 dry runs), "
                           "or full (released geometry and stored dtypes, random values, ~143 GB: GPU benchmarks)")
    init.add_argument("--with-ref", action="store_true",
                      help="full: also write transformer_ref/ (another 66 GB; needed only for ref2va)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("dir")
    init.set_defaults(func=_cmd_checkpoint_init)

    adapter = csub.add_parser("init-adapter", help="write a synthetic FastH3 adapter for a checkpoint")
    adapter.add_argument("--checkpoint", required=True)
    adapter.add_argument("--rank", type=int, default=4)
    adapter.add_argument("--seed", type=int, default=0)
    adapter.add_argument("-o", "--output", required=True)
    adapter.set_defaults(func=_cmd_checkpoint_init_adapter)

    manifest = csub.add_parser("manifest", help="write DIR/h3serve-manifest.json: every file's size and sha256 "
                                                "(hashed in parallel); prints the manifest's sha256 to pin")
    manifest.add_argument("--workers", type=int, default=None, help="files hashed at once (default: cores, <= 16)")
    manifest.add_argument("dir")
    manifest.set_defaults(func=_cmd_checkpoint_manifest)

    info = csub.add_parser("info", help="describe a checkpoint folder")
    info.add_argument("dir")
    info.set_defaults(func=_cmd_checkpoint_info)


def _cmd_checkpoint_init(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if args.preset == "full":
        from h3serve.testing.fullsize import init_full_checkpoint  # lazy: fixtures load only for this command

        def progress(component: str, seconds: float, nbytes: int) -> None:
            rate = nbytes / 1e6 / max(seconds, 1e-9)
            print(f"  {component}: {nbytes / 1e9:.1f} GB in {seconds:.0f}s ({rate:.0f} MB/s)", flush=True)

        init_full_checkpoint(args.dir, seed=args.seed, with_ref=args.with_ref, progress=progress)
        print(f"wrote {args.preset} checkpoint {args.dir} in {time.perf_counter() - t0:.1f}s")
        return 0
    if args.with_ref:
        raise H3Error("--with-ref is only used with --preset full (tiny checkpoints always have transformer_ref/)")
    from h3serve.testing.tiny import init_tiny_checkpoint  # lazy: fixtures load only for this command

    init_tiny_checkpoint(args.dir, seed=args.seed, preset=args.preset)
    print(f"wrote {args.preset} checkpoint {args.dir} in {time.perf_counter() - t0:.1f}s")
    return 0


def _cmd_checkpoint_init_adapter(args: argparse.Namespace) -> int:
    from h3serve.testing.adapters import init_adapter  # lazy: fixtures load only for this command

    digest = init_adapter(args.checkpoint, args.output, rank=args.rank, seed=args.seed)
    print(f"wrote {args.output}\nsha256 {digest}")
    return 0


def _cmd_checkpoint_manifest(args: argparse.Namespace) -> int:
    from h3serve.weights.manifest import write_manifest

    t0 = time.perf_counter()
    path, digest = write_manifest(args.dir, workers=args.workers)
    files = len(json.loads(path.read_text())["files"])
    print(f"wrote {path} ({files} files in {time.perf_counter() - t0:.1f}s)\nsha256 {digest}")
    return 0


def _cmd_checkpoint_info(args: argparse.Namespace) -> int:
    from h3serve.weights.folder import describe

    print(json.dumps(describe(args.dir), indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="h3serve", description="Serve MiniMax H3 and FastH3.")
    parser.add_argument("--log-level", default=os.environ.get("H3SERVE_LOG", "WARNING"))
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_checkpoint(sub)
    try:
        from h3serve.operator.cli import add_subcommands
    except ImportError:  # lazy and guarded: without the operator extras the model commands still work
        pass
    else:
        add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()   # here, so that a reader gone away (`| head`) is the BrokenPipeError below
        return code
    except BrokenPipeError:
        # the reader of our output left (`h3serve checkpoint info DIR | head`): quiet, as a tool killed by SIGPIPE;
        # stdout goes to /dev/null so that the interpreter's own last flush does not complain
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_SIGPIPE
    except H3Error as exc:
        print(f"h3serve: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("h3serve: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - last line of defence: one line, no traceback
        if os.environ.get("H3SERVE_DEBUG"):
            raise
        print(f"h3serve: internal error: {type(exc).__name__}: {exc} (H3SERVE_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
