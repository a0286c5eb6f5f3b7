"""Peer processes for the NIXL transport tests: one function per role, run in separate processes (forkserver
children preloaded with torch and the transport), each with its own NIXL agent. Results go back on a queue as
plain dicts; nothing here asserts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import psutil
import torch

from h3serve.errors import TransportError
from h3serve.transport.choice import select_transport
from h3serve.transport.nixl.probe import counters, nixl_available
from h3serve.transport.nixl.receiver import NixlReceiver
from h3serve.transport.nixl.sender import NixlSender
from h3serve.transport.pipes import QueuePipe, SocketPipe

EDGE = "vae->muxer"
CLIP = (17, 768, 1344, 3)   # one clip of frames, (T, H, W, C) uint8: 52.6 MB


# ----------------------------------------------------------------------------------------------------------------
# Payloads (deterministic, so both sides can name what they expect)


def dtype_cases(big_bytes: int = 3 << 20):
    """(name, tensor or None, meta) covering every wire dtype, odd shapes, a non-contiguous view, a multi-part one."""
    g = torch.Generator().manual_seed(1234)
    out = [
        ("frame", torch.randint(0, 256, (768, 1344, 3), generator=g, dtype=torch.uint8), {"index": 0}),
        ("i8", torch.randint(-128, 128, (33, 7), generator=g, dtype=torch.int8), {}),
        ("i16", torch.randint(-2**15, 2**15, (5, 3, 2), generator=g, dtype=torch.int16), {}),
        ("i32", torch.randint(-2**31, 2**31 - 1, (1000,), generator=g, dtype=torch.int32), {}),
        ("i64", torch.randint(-2**62, 2**62, (4, 4), generator=g, dtype=torch.int64), {"k": [1, 2]}),
        ("f16", torch.randn(17, 9, generator=g).to(torch.float16), {}),
        ("bf16", torch.randn(2, 3, 64, generator=g).to(torch.bfloat16), {}),
        ("f32", torch.randn(3, 5, 7, generator=g), {"scale": 0.5}),
        ("f64", torch.randn(11, generator=g, dtype=torch.float64), {}),
        ("mask", torch.rand(6, 10, generator=g) > 0.5, {}),
        ("scalar", torch.tensor(3.25), {}),
        ("empty", torch.empty(0, 3), {}),
        ("transposed", torch.randn(64, 48, generator=g).t(), {"contiguous": False}),
        ("control", None, {"event": "clip-boundary", "n": 3}),
        ("big", torch.randint(0, 256, (big_bytes,), generator=g, dtype=torch.uint8), {"parts": "several"}),
        ("pcm", torch.randn(2, 32000, generator=g), {"rate": 32000}),
    ]
    return out


def raw(t: torch.Tensor):
    """The tensor's C-contiguous bytes as a numpy uint8 array (also for 0-d and empty tensors)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def digest(name, tensor, meta) -> tuple:
    if tensor is None:
        return (name, None, None, None, meta)
    return (name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
            hashlib.sha256(raw(tensor)).hexdigest(), meta)


def clip(base: torch.Tensor, i: int) -> torch.Tensor:
    return base + i  # uint8 wraps; a new tensor per clip, like a decoder's output


# ----------------------------------------------------------------------------------------------------------------
# Logging capture (the reason must reach the logs)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def _capture() -> _Capture:
    h = _Capture()
    lg = logging.getLogger("h3serve.transport.nixl")   # every module of the package logs below it
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    return h


def _setup(opts: dict):
    for k, v in (opts.get("env") or {}).items():
        os.environ[k] = v
    torch.set_num_threads(1)
    return _capture()


def _error_info(e: BaseException, t0: float) -> dict:
    return {"type": type(e).__name__, "message": str(e), "edge": getattr(e, "edge", None),
            "elapsed": time.monotonic() - t0}


# ----------------------------------------------------------------------------------------------------------------
# Receiver


