"""One NIXL agent with its registered memory, and the endpoint logic both ends of a stream share (control
messages, failure, teardown).

NIXL's own progress thread busy-polls a core (`pthrDelay` 0 in the Python wrapper), so agents are created without
it; the endpoints drive progress themselves whenever they wait (`check_xfer_state`, `get_new_notifs`).
"""

from __future__ import annotations

import collections
import logging
import os
import time
import uuid
from typing import Any

import torch

from h3serve.config.vocab import GRPC, NIXL
from h3serve.errors import MalformedStream, TransportError
from h3serve.transport.nixl.probe import count, import_nixl
from h3serve.transport.nixl.wire import pack_message, unpack_message
from h3serve.transport.pipes import ControlPipe

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0              # seconds, any single wait


def _agent_name(edge: str, role: str) -> str:
    safe = "".join(c if c.isalnum() else "-" for c in edge) or "edge"
    return f"h3-{safe}-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def device_mem(device: torch.device) -> tuple[str, int]:
    if device.type == "cpu":
        return "DRAM", 0
    if device.type == "cuda":
        return "VRAM", device.index if device.index is not None else torch.cuda.current_device()
    raise ValueError(f"device={device} is invalid: NIXL buffers live in cpu (DRAM) or cuda (VRAM) memory")


