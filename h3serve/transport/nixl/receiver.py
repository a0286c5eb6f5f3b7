"""The receiving end of a NIXL stream: the pool of K slots the sender WRITEs into, credits back per slot."""

from __future__ import annotations

import logging
import time

import torch

from h3serve.config.vocab import GRPC, NIXL
from h3serve.errors import TransportError
from h3serve.transport.base import Message, TensorReceiver
from h3serve.transport.nixl.agent import DEFAULT_TIMEOUT, Agent, Backoff, Endpoint, alloc, device_mem
from h3serve.transport.choice import validate_transport
from h3serve.transport.nixl.probe import count, nixl_available
from h3serve.transport.nixl.wire import encode_handshake, from_bytes, header_from, pack_message
from h3serve.transport.pipes import ControlPipe

log = logging.getLogger(__name__)

DEFAULT_SLOT_BYTES = 64 << 20       # one 1344x768x17 RGB clip (52.6 MB) per slot
DEFAULT_SLOTS = 3                   # K: parts in flight per stream


class NixlReceiver(Endpoint, TensorReceiver):
    """The receiving end of one stream (one request's frames on one edge).

    Registers `pool_buffers` (K) slots of `buffer_bytes` (B) on `device` ("cpu" -> DRAM, "cuda:N" -> VRAM) with a
    fresh NIXL agent. `handshake()` returns what the sender's `connect` needs (agent metadata + slot descriptors, or
    the reason NIXL is not usable here); send it to the sender over the service's gRPC call.

    `recv()` returns tensors on `device`:
      - zero_copy=False (default, safe): each tensor is a fresh copy; its slot is credited back at once.
      - zero_copy=True: a single-part tensor is a view of the slot, valid only until the next `recv()` or `close()`
        (the slot is credited back then); a message larger than B is reassembled into a fresh tensor either way.
    Attributes `transport` ("nixl" | "grpc"), `reason`, `transport_info`, `stats` say what was used and why.
    """

    role = "receiver"

    def __init__(self, edge: str, pipe: ControlPipe, *, pool_buffers: int = DEFAULT_SLOTS,
                 buffer_bytes: int = DEFAULT_SLOT_BYTES, device: str | torch.device = "cpu", zero_copy: bool = False,
                 timeout: float = DEFAULT_TIMEOUT, transport: str = NIXL, fallback: bool = True):
        super().__init__(edge, pipe, timeout)
        if pool_buffers < 1:
            raise ValueError(f"pool_buffers={pool_buffers} is invalid: need at least 1 slot")
        if buffer_bytes < 4096:
            raise ValueError(f"buffer_bytes={buffer_bytes} is invalid: need at least 4096")
        self.k = int(pool_buffers)
        self.slot_bytes = -(-int(buffer_bytes) // 4096) * 4096
        self.device = torch.device(device)
        self.mem, self.dev_id = device_mem(self.device)
        self.zero_copy = zero_copy
        self.requested = transport
        self._pool: torch.Tensor | None = None
        self._held: int | None = None
        self._notifs: set[bytes] = set()
        self._ended = False
        self._closed = False
        self._hello = False
        validate_transport(transport)
        if transport == GRPC:
            self.transport, self.reason = GRPC, "requested"
            return
        ok, why = nixl_available()
        if ok:
            try:
                self._setup_nixl()
                self.transport, self.reason = NIXL, why
            except Exception as e:
                self._teardown()
                ok, why = False, f"NIXL receiver setup failed: {type(e).__name__}: {e}"
        if not ok:
            if not fallback:
                raise TransportError(why, edge=edge)
            self.transport, self.reason = GRPC, why
            count("fallbacks_total")
            log.warning("%s receiver: transport nixl unavailable, using grpc: %s", edge, why)

    def _setup_nixl(self) -> None:
        self._agent = Agent(self.edge, "rx")
        self._pool = alloc(self.k * self.slot_bytes, self.device)
        self._agent.register(self._pool)

    def handshake(self) -> bytes:
        """Serialized agent metadata + pool descriptors (or the reason NIXL is not offered) for `connect`."""
        info = {"edge": self.edge, "k": self.k, "slot_bytes": self.slot_bytes, "nixl": self.transport == NIXL,
                "reason": self.reason}
        if self.transport != NIXL:
            return encode_handshake(info)
        base = self._pool.data_ptr()
        info.update(agent=self._agent.name, mem=self.mem, dev=self.dev_id,
                    slots=[[base + i * self.slot_bytes, self.slot_bytes] for i in range(self.k)])
        return encode_handshake(info, self._agent.agent.get_agent_metadata())

    # -- receiving --------------------------------------------------------------------------------------------

    def recv(self, *, timeout: float | None = None) -> Message | None:
        if self.failed:
            raise TransportError(f"stream already failed: {self.failed}", edge=self.edge)
        if self._closed:
            raise TransportError("receiver is closed", edge=self.edge)
        self._release_held()
        if self._ended:
            return None
        deadline, t = self._deadline(timeout)
        while True:
            obj, payload = self._next_ctrl(deadline, f"the next message (no message within {t:.1f}s)")
            kind = obj["t"]
            if kind == "hello":
                self._on_hello(obj)
            elif kind == "msg":
                self.stats["messages"] += 1
                return Message(None, None, dict(obj.get("meta") or {}))
            elif kind == "put":
                return self._recv_nixl(obj, deadline)
            elif kind == "data":
                return self._recv_inline(obj, payload, deadline)
            elif kind == "end":
                self._ended = True
                self._credit_quiet({"t": "closed", "messages": int(self.stats["messages"])})
                return None
            elif kind == "credit":
                raise self._error("protocol error: receiver got a credit")
            # unknown kinds are ignored (forward compatibility)

    def _on_hello(self, obj: dict) -> None:
        self._hello = True
        chosen = obj.get("transport", GRPC)
        if chosen == NIXL and self.transport != NIXL:
            raise self._error("protocol error: sender chose nixl but this receiver offered none")
        if chosen != NIXL and self.transport == NIXL:
            # The sender could not use our pool: free it now, the bytes come inline.
            self.transport, self.reason = GRPC, obj.get("reason") or "sender fell back"
            self._teardown()
            (log.info if self.reason == "requested" else log.warning)(
                "%s receiver: sender uses grpc: %s", self.edge, self.reason)
        elif chosen != NIXL and obj.get("reason"):
            self.reason = obj["reason"]

    def _recv_nixl(self, first: dict, deadline: float) -> Message:
        if self._agent is None:
            raise self._error("protocol error: NIXL put but no NIXL pool")
        header = header_from(first.get("hdr"), self.edge)
        meta = dict(first.get("meta") or {})
        total, nparts, seq = int(first["total"]), int(first["nparts"]), int(first["seq"])
        if total != header.nbytes:
            raise self._error(f"tensor {header.name!r}: {total} bytes announced, header says {header.nbytes}")
        out = None
        single = nparts == 1 and self.zero_copy
        if not single:
            out = torch.empty(total, dtype=torch.uint8, device=self.device)
        obj, off = first, 0
        for part in range(nparts):
            if part:
                obj, _ = self._next_ctrl(deadline, f"part {part} of {header.name!r}")
                if obj.get("t") != "put" or int(obj["seq"]) != seq or int(obj["part"]) != part:
                    raise self._error(f"protocol error: expected part {part} of message {seq}, got {obj}")
            slot, n = int(obj["slot"]), int(obj["n"])
            if not (0 <= slot < self.k) or not (0 <= n <= self.slot_bytes) or off + n > total:
                raise self._error(f"protocol error: bad put {obj}")
            self._wait_notif(f"{seq}:{part}".encode(), deadline, header.name)
            view = self._pool[slot * self.slot_bytes: slot * self.slot_bytes + n]
            if single:
                flat = view
                self._held = slot
            else:
                t0 = time.perf_counter()
                out[off:off + n].copy_(view)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()  # the slot is read before it is reused
                self.stats["copy_s"] += time.perf_counter() - t0
                self._credit(slot)
            off += n
        if off != total:
            raise self._error(f"tensor {header.name!r}: got {off} of {total} bytes")
        self.stats["messages"] += 1
        self.stats["bytes"] += total
        return Message(header, from_bytes(header, out if out is not None else flat), meta)

    def _progress(self) -> bool:
        try:
            new = self._agent.agent.get_new_notifs()
        except Exception as e:
            raise self._error(f"NIXL notifications failed: {type(e).__name__}: {e}", e) from None
        got = False
        for msgs in new.values():
            for m in msgs:
                if m != b"probe":
                    self._notifs.add(bytes(m))
                got = True
        return got

    def _wait_notif(self, tag: bytes, deadline: float, what: str) -> None:
        back = Backoff()
        t0 = time.perf_counter()
        while tag not in self._notifs:
            if self._progress():
                back.reset()
                continue
            if time.monotonic() > deadline:
                raise self._error(f"timed out waiting for the NIXL completion of {what!r}")
            # Sleep by waiting on the control pipe: a dead or aborting peer surfaces at once.
            if self._poll_ctrl(back.next()) is not None:
                back.reset()
        self._notifs.discard(tag)
        self.stats["notif_wait_s"] += time.perf_counter() - t0

    def _recv_inline(self, first: dict, payload: memoryview, deadline: float) -> Message:
        if not self._hello:
            raise self._error("protocol error: data before hello")
        header = header_from(first.get("hdr"), self.edge)
        meta = dict(first.get("meta") or {})
        total, seq, slot = int(first["total"]), int(first["seq"]), int(first.get("slot", -1))
        if total != header.nbytes:
            raise self._error(f"tensor {header.name!r}: {total} bytes announced, header says {header.nbytes}")
        buf = bytearray(total)
        obj, off = first, 0
        while True:
            n = len(payload)
            if int(obj.get("off", -1)) != off or off + n > total:
                raise self._error(f"protocol error: bad inline chunk {obj}")
            buf[off:off + n] = payload
            off += n
            if obj.get("last"):
                break
            obj, payload = self._next_ctrl(deadline, f"the rest of {header.name!r}")
            if obj.get("t") != "data" or int(obj["seq"]) != seq:
                raise self._error(f"protocol error: expected data of message {seq}, got {obj}")
        if off != total:
            raise self._error(f"tensor {header.name!r}: got {off} of {total} bytes")
        flat = torch.frombuffer(buf, dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
        if self.device.type != "cpu":
            flat = flat.to(self.device)
        self._credit(slot)
        self.stats["messages"] += 1
        self.stats["bytes"] += total
        return Message(header, from_bytes(header, flat), meta)

    def _credit(self, slot: int) -> None:
        if slot >= 0:
            self._credit_quiet({"t": "credit", "slot": slot})

    def _credit_quiet(self, obj: dict) -> None:
        # A credit the sender can no longer read is not an error here; a dead sender surfaces on the next wait.
        try:
            self.pipe.send(pack_message(obj), timeout=self.timeout)
        except Exception as e:
            log.debug("%s receiver: could not send %s: %s", self.edge, obj.get("t"), e)

    def _release_held(self) -> None:
        if self._held is not None:
            slot, self._held = self._held, None
            self._credit(slot)

    def close(self) -> None:
        """Release the pool and the agent; tell a sender that is still sending that this end is gone."""
        if self._closed:
            return
        self._closed = True
        if not self._ended and not self.failed:
            self._credit_quiet({"t": "err", "reason": "receiver closed before end of stream"})
        self._held = None
        self._teardown()

    def _drop_buffers(self) -> None:
        self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

