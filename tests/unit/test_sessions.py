"""The session table the VAE's latents inbox and the muxer's sessions share (h3serve/services/sessions.py)."""

from __future__ import annotations

import threading

import pytest

from h3serve.errors import NotFound, QueueFull, RequestError, StageUnavailable
from h3serve.services.sessions import Session, SessionTable


def test_caps_per_replica_and_per_caller():
    table = SessionTable("muxer", cap=3, cap_flag="--max-sessions", peer_cap=2, peer_cap_flag="--per-peer")
    table.add(Session(id="a", peer="p"))
    table.add(Session(id="b", peer="p"))
    with pytest.raises(QueueFull, match=r"this caller holds 2 sessions.*--per-peer 2"):
        table.add(Session(id="c", peer="p"))
    table.add(Session(id="c", peer="q"))
    with pytest.raises(QueueFull, match=r"3 sessions open.*--max-sessions 3"):
        table.add(Session(id="d", peer="r"))
    assert len(table) == 3 and {s.id for s in table} == {"a", "b", "c"}


def test_claim_once():
    table = SessionTable("muxer", claimed_state="pushing")
    s = table.add(Session(id="a"))
    assert table.claim(table.get("a")) is s and s.state == "pushing"
    with pytest.raises(RequestError, match="a session that is open, not pushing") as err:
        table.claim(s)
    assert err.value.field == "session_id"
    with pytest.raises(NotFound, match="muxer: no session 'zz'"):
        table.get("zz")


def test_claim_hides_a_claimed_session():
    table = SessionTable("vae", noun="latents session", claim_hides=True)
    s = table.add(Session(id="a"))
    table.claim(s)
    with pytest.raises(NotFound, match="vae: no latents session 'a'"):
        table.claim(table.get("a"))


def test_wait_sweep_and_close():
    table = SessionTable("muxer")
    old = table.add(Session(id="old", ttl_s=1.0, created=0.0))
    keep = table.add(Session(id="keep"))   # no TTL
    seen = []
    assert table.sweep(now=10.0, before_fail=lambda s: seen.append(s.state)) == [old]
    assert seen == ["open"] and old.state == "aborted" and isinstance(old.error, NotFound)
    assert table.wait(old, lambda: pytest.fail("a done session is not waited for"))
    assert not table.wait(keep, lambda: False)
    threading.Timer(0.05, lambda: table.close(StageUnavailable("muxer", "shutting down"))).start()
    assert table.wait(keep, lambda: True)
    assert keep.state == "aborted" and len(table) == 0
