"""`--peers` (h3serve/runtime/tls.py): what a stage may dial when a request names an address. Literal IP:PORT items,
networks, and names (a headless Service) whose current addresses are resolved, cached a few seconds and resolved
again on a miss; a name that does not resolve, or not in time, refuses the address naming the field."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from h3serve.errors import RequestError
from h3serve.runtime import tls
from h3serve.runtime.tls import PeerName, Peers, check_peer, parse_peers


def refused(peers, address: str, field: str = "sink.address") -> RequestError:
    with pytest.raises(RequestError) as info:
        check_peer(peers, address, field)
    assert info.value.field == field and info.value.value == address and "--peers" in str(info.value)
    return info.value


def test_a_name_accepts_its_resolved_addresses_on_exactly_its_port():
    peers = parse_peers("localhost:50054")        # resolved by the real getaddrinfo (/etc/hosts)
    assert peers.items == (PeerName("localhost", 50054),)
    check_peer(peers, "127.0.0.1:50054", "sink.address")
    check_peer(peers, "localhost:50054", "sink.address")   # the declared name itself, as written
    refused(peers, "127.0.0.1:50055")                       # another port
    refused(peers, "127.0.0.2:50054")                       # another IP
    refused(peers, "127.0.0.1.nip.io:50054")                # another name is never resolved here
    refused(peers, "unix:/var/run/docker.sock")


def test_a_name_that_does_not_resolve_refuses_naming_the_field_and_the_name():
    peers = parse_peers("h3-vae-headless.nowhere.invalid:50051")
    t0 = time.monotonic()
    err = refused(peers, "10.0.0.7:50051", "latents_sink.address")
    assert time.monotonic() - t0 < tls.RESOLVE_TIMEOUT_S + 1
    assert "h3-vae-headless.nowhere.invalid did not resolve" in str(err), err
    assert "Traceback" not in str(err)
    refused(peers, "10.0.0.7:50052")   # another port: the name is not even looked up


def test_a_resolution_is_bounded_in_time_and_shared_by_concurrent_checks(monkeypatch):
    monkeypatch.setattr(tls, "RESOLVE_TIMEOUT_S", 0.3)
    release, calls = threading.Event(), []

    def hung(host: str) -> frozenset:   # a resolver that does not answer (until released)
        calls.append(host)
        release.wait(10)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    peers = Peers((PeerName("muxer.svc", 50051),), resolve=hung)
    errors: list = []

    def check():
        t0 = time.monotonic()
        try:
            peers.check("10.0.0.9:50051", "sink.address")
        except RequestError as exc:
            errors.append((time.monotonic() - t0, str(exc)))

    threads = [threading.Thread(target=check) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    release.set()
    assert len(errors) == 8 and all(dt < 2.0 for dt, _ in errors), errors
    assert all("muxer.svc did not resolve within 0.3 s" in msg for _, msg in errors), errors
    assert len(calls) == 1   # one lookup in flight, not one thread per request


def test_addresses_are_cached_and_a_miss_resolves_again_once_they_are_a_little_old(monkeypatch):
    monkeypatch.setattr(tls, "NAME_RETRY_S", 0.2)
    monkeypatch.setattr(tls, "NAME_TTL_S", 0.6)
    import ipaddress

    answers = [{"10.0.0.1"}, {"10.0.0.1", "10.0.0.2"}, {"10.0.0.2"}]
    calls = []

    def resolve(host: str) -> frozenset:   # the headless Service as replicas come and go
        calls.append(host)
        return frozenset(ipaddress.ip_address(a) for a in answers[min(len(calls), len(answers)) - 1])

    peers = Peers((PeerName("vae.svc", 50051),), resolve=resolve)
    peers.check("10.0.0.1:50051", "sink.address")
    peers.check("10.0.0.1:50051", "sink.address")
    assert len(calls) == 1                          # cached
    refused(peers, "10.0.0.2:50051")                # a miss, but the answer is fresh: no second lookup
    assert len(calls) == 1
    time.sleep(0.25)
    peers.check("10.0.0.2:50051", "sink.address")   # a miss on an older answer: resolved again, now there
    assert len(calls) == 2
    peers.check("10.0.0.1:50051", "sink.address")   # still within the TTL
    time.sleep(0.65)
    refused(peers, "10.0.0.1:50051")                # the TTL passed: resolved again, that replica is gone
    assert len(calls) == 3


def test_literal_items_networks_and_a_failing_name_beside_them():
    peers = parse_peers("127.0.0.1:50055, [::1]:50056, 10.8.0.0/16, no-such-host.invalid:50051")
    for ok in ("127.0.0.1:50055", "[::1]:50056", "[0:0::1]:50056", "10.8.3.4:50051", "10.8.0.1:1"):
        check_peer(peers, ok, "sink.address")   # a network accepts without looking the name up
    for bad in ("127.0.0.1:50056", "[::1]:50055", "[::ffff:10.8.3.4]:50051", "169.254.169.254:80", "x", ":1"):
        refused(peers, bad)
    assert "no-such-host.invalid did not resolve" in str(refused(peers, "10.9.0.1:50051"))
    assert check_peer(None, "anything:1", "sink.address") is None   # unset: any address (the stage warns)
    for text in ("not-an-address", "host:", ":50051", "10.0.0.0/33", "h:port"):
        with pytest.raises(RequestError) as info:
            parse_peers(text)
        assert info.value.field == "peers"


def test_the_launcher_declares_the_stages_it_started_and_those_it_was_given(tmp_path):
    from h3serve.config.stage import StageConfig
    from h3serve.testing.serve import launched_config

    addresses = {"dit": "127.0.0.1:50053", "vae": "127.0.0.1:50054", "muxer": "dns:///h3-muxer-headless.ns.svc:50051"}
    text = launched_config(StageConfig.from_knobs(stage="vae"), "vae", 50054, addresses, None, tmp_path).server.peers
    assert text == "127.0.0.1:50053,127.0.0.1:50054,h3-muxer-headless.ns.svc:50051"
    assert parse_peers(text).items[-1] == PeerName("h3-muxer-headless.ns.svc", 50051)
