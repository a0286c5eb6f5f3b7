"""TLS on the front door (gRPC and HTTPS) and mTLS between the stages: a real stack whose every process has a
certificate of one test CA (made here with `cryptography`). A real handshake works end to end; plaintext clients,
clients without a certificate and clients of another CA are refused; a stage dials only its declared peers (literal
addresses, and names by their resolved addresses in a stage process of its own), checked before any work."""

from __future__ import annotations

import ssl
import time

import grpc
import httpx
import pytest

from h3serve._proto import common_pb2, dit_pb2, dit_pb2_grpc, gateway_pb2, gateway_pb2_grpc, vae_pb2, vae_pb2_grpc
from h3serve.client import Client
from h3serve.config.stage import StageConfig, tls_peer_name
from h3serve.distributed.world import free_port
from h3serve.errors import RequestError
from h3serve.runtime.stage import StageBase
from h3serve.runtime.tls import Tls, check_peer, parse_peers

from .certs import make_ca, make_leaf
from .conftest import REQUEST, LoneStage, Stack


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert, ca = make_ca(d / "ca")
    crt, key = make_leaf(d / "stage", ca_key, ca_cert)
    o_key, o_cert, _ = make_ca(d / "other-ca", "another CA")
    o_crt, o_k = make_leaf(d / "outsider", o_key, o_cert, "outsider")
    return {"ca": ca, "crt": crt, "key": key, "other_crt": o_crt, "other_key": o_k}


@pytest.fixture(scope="module")
def tls_stack(tiny_checkpoint, pki):
    s = Stack(tiny_checkpoint, "--queue-size", "1", "--grace-s", "10", "--tls-cert", str(pki["crt"]),
              "--tls-key", str(pki["key"]), "--tls-ca", str(pki["ca"]))
    yield s
    assert s.stop() == 0


def creds(pki, *, cert: str | None = None, key: str | None = None):
    ca = pki["ca"].read_bytes()
    if cert is None:
        return grpc.ssl_channel_credentials(ca)
    return grpc.ssl_channel_credentials(ca, pki[key].read_bytes(), pki[cert].read_bytes())