def receiver_main(pipe, q, opts: dict) -> None:
    cap = _setup(opts)
    res = {"role": "receiver", "pid": os.getpid(), "got": [], "error": None}
    rx = None
    t0 = time.monotonic()
    try:
        if opts.get("stale_handshake"):
            # A handshake whose agent is gone (its NIXL endpoint is dead) while the control pipe works.
            ghost = NixlReceiver(EDGE, SocketPipe.pair()[0], **opts.get("rx", {}))
            stale = ghost.handshake()
            ghost.close()
        rx = NixlReceiver(EDGE, pipe, **opts.get("rx", {}))
        res["offered"] = rx.transport_info
        pipe.send(stale if opts.get("stale_handshake") else rx.handshake())
        n = 0
        while True:
            if opts.get("stall_after") is not None and n == opts["stall_after"]:
                time.sleep(opts.get("stall_s", 30))
            t0 = time.monotonic()
            msg = rx.recv(timeout=opts.get("recv_timeout"))
            if msg is None:
                break
            n += 1
            if opts.get("verify") == "crc":
                res["got"].append((msg.meta.get("i"), zlib.crc32(raw(msg.tensor)) == msg.meta.get("crc"),
                                   tuple(msg.tensor.shape)))
            elif opts.get("verify") == "count":
                res["got"].append(msg.tensor.numel() if msg.tensor is not None else 0)
            else:
                name = msg.header.name if msg.header else msg.meta.get("_name")
                res["got"].append(digest(name, msg.tensor, {k: v for k, v in msg.meta.items() if k != "_name"}))
            if opts.get("slow_s"):
                time.sleep(opts["slow_s"])
            if opts.get("die_after") is not None and n >= opts["die_after"]:
                os.kill(os.getpid(), signal.SIGKILL)
        res["elapsed"] = time.monotonic() - t0
    except TransportError as e:
        res["error"] = _error_info(e, t0)
    finally:
        if rx is not None:
            res["transport"] = rx.transport_info
            res["stats"] = dict(rx.stats)
            rx.close()
        res["counters"] = counters()
        res["logs"] = cap.lines
        q.put(res)


# ----------------------------------------------------------------------------------------------------------------
# Sender


def _payload(opts: dict):
    kind = opts.get("payload", "dtypes")
    if kind == "dtypes":
        yield from dtype_cases(opts.get("big_bytes", 3 << 20))
    elif kind == "frames":
        base = torch.randint(0, 256, CLIP, generator=torch.Generator().manual_seed(7), dtype=torch.uint8)
        for i in range(opts.get("clips", 20)):
            t = clip(base, i)
            yield "frames", t, {"i": i, "crc": zlib.crc32(raw(t))}
    elif kind == "blobs":
        for i in range(opts.get("count", 8)):
            yield "blob", torch.full((opts.get("size", 1 << 20),), i % 251, dtype=torch.uint8), {"i": i}
    else:
        raise ValueError(kind)


def sender_main(pipe, q, opts: dict, progress=None) -> None:
    """`progress` (a Connection) gets n once `progress_at` messages are sent: the signal to SIGKILL this process.

    Not sent on `q`: a Queue writes from a feeder thread that holds the queue's cross-process lock meanwhile, so a
    process killed just after `put` can die holding it, and the survivor's `q.put` of its result then never lands
    (its feeder blocks on that lock, and its exit waits on the feeder). `Connection.send` returns once the bytes are
    written, with no lock held.
    """
    cap = _setup(opts)
    res = {"role": "sender", "pid": os.getpid(), "sent": [], "error": None}
    tx = None
    t0 = time.monotonic()
    try:
        tx = NixlSender(EDGE, pipe, **opts.get("tx", {}))
        tx.connect(pipe.recv(30))
        res["chosen"] = tx.transport
        t_start = time.monotonic()
        for n, (name, tensor, meta) in enumerate(_payload(opts)):
            if opts.get("die_after") is not None and n == opts["die_after"]:
                os.kill(os.getpid(), signal.SIGKILL)
            if opts.get("stall_after") is not None and n == opts["stall_after"]:
                time.sleep(opts.get("stall_s", 30))
            if opts.get("progress_at") is not None and n == opts["progress_at"]:
                progress.send(n)
            t0 = time.monotonic()
            tx.send(name, tensor, meta if tensor is not None else {**meta, "_name": name},
                    timeout=opts.get("send_timeout"))
            res["sent"].append(digest(name, tensor, meta) if opts.get("payload", "dtypes") == "dtypes" else n)
        t0 = time.monotonic()
        tx.close()
        res["elapsed"] = time.monotonic() - t_start
    except (TransportError, EOFError, TimeoutError) as e:
        res["error"] = _error_info(e, t0)
    finally:
        if tx is not None:
            res["transport"] = tx.transport_info
            res["stats"] = dict(tx.stats)
            tx.abort("test peer finished")
        res["counters"] = counters()
        res["logs"] = cap.lines
        q.put(res)