def alloc(nbytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed (pages touched) buffer; pinned host memory when CUDA is present, so D2H copies into it are DMA."""
    if device.type == "cpu" and torch.cuda.is_available():
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


class Agent:
    """One NIXL agent (UCX backend, no progress thread) with its registered buffers; `close` never raises."""

    def __init__(self, edge: str, role: str):
        api = import_nixl()
        self.name = _agent_name(edge, role)
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL UCX backend not available")
        count("agents_live")
        self._regs: list[tuple[Any, torch.Tensor]] = []
        self._remotes: list[str] = []
        self._xfers: list[Any] = []
        self.closed = False

    def register(self, buf: torch.Tensor) -> None:
        reg = self.agent.register_memory(buf)
        if reg is None:
            raise RuntimeError("register_memory returned no descriptors")
        self._regs.append((reg, buf))
        count("regions_registered")
        count("bytes_registered", buf.numel() * buf.element_size())

    def add_remote(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes.append(name)
        return name

    def track(self, handle) -> None:
        self._xfers.append(handle)

    def release(self, handle) -> bool:
        try:
            handle.release()
        except Exception as e:
            log.debug("xfer release failed: %s", e)
            return False
        try:
            self._xfers.remove(handle)
        except ValueError:
            pass
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # Transfers first (an active one is cancelled), then memory, then peers, then the agent itself.
        deadline = time.monotonic() + 2.0
        pending = list(self._xfers)
        while pending:
            pending = [h for h in pending if not self.release(h)]
            if not pending or time.monotonic() > deadline:
                break
            for h in pending:
                try:
                    self.agent.check_xfer_state(h)
                except Exception:
                    pass
            time.sleep(0.01)
        if pending:
            # NIXL would not cancel them: keep the memory they may touch alive rather than free it under UCX.
            count("xfers_leaked", len(pending))
            log.error("%s: %d NIXL transfers could not be released; their buffers are kept", self.name, len(pending))
            _quarantine.append((self.agent, list(self._regs), pending))
            self._regs.clear()
        for reg, buf in self._regs:
            try:
                self.agent.deregister_memory(reg)
            except Exception as e:
                log.warning("%s: deregister failed: %s", self.name, e)
            count("regions_registered", -1)
            count("bytes_registered", -(buf.numel() * buf.element_size()))
        self._regs.clear()
        for name in self._remotes:
            try:
                self.agent.remove_remote_agent(name)
            except Exception:
                pass
        self._remotes.clear()
        self._xfers.clear()
        self.agent = None
        count("agents_live", -1)


# (agent, registrations, transfers) NIXL would not release: kept alive for the life of the process
_quarantine: list = []


class Backoff:
    """Short sleeps that grow while nothing happens (polling without burning a shared core)."""

    def __init__(self, first: float = 20e-6, cap: float = 1e-3):
        self.first, self.cap, self.t = first, cap, first

    def reset(self):
        self.t = self.first

    def next(self) -> float:
        t = self.t
        self.t = min(self.cap, self.t * 2)
        return t


class Endpoint:
    """What both ends of a stream share: the control pipe, the agent (while NIXL is in use), failure and teardown."""

    role = "?"

    def __init__(self, edge: str, pipe: ControlPipe, timeout: float):
        self.edge = edge
        self.pipe = pipe
        self.timeout = float(timeout)
        self.transport = GRPC
        self.reason = ""
        self.requested = NIXL
        self.failed: str | None = None
        self._agent: Agent | None = None
        self._backlog: collections.deque = collections.deque()
        self.stats: dict[str, float] = collections.defaultdict(float)

    @property
    def transport_info(self) -> dict:
        """{requested, chosen, reason}: for the logs, the health details and the metrics."""
        return {"requested": self.requested, "chosen": self.transport, "reason": self.reason}

    def _error(self, message: str, cause: BaseException | None = None, *,
               field: str | None = None) -> TransportError:
        # field: the peer's message broke the control protocol (its mistake, not a broken link)
        err = MalformedStream(field, None, message, edge=self.edge) if field else \
            TransportError(message, edge=self.edge)
        if self.failed is None:
            self.failed = message
            count("streams_failed_total")
            log.warning("%s %s failed: %s", self.edge, self.role, message)
        self._teardown()
        if cause is not None:
            err.__cause__ = cause
        return err

    def _deadline(self, timeout: float | None) -> tuple[float, float]:
        t = self.timeout if timeout is None else float(timeout)
        return time.monotonic() + t, t

    def _send_ctrl(self, obj: dict, payload: bytes | memoryview = b"", *, deadline: float | None = None) -> None:
        left = self.timeout if deadline is None else max(0.001, deadline - time.monotonic())
        try:
            self.pipe.send(pack_message(obj, payload), timeout=left)
        except TimeoutError as e:
            raise self._error(f"control pipe blocked for {left:.1f}s (peer not reading)", e) from None
        except Exception as e:  # EOFError, BrokenPipeError, ConnectionResetError, grpc errors
            raise self._error(f"control pipe to peer broken ({type(e).__name__}: {e}): peer gone", e) from None

    def _poll_ctrl(self, wait: float) -> dict | None:
        """One control message into the backlog if one arrives within `wait` seconds; raises on EOF."""
        try:
            data = self.pipe.recv(wait)
        except TimeoutError:
            return None
        except Exception as e:
            raise self._error(f"control pipe closed ({type(e).__name__}: {e}): peer gone", e) from None
        try:
            obj, payload = unpack_message(data)
        except ValueError as e:
            raise self._error(str(e), field="data") from None
        if obj["t"] == "err":
            raise self._error(f"peer aborted: {obj.get('reason', '?')}")
        self._backlog.append((obj, payload))
        return obj

    def _next_ctrl(self, deadline: float, what: str) -> tuple[dict, memoryview]:
        # The pipe wait returns as soon as a message arrives; the cap only bounds how often NIXL is polled meanwhile.
        back = Backoff(cap=5e-3)
        while not self._backlog:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._error(f"timed out waiting for {what}")
            if self._agent is not None and self._progress():
                back.reset()
                continue
            # With an agent, keep progressing it (UCX connection wire-up and TCP need both sides to poll).
            self._poll_ctrl(min(left, back.next()) if self._agent is not None else left)
        return self._backlog.popleft()

    def _progress(self) -> bool:
        """Drive NIXL once; True if something moved (a notification arrived, a transfer is still running)."""
        return False

    def _teardown(self) -> None:
        if self._agent is not None:
            agent, self._agent = self._agent, None
            agent.close()
        self._drop_buffers()

    def _drop_buffers(self) -> None:
        pass

