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

from h3serve.config.codec import unwrap_optional
from h3serve.config.levers import CLI_NAMES, LeverError, Levers, check_combination, staging_conflict
from h3serve.config.levers import add_flags as add_lever_flags, from_args as lever_flags
from h3serve.config.parallel import ParallelDegrees
from h3serve.config.request import FIELD_TYPES, REQUEST_FIELDS
from h3serve.config.stage import API_KEY_ENV, KNOB_TYPES, KNOBS
from h3serve.config.vocab import DEFAULT_DTYPE, EXIT_USER_ERROR
from h3serve.errors import H3Error
from h3serve.runtime.prechecks import check_serve

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
    _add_request_flags(p, media=False)
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when present)")
    _degree_flags(p, "starts one process per rank")
    p.add_argument("--adapter", default=None, help="FastH3 adapter (fastvideo-lora-v2 safetensors)")
    p.add_argument("--adapter-sha256", default=None, help="expected sha256 of --adapter (required with it)")
    p.add_argument("--loras", default=None, metavar=KNOBS["loras"].metadata["metavar"],
                   help="LoRA adapters --lora may name (profile base; as h3serve serve --loras)")
    p.add_argument("--checkpoint-manifest-sha256", default=None, metavar="HEX",
                   help="pin: the sha256 of the checkpoint's h3serve-manifest.json; every file is checked first")
    _add_request_flags(p, media=True)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("-o", "--output", required=True, help="MP4 path to write")
    add_lever_flags(p)
    p.set_defaults(func=_cmd_generate)


# `generate`'s request flags: the rows of the request's field table that have one (config/request.py)
CLI_FIELDS = [row for row in REQUEST_FIELDS if row.metadata["cli"] is not None]


def _flag(row) -> str:
    return row.metadata["cli"].get("flag", "--" + row.name.replace("_", "-"))


def _add_request_flags(p: argparse.ArgumentParser, *, media: bool) -> None:
    """The request's flags, its media files (`media`) after the pipeline's own flags."""
    for row in CLI_FIELDS:
        if bool(row.metadata["media"]) == media:
            kwargs = {k: v for k, v in row.metadata["cli"].items() if k != "flag"}
            p.add_argument(_flag(row), **({"required": True} if row.metadata["required"] else {}), **kwargs)


def _request_flags(args: argparse.Namespace) -> dict:
    """request field -> the value its flag was given (flags left unset, and an empty list, left out)."""
    values = {row.name: getattr(args, _flag(row).lstrip("-").replace("-", "_")) for row in CLI_FIELDS}
    return {name: value for name, value in values.items() if value is not None and value != []}