# ----------------------------------------------------------------------------------------------------------------
# select_transport, in a process of its own


def select_main(q, opts: dict) -> None:
    cap = _setup(opts)
    out = {}
    out["available"] = nixl_available()
    out["grpc"] = select_transport("grpc")
    out["nixl"] = select_transport("nixl")

    def probe():
        raise ConnectionRefusedError("no route to the muxer's NIXL agent")

    out["nixl_probe_fails"] = select_transport("nixl", probe=probe)
    try:
        select_transport("rdma")
    except ValueError as e:
        out["invalid"] = str(e)
    out["logs"] = cap.lines
    out["counters"] = counters()
    q.put(out)


# ----------------------------------------------------------------------------------------------------------------
# The survivor of many failed streams (leak check), and the peers that die on it


def survivor_main(conn, opts: dict) -> None:
    """Serve one stream per command on a loopback listener, playing the role the connecting peer does not (the peer
    names its role first). Reports each stream's outcome with RSS / fds / threads / NIXL counters after it."""
    _setup(opts)
    proc = psutil.Process()
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)
    conn.send(lsock.getsockname()[1])
    rounds = []
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        s, _ = lsock.accept()
        pipe = SocketPipe(s)
        role = "sender" if pipe.recv(30) == b"receiver" else "receiver"   # the peer says what it plays
        r = {"role": role, "error": None, "ok": 0}
        t0 = time.monotonic()
        try:
            if role == "receiver":
                with NixlReceiver(EDGE, pipe, **opts.get("rx", {})) as rx:
                    pipe.send(rx.handshake())
                    r["transport"] = rx.transport
                    while rx.recv(timeout=opts.get("timeout", 20)) is not None:
                        r["ok"] += 1
            else:
                with NixlSender(EDGE, pipe, **opts.get("tx", {})) as tx:
                    tx.connect(pipe.recv(30))
                    r["transport"] = tx.transport
                    for name, t, meta in _payload({"payload": "blobs", "count": cmd.get("count", 12),
                                                   "size": opts.get("size", 4 << 20)}):
                        tx.send(name, t, meta, timeout=opts.get("timeout", 20))
                        r["ok"] += 1
        except TransportError as e:
            r["error"] = _error_info(e, t0)
        finally:
            pipe.close()
        r["elapsed"] = time.monotonic() - t0
        r["rss"] = proc.memory_info().rss
        r["fds"] = proc.num_fds()
        r["threads"] = proc.num_threads()
        r["counters"] = counters()
        rounds.append(r)
        conn.send(r)
    lsock.close()


def dying_peer_main(port: int, role: str, opts: dict) -> None:
    """Connect to the survivor, play `role` for a few messages, then SIGKILL ourselves mid-stream."""
    _setup(opts)
    s = socket.create_connection(("127.0.0.1", port))
    pipe = SocketPipe(s)
    pipe.send(role.encode())
    if role == "receiver":
        rx = NixlReceiver(EDGE, pipe, **opts.get("rx", {}))
        pipe.send(rx.handshake())
        for _ in range(opts.get("die_after", 2)):
            rx.recv(timeout=20)
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        tx = NixlSender(EDGE, pipe, **opts.get("tx", {}))
        tx.connect(pipe.recv(30))
        for n, (name, t, meta) in enumerate(_payload({"payload": "blobs", "count": 12,
                                                       "size": opts.get("size", 4 << 20)})):
            if n == opts.get("die_after", 2):
                os.kill(os.getpid(), signal.SIGKILL)
            tx.send(name, t, meta, timeout=20)