def test_front_door_grpc_over_tls_generates_and_plaintext_is_refused(tls_stack, pki):
    with Client(tls_stack.grpc, credentials=creds(pki)) as client:
        result = client.generate_sync(REQUEST["prompt"], **{k: v for k, v in REQUEST.items() if k != "prompt"},
                                      timeout=120)
        assert result.mp4_bytes > 1000 and result.mp4[4:8] == b"ftyp"   # every stage hop was mTLS
    with grpc.insecure_channel(tls_stack.grpc) as ch, pytest.raises(grpc.RpcError) as info:
        gateway_pb2_grpc.GatewayStub(ch).Info(gateway_pb2.InfoRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    other = grpc.ssl_channel_credentials(pki["other_crt"].read_bytes())   # trusts another CA only
    with grpc.secure_channel(tls_stack.grpc, other) as ch, pytest.raises(grpc.RpcError) as info:
        gateway_pb2_grpc.GatewayStub(ch).Info(gateway_pb2.InfoRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_front_door_https_and_plaintext_refused(tls_stack, pki):
    assert tls_stack.http.startswith("https://")
    r = httpx.get(f"{tls_stack.http}/ready", verify=ssl.create_default_context(cafile=str(pki["ca"])), timeout=10)
    assert r.status_code == 200
    plain = tls_stack.http.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        r = httpx.get(f"{plain}/health", timeout=10)
        raise AssertionError(f"plaintext HTTP answered {r.status_code}")
    with pytest.raises(httpx.ConnectError):   # a client that does not trust the certificate stops itself
        httpx.get(f"{tls_stack.http}/health", timeout=10)


def test_stages_require_a_certificate_of_the_deployment(tls_stack, pki):
    dit = tls_stack.addresses["dit"]
    for c in (None, creds(pki), creds(pki, cert="other_crt", key="other_key")):
        ch = grpc.secure_channel(dit, c) if c is not None else grpc.insecure_channel(dit)
        with ch, pytest.raises(grpc.RpcError) as info:
            dit_pb2_grpc.DiTStub(ch).Status(common_pb2.StatusRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(dit, creds(pki, cert="crt", key="key")) as ch:
        assert dit_pb2_grpc.DiTStub(ch).Status(common_pb2.StatusRequest(), timeout=5).ready


def test_a_stage_dials_only_declared_peers():
    peers = parse_peers("127.0.0.1:50055, muxer.ns.svc:50051, 10.8.0.0/16")
    for ok in ("127.0.0.1:50055", "muxer.ns.svc:50051", "10.8.3.4:50051"):
        check_peer(peers, ok, "sink.address")
    for bad in ("127.0.0.1:22", "169.254.169.254:80", "unix:/var/run/docker.sock", "evil.example:50051", "x"):
        with pytest.raises(RequestError) as info:
            check_peer(peers, bad, "sink.address")
        assert info.value.field == "sink.address" and "peers" in str(info.value)
    stage = StageBase(StageConfig.from_knobs(stage="vae", peers="127.0.0.1:50055"))
    try:
        with pytest.raises(RequestError, match="sink.address"):
            stage.channel("127.0.0.1:22")
        assert stage._channels == {}          # nothing dialled, nothing kept
        assert stage.channel("127.0.0.1:50055") is stage.channel("127.0.0.1:50055")
    finally:
        stage.close()
    with pytest.raises(RequestError, match="peers"):
        parse_peers("not-an-address")


def test_peers_dialled_by_ip_are_checked_for_the_deployments_peer_name(tmp_path):
    """Disaggregated stages dial each other by pod IP, which a shared certificate cannot name: with
    --tls-peer-name every channel checks that name instead, and a certificate without it is refused."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    ca_key, ca_cert, ca = make_ca(tmp_path / "ca")
    name = tls_peer_name("h3", "ns")
    crt, key = make_leaf(tmp_path / "pod", ca_key, ca_cert, dns=(name,), ips=())   # no IP in it, as in a cluster
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = Tls(str(crt), str(key), str(ca)).add_port(server, "127.0.0.1:0", require_client=True)
    server.start()
    try:
        def check(tls: Tls) -> bool:
            with tls.channel(f"127.0.0.1:{port}") as ch:
                try:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    return True
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                    return False

        assert check(Tls(str(crt), str(key), str(ca), peer_name=name))
        assert not check(Tls(str(crt), str(key), str(ca)))                      # 127.0.0.1 is not in it
        assert not check(Tls(str(crt), str(key), str(ca), peer_name="other.ns.h3serve-peer"))
    finally:
        server.stop(0)


def decode_refusal(address: str, sink: str, credentials=None) -> tuple[str, str]:
    """(field, message) of a VAE Decode into `sink` that sends no latents: `video_latents` means the sink passed."""
    params = vae_pb2.DecodeParams(request_id="peers", sink=common_pb2.Sink(address=sink, session_id="s"),
                                  num_frames=22, width=320, height=256)
    inputs = [vae_pb2.DecodeInput(params=params), vae_pb2.DecodeInput(end=common_pb2.StreamEnd(tensors=0))]
    ch = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with ch, pytest.raises(grpc.RpcError) as err:
        list(vae_pb2_grpc.VAEStub(ch).Decode(iter(inputs), timeout=20))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return dict(err.value.trailing_metadata())["h3serve-field"], err.value.details()


def test_undeclared_sinks_are_refused_before_any_work(tls_stack, pki):
    """The DiT checks its latents sink when the request arrives (not after minutes of denoising), the VAE its
    muxer sink before it waits for any latents."""
    mtls = creds(pki, cert="crt", key="key")
    assert decode_refusal(tls_stack.addresses["vae"], "169.254.169.254:80", mtls)[0] == "sink.address"
    assert decode_refusal(tls_stack.addresses["vae"], tls_stack.addresses["muxer"], mtls)[0] == "video_latents"
    params = dit_pb2.DiTParams(request_id="peers", latent_frames=37, latent_height=16, latent_width=20,
                               audio_latents=207, seed=0, task="t2va", profile="base", steps=2,
                               latents_sink=common_pb2.Sink(address="10.0.0.1:50051", session_id="s"))
    t0 = time.monotonic()
    with grpc.secure_channel(tls_stack.addresses["dit"], mtls) as ch, pytest.raises(grpc.RpcError) as err:
        list(dit_pb2_grpc.DiTStub(ch).Generate(iter([dit_pb2.DiTInput(params=params)]), timeout=20))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert dict(err.value.trailing_metadata())["h3serve-field"] == "latents_sink.address"
    assert time.monotonic() - t0 < 5


def test_a_stage_process_accepts_a_named_peer_at_its_resolved_addresses_only(tiny_checkpoint):
    """`--peers NAME:PORT` as the operator renders it (the sink stage's headless Service): a VAE process accepts
    the IP the name resolves to on that port, and refuses another port, another IP and a name that does not
    resolve, each as INVALID_ARGUMENT naming `sink.address`."""
    port = free_port()
    vae = LoneStage("vae", "--checkpoint", str(tiny_checkpoint), "--no-warmup",
                    "--peers", f"localhost:{port},muxer-headless.nowhere.invalid:{port + 1}", env={})
    try:
        assert decode_refusal(vae.address, f"127.0.0.1:{port}")[0] == "video_latents"   # the sink passed
        for bad in (f"127.0.0.1:{port + 2}", f"10.1.2.3:{port}"):
            field, message = decode_refusal(vae.address, bad)
            assert field == "sink.address" and "--peers" in message, message
        field, message = decode_refusal(vae.address, f"10.1.2.3:{port + 1}")
        assert field == "sink.address" and "muxer-headless.nowhere.invalid did not resolve" in message, message
    finally:
        vae.stop()