def _cmd_generate(args: argparse.Namespace) -> int:
    from h3serve.config.request import validate_request

    t0 = time.perf_counter()
    flags = _request_flags(args)
    flags.pop("model", None)   # the gateway's pool: checked there
    keyframes = [flag for flag, name in (("--first-image", "first_image"), ("--last-image", "last_image"))
                 if name in flags]
    if keyframes and flags.get("task", "fl2va") != "fl2va":
        raise H3Error(f"{', '.join(keyframes)}: keyframes are task fl2va's (they imply it), but --task is "
                      f"{flags['task']}; drop --task or give --task fl2va")
    request = validate_request(**flags)
    _check_output(args.output)
    levers = _levers(args)
    if args.server:
        if levers.any:
            raise H3Error("--server: the levers are the deployment's (h3serve serve flags), not a request's")
        if args.loras:
            raise H3Error("--server: the LoRA adapters are the deployment's (h3serve serve --loras); name one with "
                          "--lora")
        return _generate_remote(args, t0)
    if args.model is not None:
        raise H3Error(f"--model {args.model}: selects a pool of a gateway (with --server); in this process the "
                      "model is --profile's (base | fasth3)")
    if not args.checkpoint:
        raise H3Error("generate needs --checkpoint DIR (embedded) or --server HOST:PORT (a running gateway)")
    if args.profile == "fasth3" and not (args.adapter and args.adapter_sha256):
        raise H3Error("profile=fasth3 needs --adapter FILE and --adapter-sha256 HEX (the fused FastH3 adapter)")
    if args.adapter and args.profile != "fasth3":
        raise H3Error("--adapter is only used with --profile fasth3 (a LoRA for profile base: --loras and --lora)")

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
        ulysses=args.ulysses, ring=args.ring, vae_pp=args.vae_pp, levers=levers, loras=args.loras,
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
    from h3serve.client import FIELDS as SDK_FIELDS, Client

    server_side = {"--device": args.device, "--adapter": args.adapter, "--adapter-sha256": args.adapter_sha256,
                   "--checkpoint": args.checkpoint,
                   "--checkpoint-manifest-sha256": args.checkpoint_manifest_sha256,
                   "--dtype": None if args.dtype == DEFAULT_DTYPE else args.dtype,
                   "--profile": None if args.profile == "base" else args.profile}
    given = [flag for flag, value in server_side.items() if value is not None]
    if given:
        raise H3Error(f"{', '.join(given)}: set on the server (h3serve serve), not with --server")
    # the SDK's keywords (the files' bytes go to the server), numbers as their type (validated above)
    types = {row.name: (FIELD_TYPES[row.name], row.metadata["json"]) for row in CLI_FIELDS}
    fields = {types[name][1]: types[name][0](value) if types[name][0] in (int, float) else value
              for name, value in _request_flags(args).items() if types[name][1] in SDK_FIELDS}
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
                                     **fields)
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


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    """`h3serve serve`'s flags: one a knob of StageConfig's parts (its `knob` metadata; --NAME fills the knob NAME),
    the degrees, the levers (their table), and the launcher's own."""
    p.add_argument("--stages", default="all", help="all, or a comma list of encoder,dit,vae,muxer,gateway")
    for fl in KNOBS.values():
        md = fl.metadata
        if md["flag"] is None:
            continue
        flag = md["flag"] or "--" + fl.name.replace("_", "-")
        kind, _ = unwrap_optional(KNOB_TYPES[fl.name])
        if kind is bool:   # a switch: on, or off where the field defaults to on (--no-warmup)
            p.add_argument(flag, dest=fl.name, action="store_false" if fl.default else "store_true", help=md["help"])
            continue
        default = os.environ.get(md["env"]) if md["env"] else md["cli_default"] or fl.default
        p.add_argument(flag, dest=fl.name, type=None if kind is str else kind, default=default,
                       metavar=md["metavar"], choices=md["choices"], help=md["help"])
    _degree_flags(p, "runs that stage as one process per rank, rank 0 serving gRPC")
    p.add_argument("--start-timeout", type=float, default=600.0, help="launcher: seconds to wait for health")
    p.add_argument("--no-restart", action="store_true", help="launcher: stop everything when a stage dies")
    p.add_argument("--json", action="store_true", help="launcher: print endpoints and events as JSON lines")
    add_lever_flags(p)


def _degree_flags(p: argparse.ArgumentParser, more: str) -> None:
    """The parallel degrees (ParallelDegrees' fields); `more`: what a degree above 1 does here."""
    for flag, what in (("--encoder-tp", "encoder tensor-parallel degree"),
                       ("--ulysses", "DiT Ulysses degree (divides the DiT's heads)"),
                       ("--ring", "DiT Ring degree (ulysses x ring = DiT ranks)"),
                       ("--vae-pp", "VAE patch-parallel degree (1 or ulysses x ring)")):
        p.add_argument(flag, type=int, default=1, help=f"{what}; >1 {more} (default 1)")


def _levers(args: argparse.Namespace) -> Levers:
    """The levers the flags ask for, checked (range, the combination rule, the VAE's degree) before anything loads."""
    levers = lever_flags(args).check()
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


def _cmd_serve(args: argparse.Namespace) -> int:
    _levers(args)
    plan = check_serve(args)   # every mistake is one line before torch is imported
    # lazy: torch, grpc and the models load only for the command that runs
    from h3serve.runtime.launcher import serve_main

    return serve_main(args, plan, _servicer)


def _add_checkpoint(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="make or inspect checkpoints and adapters")
    csub = p.add_subparsers(dest="checkpoint_cmd", required=True)

    init = csub.add_parser("init", help="write a random checkpoint in the diffusers layout")
    init.add_argument("--preset", default="tiny", choices=["tiny", "tiny8", "full"],
                      help="tiny (2 DiT heads), tiny8 (8 DiT heads, 8 encoder heads / KV heads: degree 8 dry runs), "
                           "or full (released geometry and stored dtypes, random values, ~143 GB: GPU benchmarks)")
    init.add_argument("--with-ref", action="store_true",
                      help="full: also write transformer_ref/ (another 66 GB; needed only for ref2va)")
    init.add_argument("--synthetic", action="store_true",
                      help="full: the random tensors are generated when loaded, not stored (a few MB of disk; "
                           "other values than a written checkpoint of the same seed)")
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

        init_full_checkpoint(args.dir, seed=args.seed, with_ref=args.with_ref, progress=progress,
                             synthetic=args.synthetic)
        print(f"wrote {args.preset} checkpoint {args.dir} in {time.perf_counter() - t0:.1f}s")
        return 0
    if args.with_ref or args.synthetic:
        flag = "--with-ref" if args.with_ref else "--synthetic"
        raise H3Error(f"{flag} is only used with --preset full (a tiny checkpoint is small and always complete)")
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
