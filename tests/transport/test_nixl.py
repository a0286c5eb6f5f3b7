"""NIXL transport between real processes on loopback: every test starts fresh peer processes (forkserver children
preloaded with torch and the transport), each with its own NIXL agent (UCX backend), joined by a socket control
pipe. CPU only: the pools are DRAM and UCX moves the bytes by cross-memory attach / shared memory / TCP.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import queue
import signal
import time

import pytest

from h3serve.transport.nixl.wire import decode_handshake, encode_handshake
from h3serve.transport.pipes import QueuePipe, SocketPipe

from . import peers

HAVE_NIXL = importlib.util.find_spec("nixl") is not None
needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="nixl is not installed (pip install 'h3serve[nixl]')")
EDGE = peers.EDGE
MB = 1 << 20


@pytest.fixture(scope="module")
def ctx():
    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["torch", peers.__name__])   # peers imports the transport
    return c


def run_pair(ctx, rx_opts: dict, tx_opts: dict, *, timeout: float = 90, kill: str | None = None) -> dict:
    """Start a receiver and a sender process joined by a socket pipe; return {role: result}. `kill` ("receiver" |
    "sender") SIGKILLs that peer from outside once the sender reports `progress_at` messages sent."""
    a, b = SocketPipe.pair()
    q = ctx.Queue()
    # The victim must not share a lock with the survivor's report: progress comes on a pipe of its own, and neither
    # peer has touched `q` when it is killed.
    progress_r, progress_w = ctx.Pipe(duplex=False)
    procs = {"receiver": ctx.Process(target=peers.receiver_main, args=(a, q, rx_opts)),
             "sender": ctx.Process(target=peers.sender_main, args=(b, q, tx_opts, progress_w))}
    for p in procs.values():
        p.start()
    a.close()
    b.close()  # only the children hold the pipe now: a dead child means EOF for the other
    progress_w.close()
    progressed = False
    if kill:
        try:
            progressed = progress_r.poll(timeout) and progress_r.recv() == tx_opts["progress_at"]
        except EOFError:    # the sender ended without reporting progress: its result says why
            pass
        if progressed:
            os.kill(procs[kill].pid, signal.SIGKILL)
    want = 1 if kill or rx_opts.get("die_after") is not None or tx_opts.get("die_after") is not None else 2
    out = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < want:
            r = q.get(timeout=max(0.1, deadline - time.monotonic()))
            out[r["role"]] = r
    except queue.Empty:
        pass
    for p in procs.values():
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    progress_r.close()
    assert len(out) >= want, f"peers reported {sorted(out)} within {timeout}s (exit codes " \
                             f"{ {k: p.exitcode for k, p in procs.items()} })"
    assert progressed or not kill, f"the sender never reported progress: {out}"
    return out


def _no_leaks(res: dict) -> None:
    c = res["counters"]
    assert c["agents_live"] == 0 and c["regions_registered"] == 0 and c["xfers_leaked"] == 0, c


# ----------------------------------------------------------------------------------------------------------------


def test_handshake_and_queue_pipe_units():
    hs = encode_handshake({"k": 3, "nixl": False, "reason": "x"}, b"\x00md")
    assert decode_handshake(hs) == ({"k": 3, "nixl": False, "reason": "x"}, b"\x00md")
    with pytest.raises(ValueError):
        decode_handshake(b"junk")
    p = QueuePipe(maxsize=1)
    p.feed(b"a")
    assert p.recv(0.1) == b"a"
    with pytest.raises(TimeoutError):
        p.recv(0.01)
    p.send(b"x")
    with pytest.raises(TimeoutError):
        p.send(b"y", timeout=0.01)  # bounded: a peer that stops reading blocks, then times out
    assert next(p.outgoing()) == b"x"
    p.pump(iter([b"1", b"2"]))
    assert p.recv(1) == b"1" and p.recv(1) == b"2"
    with pytest.raises(EOFError):
        p.recv(1)


@needs_nixl
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["copy", "zero_copy", "multipart"])
def test_round_trip_dtypes_shapes_byte_exact(ctx, mode):
    """Every wire dtype, 0-d / empty / non-contiguous / control-only messages and meta arrive byte-exact, in order;
    `multipart` uses 1 MiB slots so the 3 MiB tensor is split into parts and reassembled (and K=2 credits cycle)."""
    rx = {"zero_copy": mode == "zero_copy"}
    if mode == "multipart":
        rx.update(buffer_bytes=1 * MB, pool_buffers=2)
    res = run_pair(ctx, {"rx": rx}, {})
    r, s = res["receiver"], res["sender"]
    assert r["error"] is None and s["error"] is None, (r["error"], s["error"])
    assert r["transport"]["chosen"] == "nixl" and s["transport"]["chosen"] == "nixl"
    assert len(s["sent"]) == len(peers.dtype_cases()) and r["got"] == s["sent"]
    if mode == "multipart":
        assert s["stats"]["parts"] > len([c for c in peers.dtype_cases() if c[1] is not None])
        assert s["stats"]["max_in_flight"] <= 2
    _no_leaks(r)
    _no_leaks(s)


@needs_nixl
@pytest.mark.timeout(150)
def test_one_gigabyte_of_frames_vae_to_muxer(ctx):
    """20 clips of 17x768x1344x3 uint8 (1.05 GB) through NIXL with the default pool (K=3 x 64 MiB), the muxer
    side in zero-copy mode; every clip's CRC matches, at most K clips are in flight."""
    res = run_pair(ctx, {"rx": {"zero_copy": True}, "verify": "crc"}, {"payload": "frames", "clips": 20}, timeout=140)
    r, s = res["receiver"], res["sender"]
    assert r["error"] is None and s["error"] is None, (r["error"], s["error"])
    assert r["transport"]["chosen"] == "nixl"
    assert [g[0] for g in r["got"]] == list(range(20))
    assert all(ok for _, ok, _ in r["got"]), "a clip arrived corrupted"
    assert all(shape == peers.CLIP for _, _, shape in r["got"])
    nbytes = 20 * 17 * 768 * 1344 * 3
    assert r["stats"]["bytes"] == nbytes and s["stats"]["parts"] == 20
    assert 1 <= s["stats"]["max_in_flight"] <= 3
    print(f"\n1 GB of frames over NIXL: {nbytes / s['elapsed'] / 1e6:.0f} MB/s (sender wall, incl. CRC)")
    _no_leaks(r)
    _no_leaks(s)


