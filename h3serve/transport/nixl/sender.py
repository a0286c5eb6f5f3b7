"""The sending end of a NIXL stream: staging buffers, credits, WRITEs; the inline fallback on the control pipe."""

from __future__ import annotations

import collections
import logging
import math
import time

import torch

from h3serve.config.vocab import GRPC, NIXL
from h3serve.errors import TransportError
from h3serve.transport.base import TensorHeader, TensorSender
from h3serve.transport.nixl.agent import DEFAULT_TIMEOUT, Agent, Backoff, Endpoint, alloc, device_mem
from h3serve.transport.choice import validate_transport
from h3serve.transport.nixl.probe import count, nixl_available
from h3serve.transport.nixl.wire import byte_view, decode_handshake, header_json, pack_message
from h3serve.transport.pipes import ControlPipe

log = logging.getLogger(__name__)

DEFAULT_STAGING = 2                 # staging buffers (double buffering)
DEFAULT_CONNECT_TIMEOUT = 10.0      # seconds, connect probe
INLINE_CHUNK_BYTES = 1 << 20        # fallback: payload bytes per control message (below gRPC's 4 MiB limit)


class NixlSender(Endpoint, TensorSender):
    """The sending end of one stream. `connect(handshake)` must come first; then `send` in order; then `close`.

    `send` returns once the tensor's bytes have been copied into a registered staging buffer and its WRITE is
    posted (the caller may reuse the tensor at once); it blocks while all K receiver slots are taken (back-pressure)
    or both staging buffers are still being written, each wait bounded by `timeout`.
    CUDA tensors are copied device-to-host into pinned staging (or device-to-device when `staging_device` is CUDA).
    If NIXL cannot be used (here, on the receiver, or the probe WRITE fails) and `fallback` is true, the bytes
    travel inline in the control pipe instead (`transport == "grpc"`, `reason` says why).
    """

    role = "sender"

    def __init__(self, edge: str, pipe: ControlPipe, *, staging_buffers: int = DEFAULT_STAGING,
                 staging_device: str | torch.device = "cpu", timeout: float = DEFAULT_TIMEOUT,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT, transport: str = NIXL, fallback: bool = True,
                 inline_chunk_bytes: int = INLINE_CHUNK_BYTES):
        super().__init__(edge, pipe, timeout)
        validate_transport(transport)
        self.requested = transport
        self.n_staging = max(1, int(staging_buffers))
        self.staging_device = torch.device(staging_device)
        self.connect_timeout = float(connect_timeout)
        self.fallback = fallback
        self.inline_chunk_bytes = max(4096, int(inline_chunk_bytes))
        self.k = 0
        self.slot_bytes = 0
        self._free: collections.deque[int] = collections.deque()
        self._staging: torch.Tensor | None = None
        self._pending: list = []
        self._next_staging = 0
        self._remote = ""
        self._slots: list[list[int]] = []
        self._rmem, self._rdev = "DRAM", 0
        self._lmem, self._ldev = "DRAM", 0
        self._seq = 0
        self._connected = False
        self._closed = False

    # -- connecting -------------------------------------------------------------------------------------------

    def connect(self, handshake: bytes) -> str:
        """Join the receiver described by `handshake`; returns the transport chosen ("nixl" or "grpc")."""
        if self._connected:
            raise TransportError("already connected", edge=self.edge)
        try:
            info, metadata = decode_handshake(handshake)
            self.k, self.slot_bytes = int(info["k"]), int(info["slot_bytes"])
        except Exception as e:
            raise TransportError(f"bad handshake from receiver: {e}", edge=self.edge) from None
        self._free = collections.deque(range(self.k))
        reason = ""
        if self.requested == GRPC:
            reason = "requested"
        elif not info.get("nixl"):
            reason = f"receiver: {info.get('reason') or 'NIXL not offered'}"
        else:
            ok, why = nixl_available()
            if not ok:
                reason = why
            else:
                try:
                    self._connect_nixl(info, metadata)
                    self.transport, self.reason = NIXL, why
                except Exception as e:
                    self._teardown()
                    reason = f"peer cannot connect over NIXL: {type(e).__name__}: {e}"
        if reason:
            if self.requested == NIXL:
                if not self.fallback:
                    raise self._error(reason)
                count("fallbacks_total")
                log.warning("%s sender: transport nixl -> grpc: %s", self.edge, reason)
            self.transport, self.reason = GRPC, reason
        else:
            log.info("%s sender: transport nixl, %d slots x %d MiB: %s", self.edge, self.k, self.slot_bytes >> 20,
                     self.reason)
        self._connected = True
        self._send_ctrl({"t": "hello", "transport": self.transport, "reason": self.reason})
        return self.transport

    def _connect_nixl(self, info: dict, metadata: bytes) -> None:
        self._slots = [[int(a), int(n)] for a, n in info["slots"]]
        if len(self._slots) != self.k or any(n < self.slot_bytes for _, n in self._slots):
            raise ValueError("slot descriptors do not match the pool size")
        self._rmem, self._rdev = str(info.get("mem", "DRAM")), int(info.get("dev", 0))
        self._agent = Agent(self.edge, "tx")
        self._staging = alloc(self.n_staging * self.slot_bytes, self.staging_device)
        self._lmem, self._ldev = device_mem(self.staging_device)
        self._agent.register(self._staging)
        self._pending = [None] * self.n_staging
        self._remote = self._agent.add_remote(metadata)
        if self._remote != info.get("agent"):
            raise ValueError(f"metadata names agent {self._remote!r}, handshake says {info.get('agent')!r}")
        # Probe: one small WRITE into slot 0 (free: nothing was sent yet) proves the data path end to end.
        handle = self._post(0, 0, 64, b"probe")
        deadline = time.monotonic() + self.connect_timeout
        back = Backoff()
        while True:
            state = self._agent.agent.check_xfer_state(handle)
            if state == "DONE":
                break
            if state == "ERR":
                raise RuntimeError("probe WRITE failed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"probe WRITE not done within {self.connect_timeout:.1f}s")
            time.sleep(back.next())
        self._agent.release(handle)

    def _post(self, staging: int, slot: int, n: int, notif: bytes):
        ag = self._agent.agent
        local = ag.get_xfer_descs([(self._staging.data_ptr() + staging * self.slot_bytes, n, self._ldev)],
                                  self._lmem)
        remote = ag.get_xfer_descs([(self._slots[slot][0], n, self._rdev)], self._rmem)
        handle = ag.initialize_xfer("WRITE", local, remote, self._remote, notif)
        self._agent.track(handle)
        state = ag.transfer(handle)
        if state == "ERR":
            raise RuntimeError("NIXL WRITE failed to post")
        return handle

    # -- sending ----------------------------------------------------------------------------------------------

    def send(self, name: str, tensor: torch.Tensor | None, meta: dict | None = None, *,
             timeout: float | None = None) -> None:
        self._check_usable()
        deadline, _ = self._deadline(timeout)
        seq, self._seq = self._seq, self._seq + 1
        meta = dict(meta or {})
        if tensor is None:
            self._send_ctrl({"t": "msg", "seq": seq, "meta": meta}, deadline=deadline)
            self.stats["messages"] += 1
            return
        header = TensorHeader.of(name, tensor)
        src = byte_view(tensor)
        total = src.numel()
        if self.transport == NIXL and total > 0:
            self._send_nixl(seq, header, meta, src, total, deadline)
        else:
            self._send_inline(seq, header, meta, src, total, deadline)
        self.stats["messages"] += 1
        self.stats["bytes"] += total

    def _send_nixl(self, seq, header, meta, src, total, deadline) -> None:
        nparts = math.ceil(total / self.slot_bytes)
        for part in range(nparts):
            lo, hi = part * self.slot_bytes, min(total, (part + 1) * self.slot_bytes)
            slot = self._take_credit(deadline)
            j = self._take_staging(deadline)
            t0 = time.perf_counter()
            dst = self._staging[j * self.slot_bytes: j * self.slot_bytes + (hi - lo)]
            piece = src[lo:hi]
            if piece.device.type == "cuda" or dst.device.type == "cuda":
                dst.copy_(piece, non_blocking=True)
                torch.cuda.current_stream(piece.device if piece.device.type == "cuda" else dst.device).synchronize()
            else:
                dst.copy_(piece)
            self.stats["copy_s"] += time.perf_counter() - t0
            try:
                self._pending[j] = self._post(j, slot, hi - lo, f"{seq}:{part}".encode())
            except Exception as e:
                raise self._error(f"NIXL WRITE failed ({type(e).__name__}: {e}): peer gone?", e) from None
            obj = {"t": "put", "seq": seq, "part": part, "nparts": nparts, "slot": slot, "n": hi - lo,
                   "total": total}
            if part == 0:
                obj.update(hdr=header_json(header), meta=meta)
            self._send_ctrl(obj, deadline=deadline)
            self.stats["parts"] += 1

    def _send_inline(self, seq, header, meta, src, total, deadline) -> None:
        slot = self._take_credit(deadline)
        data = src if src.device.type == "cpu" else src.cpu()
        view = memoryview(data.numpy()) if total else memoryview(b"")
        off = 0
        while True:
            n = min(self.inline_chunk_bytes, total - off)
            obj = {"t": "data", "seq": seq, "slot": slot, "off": off, "total": total, "last": off + n >= total}
            if off == 0:
                obj.update(hdr=header_json(header), meta=meta)
            self._send_ctrl(obj, view[off:off + n], deadline=deadline)
            off += n
            self.stats["parts"] += 1
            if off >= total:
                return

    def _take_credit(self, deadline: float) -> int:
        t0 = time.perf_counter()
        back = Backoff(cap=2e-3)
        while not self._free:
            self._drain_backlog()
            if self._free:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._error(f"receiver did not free a slot within the timeout ({self.k} in flight)")
            busy = self._progress()
            # While our WRITEs are in flight keep polling them (UCX TCP needs it); otherwise block on the pipe.
            self._poll_ctrl(min(left, back.next()) if busy else left)
        self.stats["credit_wait_s"] += time.perf_counter() - t0
        slot = self._free.popleft()
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], self.k - len(self._free))
        return slot

    def _drain_backlog(self) -> None:
        keep = collections.deque()
        while self._backlog:
            obj, payload = self._backlog.popleft()
            if obj["t"] == "credit":
                slot = int(obj["slot"])
                if not (0 <= slot < self.k) or slot in self._free:
                    raise self._error(f"protocol error: bad credit {obj}")
                self._free.append(slot)
            else:
                keep.append((obj, payload))
        self._backlog = keep

    def _progress(self) -> bool:
        """Advance and reap finished WRITEs; True while some are still in flight."""
        busy = False
        for j, h in enumerate(self._pending):
            if h is None:
                continue
            try:
                state = self._agent.agent.check_xfer_state(h)
            except Exception as e:
                raise self._error(f"NIXL WRITE failed ({type(e).__name__}: {e}): peer gone?", e) from None
            if state == "DONE":
                self._agent.release(h)
                self._pending[j] = None
            elif state == "ERR":
                raise self._error("NIXL WRITE failed: peer gone?")
            else:
                busy = True
        return busy

    def _take_staging(self, deadline: float) -> int:
        j = self._next_staging
        self._next_staging = (j + 1) % self.n_staging
        t0 = time.perf_counter()
        back = Backoff()
        while self._pending[j] is not None:
            self._progress()
            if self._pending[j] is None:
                break
            if time.monotonic() > deadline:
                raise self._error("NIXL WRITE did not complete within the timeout")
            if self._poll_ctrl(back.next()) is not None:
                self._drain_backlog()
        self.stats["staging_wait_s"] += time.perf_counter() - t0
        return j

    def _check_usable(self) -> None:
        if self.failed:
            raise TransportError(f"stream already failed: {self.failed}", edge=self.edge)
        if self._closed:
            raise TransportError("sender is closed", edge=self.edge)
        if not self._connected:
            raise TransportError("send before connect", edge=self.edge)

    # -- ending -----------------------------------------------------------------------------------------------

    def close(self, *, timeout: float | None = None) -> None:
        """End of stream: wait for our WRITEs, send `end`, wait for the receiver's ack, release everything."""
        if self._closed or self.failed:
            self._closed = True
            self._teardown()
            return
        self._check_usable()
        deadline, t = self._deadline(timeout)
        back = Backoff()
        if self._agent is not None:
            while self._progress():
                if time.monotonic() > deadline:
                    raise self._error("NIXL WRITEs did not complete within the timeout")
                if self._poll_ctrl(back.next()) is not None:
                    self._drain_backlog()
        self._send_ctrl({"t": "end", "messages": int(self.stats["messages"])}, deadline=deadline)
        while True:
            self._drain_backlog()
            if self._backlog:
                obj, _ = self._backlog.popleft()
                if obj["t"] == "closed":
                    break
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._error(f"receiver did not acknowledge the end of stream within {t:.1f}s")
            self._poll_ctrl(left)
        self._closed = True
        self._teardown()

    def abort(self, reason: str = "sender aborted") -> None:
        """Give up: tell the receiver (best effort) and release everything."""
        if not self._closed and not self.failed:
            try:
                self.pipe.send(pack_message({"t": "err", "reason": reason}), timeout=1.0)
            except Exception:
                pass
        self._closed = True
        self._teardown()

    def _drop_buffers(self) -> None:
        self._staging = None
        self._pending = [None] * self.n_staging

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self.abort(f"sender failed: {exc_type.__name__}")