def healthy_peer_main(port: int, role: str, opts: dict, q) -> None:
    _setup(opts)
    s = socket.create_connection(("127.0.0.1", port))
    pipe = SocketPipe(s)
    pipe.send(role.encode())
    out = {"role": role, "n": 0}
    try:
        if role == "receiver":
            with NixlReceiver(EDGE, pipe, **opts.get("rx", {})) as rx:
                pipe.send(rx.handshake())
                while (m := rx.recv(timeout=20)) is not None:
                    out["n"] += int(bool((m.tensor == m.meta["i"] % 251).all()))
                out["transport"] = rx.transport
        else:
            with NixlSender(EDGE, pipe, **opts.get("tx", {})) as tx:
                tx.connect(pipe.recv(30))
                for name, t, meta in _payload({"payload": "blobs", "count": 12, "size": opts.get("size", 4 << 20)}):
                    tx.send(name, t, meta, timeout=20)
                    out["n"] += 1
                out["transport"] = tx.transport
    except TransportError as e:
        out["error"] = str(e)
    q.put(out)


# ----------------------------------------------------------------------------------------------------------------
# The control pipe on a real gRPC bidi stream (what the services do): QueuePipe on both ends


GRPC_SERVICE = "h3serve.test.Edge"


def grpc_receiver_main(port_q, q, opts: dict) -> None:
    """A gRPC server whose bidi method `Pipe` runs one NixlReceiver per call over a QueuePipe."""
    import grpc  # lazy: only the gRPC peers load grpc, not the forkserver every peer is forked from

    cap = _setup(opts)
    done = threading.Event()

    def run(pipe):
        res = {"role": "receiver", "got": [], "error": None}
        t0 = time.monotonic()
        try:
            with NixlReceiver(EDGE, pipe, **opts.get("rx", {})) as rx:
                pipe.send(rx.handshake())
                try:
                    while (msg := rx.recv(timeout=opts.get("recv_timeout", 20))) is not None:
                        t0 = time.monotonic()
                        name = msg.header.name if msg.header else msg.meta.get("_name")
                        res["got"].append(digest(name, msg.tensor, {k: v for k, v in msg.meta.items()
                                                                     if k != "_name"}))
                except TransportError as e:
                    res["error"] = _error_info(e, t0)
                res["transport"] = rx.transport_info
        finally:
            pipe.close()
            res["counters"] = counters()
            res["logs"] = cap.lines
            q.put(res)
            done.set()

    def handler(request_iterator, context):
        pipe = QueuePipe()
        pipe.pump(request_iterator)
        context.add_callback(lambda: pipe.feed_eof("gRPC call ended"))
        threading.Thread(target=run, args=(pipe,), daemon=True).start()
        return pipe.outgoing()

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        GRPC_SERVICE, {"Pipe": grpc.stream_stream_rpc_method_handler(handler)})])
    port_q.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    done.wait(120)
    server.stop(grace=1)


def grpc_sender_main(port: int, q, opts: dict) -> None:
    import grpc  # lazy: only the gRPC peers load grpc, not the forkserver every peer is forked from

    cap = _setup(opts)
    res = {"role": "sender", "sent": [], "error": None}
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    pipe = QueuePipe()
    pipe.pump(channel.stream_stream(f"/{GRPC_SERVICE}/Pipe")(pipe.outgoing()))
    try:
        with NixlSender(EDGE, pipe, **opts.get("tx", {})) as tx:
            tx.connect(pipe.recv(30))
            for n, (name, tensor, meta) in enumerate(_payload(opts)):
                if opts.get("die_after") is not None and n == opts["die_after"]:
                    os.kill(os.getpid(), signal.SIGKILL)
                tx.send(name, tensor, meta if tensor is not None else {**meta, "_name": name})
                res["sent"].append(digest(name, tensor, meta) if opts.get("payload", "dtypes") == "dtypes" else n)
            res["transport"] = tx.transport_info
    except TransportError as e:
        res["error"] = str(e)
    pipe.close()
    res["counters"] = counters()
    res["logs"] = cap.lines
    q.put(res)