@needs_nixl
@pytest.mark.timeout(90)
def test_back_pressure_slow_muxer_slows_the_sender(ctx):
    """K=2 slots, a receiver that takes 0.25 s per message: the sender never has more than 2 in flight and spends
    its time waiting for credits instead of queueing memory."""
    res = run_pair(ctx, {"rx": {"pool_buffers": 2, "buffer_bytes": 1 * MB}, "slow_s": 0.25, "verify": "count"},
                   {"payload": "blobs", "count": 8, "size": 1 * MB})
    r, s = res["receiver"], res["sender"]
    assert r["error"] is None and s["error"] is None
    assert r["got"] == [MB] * 8
    assert s["stats"]["max_in_flight"] == 2
    assert s["stats"]["credit_wait_s"] > 0.8, s["stats"]      # ~ (8 - 2) x 0.25 s, blocked in send
    assert s["elapsed"] > 1.2


@pytest.mark.timeout(90)
@pytest.mark.parametrize("where", ["receiver", "sender"])
def test_fallback_when_nixl_disabled(ctx, where):
    """NIXL switched off on one side: the stream uses the control pipe (the gRPC stream) for the bytes, the data is
    exact, and both sides report transport grpc with the reason, also in their logs."""
    env = {"env": {"H3SERVE_NIXL_DISABLE": "1"}}
    res = run_pair(ctx, {"rx": {"buffer_bytes": 1 * MB}, **(env if where == "receiver" else {})},
                   env if where == "sender" else {})
    r, s = res["receiver"], res["sender"]
    assert r["error"] is None and s["error"] is None, (r["error"], s["error"])
    assert r["got"] == s["sent"]
    for side in (r, s):
        assert side["transport"]["requested"] == "nixl" and side["transport"]["chosen"] == "grpc"
        assert "H3SERVE_NIXL_DISABLE" in side["transport"]["reason"]
    assert any("WARNING" in line and "H3SERVE_NIXL_DISABLE" in line for line in s["logs"]), s["logs"]
    assert s["stats"]["parts"] >= len(s["sent"]) - 1    # the bytes went inline
    _no_leaks(r)
    _no_leaks(s)


