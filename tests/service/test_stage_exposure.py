"""Stage ports take no API keys, so a stage that listens beyond loopback needs mTLS (DESIGN §7, issue 21 item 2):
without it every stage refuses to start with one line saying how; with it every RPC of every stage port refuses a
caller without a certificate of the deployment's CA at the handshake; a stage's Status gives request ids only to an
authenticated peer or a caller on this host; one caller cannot hold all of a muxer's sessions."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import grpc
import pytest

from h3serve._proto import common_pb2, dit_pb2, encoder_pb2, muxer_pb2, vae_pb2
from h3serve.config.stage import StageConfig
from h3serve.errors import H3Error
from h3serve.runtime.stage import HIDDEN, StageBase
from h3serve.runtime.prechecks import check_stage_exposure
from h3serve.runtime.tls import authenticated_peer, peer_host
from h3serve.services.muxer import MuxerServicer

from .certs import make_ca, make_leaf
from .conftest import REPO, STAGES, Stack

SERVICES = {"encoder": encoder_pb2.DESCRIPTOR.services_by_name["Encoder"],
            "dit": dit_pb2.DESCRIPTOR.services_by_name["DiT"],
            "vae": vae_pb2.DESCRIPTOR.services_by_name["VAE"],
            "muxer": muxer_pb2.DESCRIPTOR.services_by_name["Muxer"]}


def test_a_stage_beyond_loopback_needs_mtls_or_the_explicit_opt_out(tmp_path):
    for stage in STAGES:
        for host in ("127.0.0.1", "::1", "localhost"):
            check_stage_exposure(StageConfig.from_knobs(stage=stage, host=host))
        check_stage_exposure(StageConfig.from_knobs(stage=stage, host="0.0.0.0", tls_cert="c", tls_key="k", tls_ca="ca"))
        check_stage_exposure(StageConfig.from_knobs(stage=stage, host="0.0.0.0", no_peer_auth=True))
        for wide in (StageConfig.from_knobs(stage=stage, host="0.0.0.0"), StageConfig.from_knobs(stage=stage, host="10.1.2.3"),
                     StageConfig.from_knobs(stage=stage, host="::", tls_cert="c", tls_key="k")):   # TLS, but no client CA
            with pytest.raises(H3Error, match=rf"the {stage} would listen on {wide.server.host} without mTLS.*"
                                              r"--tls-cert FILE --tls-key FILE --tls-ca FILE.*--host 127.0.0.1"):
                check_stage_exposure(wide)
    check_stage_exposure(StageConfig.from_knobs(stage="gateway", host="0.0.0.0"))   # the gateway's callers use API keys


@pytest.mark.parametrize("stages", ["encoder", "dit", "vae", "muxer", "all"])
def test_the_real_process_refuses_to_start_with_one_line(tiny_checkpoint, tmp_path, stages):
    keys = tmp_path / "keys"
    keys.write_text(f"alice sha256:{hashlib.sha256(b'k').hexdigest()}\n")
    argv = [sys.executable, "-m", "h3serve.cli", "serve", "--stages", stages, "--host", "0.0.0.0", "--port", "0",
            "--checkpoint", str(tiny_checkpoint), "--api-keys-file", str(keys)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    first = "encoder" if stages == "all" else stages
    assert out.returncode != 0, out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"the {first} would listen on 0.0.0.0 without mTLS" in lines[0], out.stderr
    assert "--tls-ca FILE" in lines[0] and "--host 127.0.0.1" in lines[0] and '"event"' not in out.stdout


@pytest.fixture(scope="module")
def exposed(tiny_checkpoint, tmp_path_factory):
    """The issue's case: keys on the gateway, every stage on 0.0.0.0 — now with the deployment's certificates."""
    d = tmp_path_factory.mktemp("exposed")
    ca_key, ca_cert, ca = make_ca(d / "ca")
    crt, key = make_leaf(d / "stage", ca_key, ca_cert)
    o_key, o_cert, _ = make_ca(d / "other-ca", "another CA")
    o_crt, o_k = make_leaf(d / "outsider", o_key, o_cert, "outsider")
    keys = d / "keys"
    keys.write_text(f"alice sha256:{hashlib.sha256(b'alice-key').hexdigest()}\n")
    s = Stack(tiny_checkpoint, "--host", "0.0.0.0", "--queue-size", "1", "--grace-s", "10", "--api-keys-file",
              str(keys), "--tls-cert", str(crt), "--tls-key", str(key), "--tls-ca", str(ca))
    s.pki = {"ca": ca.read_bytes(), "crt": crt.read_bytes(), "key": key.read_bytes(),
             "other_crt": o_crt.read_bytes(), "other_key": o_k.read_bytes()}
    yield s
    assert s.stop() == 0


def _call(channel: grpc.Channel, service, method):
    """One call of `method` with an empty message (the refusal comes before any message is read)."""
    path = f"/{service.full_name}/{method.name}"
    kinds = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
             (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    fn = kinds[(method.client_streaming, method.server_streaming)](path)
    arg = iter([b""]) if method.client_streaming else b""
    out = fn(arg, timeout=5)
    return list(out) if method.server_streaming else out


def test_every_stage_port_refuses_every_call_without_a_deployment_certificate(exposed):
    pki = exposed.pki
    callers = {"plaintext": None, "TLS, no client certificate": grpc.ssl_channel_credentials(pki["ca"]),
               "a certificate of another CA": grpc.ssl_channel_credentials(pki["ca"], pki["other_key"],
                                                                          pki["other_crt"])}
    probed = 0
    for stage, service in SERVICES.items():
        address = exposed.addresses[stage]
        for who, creds in callers.items():
            with (grpc.insecure_channel(address) if creds is None else grpc.secure_channel(address, creds)) as ch:
                for svc, method in [(service, m) for m in service.methods] + list(common_health()):
                    with pytest.raises(grpc.RpcError) as info:
                        _call(ch, svc, method)
                    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (stage, who, method.name)
                    probed += 1
        # the deployment's own certificate is let in (and, authenticated, sees request ids)
        good = grpc.ssl_channel_credentials(pki["ca"], pki["key"], pki["crt"])
        with grpc.secure_channel(address, good) as ch:
            status = ch.unary_unary(f"/{service.full_name}/Status", request_serializer=lambda m: m.SerializeToString(),
                                    response_deserializer=common_pb2.StageStatus.FromString)
            assert status(common_pb2.StatusRequest(), timeout=5).stage == stage
    assert probed >= 3 * (sum(len(s.methods) for s in SERVICES.values()) + 4)


def common_health():
    from grpc_health.v1 import health_pb2

    svc = health_pb2.DESCRIPTOR.services_by_name["Health"]
    return [(svc, svc.methods_by_name["Check"])]


class FakeContext:
    """What a servicer reads of a call: its peer, whether it proved a certificate."""

    def __init__(self, peer: str, identities=None):
        self._peer, self._identities = peer, identities
        self.code = self.details = None

    def peer(self):
        return self._peer

    def peer_identities(self):
        return self._identities

    def is_active(self):
        return True

    def time_remaining(self):
        return None

    def add_callback(self, fn):
        return True

    def set_trailing_metadata(self, md):
        pass

    def abort(self, code, details):
        self.code, self.details = code, details
        raise grpc.RpcError(details)


def test_peer_addresses_and_who_is_authenticated():
    assert peer_host("ipv4:10.0.0.5:41234") == "10.0.0.5"
    assert peer_host("ipv6:[::1]:41234") == "::1" and peer_host("ipv6:%5B::1%5D:41234") == "::1"
    assert peer_host("unix:/tmp/s") == "localhost"
    assert authenticated_peer(FakeContext("ipv4:127.0.0.1:5"))
    assert authenticated_peer(FakeContext("ipv4:10.0.0.5:5", identities=[b"h3serve"]))
    assert not authenticated_peer(FakeContext("ipv4:10.0.0.5:5"))
    assert not authenticated_peer(FakeContext("ipv6:[2001:db8::1]:5"))


def test_status_gives_request_ids_only_to_authenticated_peers():
    stage = StageBase(StageConfig.from_knobs(stage="encoder"))
    try:
        scope = stage.scope(None, "video_0123")
        for ctx, want in ((FakeContext("ipv4:127.0.0.1:5"), "video_0123"),
                          (FakeContext("ipv4:10.0.0.5:5", identities=[b"h3serve"]), "video_0123"),
                          (FakeContext("ipv4:10.0.0.5:5"), HIDDEN)):
            assert stage.Status(common_pb2.StatusRequest(), ctx).current_request_id == want
        stage.finish(scope)
        st = stage.Status(common_pb2.StatusRequest(), FakeContext("ipv4:10.0.0.5:5"))
        assert st.current_request_id == "" and st.last.request_id == HIDDEN and st.requests_total == 1
    finally:
        stage.close()


def test_one_caller_cannot_hold_all_of_a_muxers_sessions(tmp_path):
    """The issue opened all 64 sessions from one address: one peer now holds at most --max-sessions-per-peer;
    another still opens its own; a freed session lets the first open again."""
    mux = MuxerServicer(StageConfig.from_knobs(stage="muxer", max_sessions=8, max_sessions_per_peer=3, tmp_dir=str(tmp_path)))
    try:
        def open_(peer):
            ctx = FakeContext(peer)
            return mux.OpenSession(muxer_pb2.OpenSessionRequest(request_id="r", width=64, height=64, fps=24,
                                                                sample_rate=32000, channels=2, ttl_s=600), ctx), ctx

        greedy = [open_("ipv4:10.0.0.9:1000")[0] for _ in range(3)]
        ctx = FakeContext("ipv4:10.0.0.9:1002")   # another port of the same host is the same caller
        with pytest.raises(grpc.RpcError):
            mux.OpenSession(muxer_pb2.OpenSessionRequest(request_id="r", width=64, height=64, fps=24,
                                                         sample_rate=32000, channels=2), ctx)
        assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sessions-per-peer 3" in ctx.details
        for _ in range(3):
            open_("ipv4:10.0.0.7:1000")          # the gateway's own sessions still open
        mux.Abort(muxer_pb2.AbortRequest(session_id=greedy[0].session_id, reason="done"), FakeContext("ipv4:x:1"))
        open_("ipv4:10.0.0.9:1003")
        assert len(mux.sessions) == 6
    finally:
        mux.close()
