"""The session table of the stages that hand a request's bytes from one call to another: the VAE's latents inbox
(a Decode waits for the DiT's Control stream) and the muxer's sessions (OpenSession, then Push or Control, then
Fetch).

A session is opened with a TTL (or none: it lives until removed), claimed once by the stream that fills it, waited
for by the call that reads it (polling a check that may raise: cancel, deadline, the caller gone), swept when its TTL
passed, and failed with the rest when the stage closes. Opening is capped per replica and per caller.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, TypeVar

from h3serve.errors import NotFound, QueueFull, RequestError

WAIT_POLL_S = 0.1   # how often a wait looks at its check


@dataclass(kw_only=True)
class Session:
    """One session; a stage's own kind adds its fields. `state`: open | `claimed_state` | done | failed | aborted."""

    id: str
    ttl_s: float | None = None   # None: no expiry (removed by its owner)
    peer: str = ""               # who opened it (runtime.tls.peer_identity), for the per-caller cap
    created: float = field(default_factory=time.monotonic)
    state: str = "open"
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def fail(self, exc: BaseException, state: str = "failed") -> None:
        """End the session with `exc` (a finished one keeps its result); wakes its waiter."""
        if self.state != "done":
            self.state, self.error = state, exc
        self.done.set()

    def expired(self, now: float) -> bool:
        return self.ttl_s is not None and now - self.created > self.ttl_s


S = TypeVar("S", bound=Session)


class SessionTable(Generic[S]):
    """Sessions of one stage by id. `noun` names them in errors ("session", "latents session"); `unknown_hint` is
    added to an unknown id's NotFound. Caps: `cap` sessions at once (`cap_flag` names the knob), `peer_cap` of them
    opened by one caller. `claimed_state`: the state a claim moves an open session to; with `claim_hides`, a
    claimed session is unknown to a later claim (NotFound) rather than refused as not open."""

    def __init__(self, stage: str, *, noun: str = "session", unknown_hint: str = "",
                 cap: int | None = None, cap_flag: str = "", peer_cap: int | None = None, peer_cap_flag: str = "",
                 claimed_state: str = "claimed", claim_hides: bool = False):
        self.stage, self.noun, self.unknown_hint = stage, noun, unknown_hint
        self.cap, self.cap_flag, self.peer_cap, self.peer_cap_flag = cap, cap_flag, peer_cap, peer_cap_flag
        self.claimed_state, self.claim_hides = claimed_state, claim_hides
        self._sessions: dict[str, S] = {}
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[S]:
        return iter(list(self._sessions.values()))

    def add(self, session: S) -> S:
        """Open `session`; QueueFull when the replica or its caller holds as many as it may."""
        with self.lock:
            if self.cap is not None and len(self._sessions) >= self.cap:
                raise QueueFull(f"{self.stage}: {len(self._sessions)} {self.noun}s open, the most this replica "
                                f"holds ({self.cap_flag} {self.cap}); retry later", stage=self.stage)
            if self.peer_cap is not None:
                held = sum(1 for s in self._sessions.values() if s.peer == session.peer)
                if held >= self.peer_cap:
                    raise QueueFull(f"{self.stage}: this caller holds {held} {self.noun}s, the most one caller may "
                                    f"({self.peer_cap_flag} {self.peer_cap}); fetch or abort them, or retry later",
                                    stage=self.stage)
            self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> S:
        """The session `session_id`; NotFound when there is none."""
        with self.lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise self._unknown(session_id)
        return session

    def claim(self, session: S, field: str = "session_id") -> S:
        """`session`, now claimed by the caller's stream: one stream per session, refused unless it is open."""
        with self.lock:
            if session.state != "open":
                if self.claim_hides:
                    raise self._unknown(session.id)
                raise RequestError(field, session.id, f"a session that is open, not {session.state}")
            session.state = self.claimed_state
        return session

    def pop(self, session_id: str) -> S | None:
        with self.lock:
            return self._sessions.pop(session_id, None)

    def wait(self, session: S, keep_waiting: Callable[[], bool]) -> bool:
        """Wait until `session` is done; `keep_waiting()` is asked every WAIT_POLL_S (it may raise). Returns whether
        the session is done."""
        while not session.done.wait(WAIT_POLL_S):
            if not keep_waiting():
                return False
        return True

    def sweep(self, now: float | None = None, before_fail: Callable[[S], None] | None = None) -> list[S]:
        """Remove the sessions whose TTL passed and fail them (NotFound, "aborted"), each after `before_fail(s)`
        (it sees the state the session expired in); return them for the stage's own cleanup."""
        now = time.monotonic() if now is None else now
        with self.lock:
            expired = [s for s in self._sessions.values() if s.expired(now)]
            for s in expired:
                del self._sessions[s.id]
        for s in expired:
            if before_fail is not None:
                before_fail(s)
            s.fail(NotFound(f"{self.stage}: {self.noun} {s.id} expired"), "aborted")
        return expired

    def close(self, exc: BaseException) -> list[S]:
        """Remove every session and fail it with `exc` ("aborted"); return them for the stage's own cleanup."""
        with self.lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for s in sessions:
            s.fail(exc, "aborted")
        return sessions

    def _unknown(self, session_id: str) -> NotFound:
        return NotFound(f"{self.stage}: no {self.noun} {session_id!r}{self.unknown_hint}", stage=self.stage)