@needs_nixl
@pytest.mark.timeout(90)
def test_fallback_when_ucx_backend_cannot_start(ctx):
    """A receiver whose UCX cannot start (UCX_TLS limited to shared memory: no transport NIXL can wire up) offers
    no NIXL; the sender falls back, the request succeeds, the reason names the backend failure."""
    res = run_pair(ctx, {"env": {"UCX_TLS": "posix"}}, {})
    r, s = res["receiver"], res["sender"]
    assert r["error"] is None and s["error"] is None, (r["error"], s["error"])
    assert r["got"] == s["sent"]
    assert r["offered"]["chosen"] == "grpc" and "UCX backend cannot start" in r["offered"]["reason"]
    assert s["transport"]["chosen"] == "grpc" and "receiver: NIXL UCX backend cannot start" in \
        s["transport"]["reason"]


@needs_nixl
@pytest.mark.timeout(90)
def test_fallback_when_peers_cannot_connect(ctx):
    """The handshake names an agent whose NIXL endpoint is gone (the control pipe still works): the sender's probe
    WRITE fails, it falls back within the connect timeout, and the stream still delivers every tensor."""
    res = run_pair(ctx, {"stale_handshake": True, "rx": {"buffer_bytes": 1 * MB}},
                   {"tx": {"connect_timeout": 5.0}})
    r, s = res["receiver"], res["sender"]
    assert r["error"] is None and s["error"] is None, (r["error"], s["error"])
    assert r["got"] == s["sent"]
    assert s["transport"]["chosen"] == "grpc" and "cannot connect over NIXL" in s["transport"]["reason"]
    assert r["transport"]["chosen"] == "grpc" and "cannot connect over NIXL" in r["transport"]["reason"]
    assert any("cannot connect" in line for line in s["logs"] + r["logs"])
    _no_leaks(r)
    _no_leaks(s)


@pytest.mark.timeout(60)
def test_select_transport_reports_the_reason(ctx):
    q = ctx.Queue()
    p = ctx.Process(target=peers.select_main, args=(q, {}))
    p.start()
    out = q.get(timeout=50)
    p.join()
    assert out["grpc"] == ["grpc", "requested"] or out["grpc"] == ("grpc", "requested")
    assert "use one of grpc, nixl" in out["invalid"]
    if HAVE_NIXL:
        assert out["available"][0] is True and "UCX" in out["available"][1]
        assert tuple(out["nixl"])[0] == "nixl"
        chosen, reason = out["nixl_probe_fails"]
        assert chosen == "grpc" and "no route to the muxer's NIXL agent" in reason
        assert any(line.startswith("WARNING") and "no route" in line for line in out["logs"])
    else:
        assert tuple(out["nixl"])[0] == "grpc"
    q2 = ctx.Queue()
    p = ctx.Process(target=peers.select_main, args=(q2, {"env": {"H3SERVE_NIXL_DISABLE": "1"}}))
    p.start()
    out = q2.get(timeout=50)
    p.join()
    assert tuple(out["nixl"]) == ("grpc", "NIXL disabled by H3SERVE_NIXL_DISABLE=1")
    assert any("WARNING" in line and "H3SERVE_NIXL_DISABLE" in line for line in out["logs"])


