"""NIXL transport: tensor bytes move by one-sided NIXL (UCX) WRITEs into a bounded pool the receiver registered;
a small control pipe (the stage's gRPC stream in the services) carries handshake, headers, credits and end.

    receiver (e.g. muxer)                                   sender (e.g. VAE)
    NixlReceiver(edge, pipe)  -- registers K slots of B bytes
      .handshake() -> bytes   ───────── over gRPC ────────►  NixlSender(edge, pipe).connect(handshake)
                                                               add_remote_agent + probe WRITE; on failure falls
                                                               back to bytes inside the pipe ("grpc")
                              ◄── control: hello ──────────
                                                             send(): per part of <= B bytes
                                                               take a credit (a free slot), copy into a registered
                                                               staging buffer (pinned host / VRAM), WRITE it into
                              ◄══ NIXL WRITE + notif "seq:part"  the slot with a NIXL notification,
                              ◄── control: put(seq, part, slot, header, meta)
    recv(): waits for the notification of each part, copies out (or returns a view), credits the slot back
                              ─── control: credit(slot) ──►
                              ◄── control: end ────────────  close()
                              ─── control: closed ────────►  (the sender keeps its agent until this ack)

Back-pressure: the sender holds at most K credits, so at most K parts are in flight or waiting in the receiver's
pool; a slow consumer blocks `send` (the VAE) instead of growing memory. Defaults: K = 3 slots of 64 MiB, so a
clip of frames (1344x768x17x3 uint8 = 52.6 MB) is one part; larger messages are split into slot-sized parts and
reassembled. Sender staging: 2 buffers of B bytes (double buffering), pinned when CUDA is available.

Control pipe: anything with `send(data: bytes, timeout=None)` and `recv(timeout) -> bytes` (`ControlPipe` in
h3serve.transport.pipes, with `SocketPipe` for the tests and `QueuePipe` for a gRPC bidi stream). The pipe carries
no tensor bytes unless NIXL is not usable, in which case the same stream carries them inline in chunks of at most
`inline_chunk_bytes` (the gRPC fallback).

Failures: every wait has a timeout (`timeout=` per object, overridable per call); a peer that dies surfaces as
`TransportError(edge=...)` (control pipe EOF, NIXL disconnect, or the timeout), after which this side has already
released its transfers, deregistered its memory and dropped its agent. `probe.counters()` reports live agents
and registered regions so that leaks are visible.

NIXL's own progress thread busy-polls a core (`pthrDelay` 0 in the Python wrapper), so agents are created without
it; the endpoints drive progress themselves whenever they wait (`check_xfer_state`, `get_new_notifs`). Same-host
(CMA) and RDMA transfers need no target-side progress; UCX's TCP transport moves bytes only while a side polls.

Modules: `probe` (availability, counters; the choice itself is `transport/choice.py`), `wire` (handshake, control
messages, headers), `agent` (the NIXL agent and the endpoint logic both ends share), `receiver` (`NixlReceiver`, its slot pool),
`sender` (`NixlSender`). The `nixl` package itself is optional and imported only when an agent is made.
"""