@needs_nixl
@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", ["receiver", "sender"])
def test_peer_killed_mid_stream_is_a_clean_error(ctx, victim):
    """SIGKILL one peer while 52 MB clips stream: the survivor raises TransportError naming the edge well within
    its 20 s timeout, and has released its agent and registered memory."""
    tx = {"payload": "frames", "clips": 400, "send_timeout": 20, "progress_at": 6}
    rx = {"verify": "count", "recv_timeout": 20, "slow_s": 0.02}
    res = run_pair(ctx, rx, tx, kill=victim, timeout=60)
    survivor = res["sender" if victim == "receiver" else "receiver"]
    err = survivor["error"]
    assert err is not None, "the survivor finished without noticing"
    assert err["type"] == "TransportError" and err["edge"] == EDGE and err["message"].startswith(EDGE + ":")
    assert err["elapsed"] < 10, err
    assert survivor["transport"]["chosen"] == "nixl"
    _no_leaks(survivor)


@needs_nixl
@pytest.mark.timeout(60)
@pytest.mark.parametrize("stalled", ["receiver", "sender"])
def test_every_wait_times_out(ctx, stalled):
    """A peer that is alive but stops (no EOF, no NIXL error): the other side fails after its timeout."""
    if stalled == "receiver":
        rx = {"stall_after": 1, "stall_s": 20, "rx": {"pool_buffers": 2, "buffer_bytes": 1 * MB}, "verify": "count"}
        tx = {"payload": "blobs", "count": 8, "size": 1 * MB, "send_timeout": 1.5}
        want = "sender"
    else:
        rx = {"recv_timeout": 1.5, "verify": "count"}
        tx = {"payload": "blobs", "count": 4, "size": 1 * MB, "stall_after": 1, "stall_s": 20}
        want = "receiver"
    a, b = SocketPipe.pair()
    q = ctx.Queue()
    procs = [ctx.Process(target=peers.receiver_main, args=(a, q, rx)),
             ctx.Process(target=peers.sender_main, args=(b, q, tx))]
    for p in procs:
        p.start()
    a.close()
    b.close()
    try:
        r = q.get(timeout=40)
        assert r["role"] == want, r
        assert r["error"] and r["error"]["type"] == "TransportError" and r["error"]["edge"] == EDGE
        assert 1.4 < r["error"]["elapsed"] < 6, r["error"]
        _no_leaks(r)
    finally:
        for p in procs:
            p.kill()
            p.join()


@needs_nixl
@pytest.mark.timeout(150)
def test_memory_stable_over_100_failed_streams(ctx):
    """One long-lived process serves 100 streams whose peer SIGKILLs itself mid-stream (50 as receiver, 50 as
    sender, 4 MiB messages, 2 x 4 MiB pools): each fails with TransportError naming the edge; RSS, fds, threads
    and the live agent / registered region counts stay flat; the next, healthy stream works."""
    opts = {"rx": {"pool_buffers": 2, "buffer_bytes": 4 * MB}, "size": 4 * MB, "timeout": 20}
    parent, child = ctx.Pipe()
    survivor = ctx.Process(target=peers.survivor_main, args=(child, opts))
    survivor.start()
    child.close()
    try:
        port = parent.recv()
        rounds = []
        # Disposable peers skip UCX's memory-event hooks (0.4 s of start-up each); the survivor keeps the defaults.
        peer_opts = {**opts, "die_after": 2, "env": {"UCX_MEM_EVENTS": "no"}}

        def start_peer(i):
            role = "sender" if i % 2 == 0 else "receiver"      # the survivor plays the other role
            p = ctx.Process(target=peers.dying_peer_main, args=(port, role, peer_opts))
            p.start()
            return p

        nxt = start_peer(0)
        for i in range(100):
            parent.send({"round": i})
            peer, nxt = nxt, (start_peer(i + 1) if i + 1 < 100 else None)   # the next one warms up meanwhile
            assert parent.poll(30), f"round {i}: survivor stuck"
            rounds.append(parent.recv())
            peer.join(10)
        q = ctx.Queue()
        for role in ("receiver", "sender"):     # the survivor's role
            parent.send({"round": "healthy"})
            peer = ctx.Process(target=peers.healthy_peer_main,
                               args=(port, "sender" if role == "receiver" else "receiver", opts, q))
            peer.start()
            assert parent.poll(30)
            ok = parent.recv()
            assert ok["error"] is None and ok["ok"] == 12 and ok["transport"] == "nixl", ok
            healthy = q.get(timeout=30)
            assert healthy["n"] == 12 and healthy["transport"] == "nixl", healthy
            peer.join(10)
        parent.send(None)
    finally:
        survivor.join(10)
        if survivor.is_alive():
            survivor.kill()
            survivor.join()
    errors = [r["error"] for r in rounds]
    assert all(e is not None and e["type"] == "TransportError" and e["edge"] == EDGE for e in errors), \
        [e for e in errors if not e or e["edge"] != EDGE][:3]
    assert all(r["transport"] == "nixl" for r in rounds)
    assert sorted(r["role"] for r in rounds) == ["receiver"] * 50 + ["sender"] * 50
    assert max(e["elapsed"] for e in errors) < 10
    for r in rounds:
        assert r["counters"]["agents_live"] == 0 and r["counters"]["regions_registered"] == 0, r
        assert r["counters"]["xfers_leaked"] == 0
    warm, last = rounds[19], rounds[-1]
    growth = last["rss"] - warm["rss"]
    print(f"\nRSS after 20 failures {warm['rss'] / MB:.0f} MiB, after 100 {last['rss'] / MB:.0f} MiB "
          f"({growth / MB:+.1f} MiB); fds {warm['fds']} -> {last['fds']}; threads {warm['threads']} -> "
          f"{last['threads']}")
    # A leaked pool or staging area would be >= 8 MiB per failure (>= 640 MiB over 80 rounds).
    assert growth < 48 * MB, growth
    assert last["fds"] <= warm["fds"] + 2 and last["threads"] <= warm["threads"] + 1


@needs_nixl
@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["round_trip", "sender_killed"])
def test_control_pipe_on_a_grpc_bidi_stream(ctx, case):
    """The services' wiring: handshake, headers, credits and end on a real gRPC bidi stream (QueuePipe at both
    ends), bytes by NIXL. A sender killed mid-stream breaks the gRPC call, which the receiver reports as a
    TransportError naming the edge."""
    port_q, q = ctx.Queue(), ctx.Queue()
    rx = ctx.Process(target=peers.grpc_receiver_main, args=(port_q, q, {"rx": {"buffer_bytes": 1 * MB}}))
    rx.start()
    tx_opts = {} if case == "round_trip" else {"payload": "frames", "clips": 200, "die_after": 5}
    tx = ctx.Process(target=peers.grpc_sender_main, args=(port_q.get(timeout=30), q, tx_opts))
    tx.start()
    try:
        out = {}
        while len(out) < (2 if case == "round_trip" else 1):
            r = q.get(timeout=60)
            out[r["role"]] = r
    finally:
        for p in (tx, rx):
            p.join(15)
            if p.is_alive():
                p.kill()
                p.join()
    r = out["receiver"]
    if case == "round_trip":
        s = out["sender"]
        assert r["error"] is None and s["error"] is None, (r["error"], s["error"])
        assert r["transport"]["chosen"] == "nixl" and s["transport"]["chosen"] == "nixl"
        assert r["got"] == s["sent"] and len(r["got"]) == len(peers.dtype_cases())
        _no_leaks(s)
    else:
        assert r["error"] and r["error"]["type"] == "TransportError" and r["error"]["edge"] == EDGE, r
        assert "peer gone" in r["error"]["message"] and r["error"]["elapsed"] < 10
    _no_leaks(r)
