"""A pod's probe by gRPC health, as an exec probe: `python -m h3serve.runtime.probe [--live] [--port P] [TLS]`.

The kubelet's own gRPC probe cannot serve two cases the operator renders:
- with `spec.tls` every server listens for TLS only and the stages require a client certificate (mTLS); the
  kubelet's probe speaks plaintext and presents none;
- liveness: a draining server answers NOT_SERVING on purpose (it finishes what it admitted), which the kubelet's
  probe counts as a failure, while a hung process (SIGSTOP, a wedged interpreter) still passes a TCP check.

So: ready (the default) = the server answers SERVING; `--live` = it answers at all, SERVING or NOT_SERVING, within
`--timeout`. Exit 0 or 1, with one line on stdout saying why (the kubelet records it in the probe's event).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3serve.config.vocab import GRPC_PORT, HEALTH_SERVICE


def check(port: int, *, live: bool, timeout: float, cert: str | None = None, key: str | None = None,
          ca: str | None = None, server_name: str | None = None) -> tuple[bool, str]:
    """(passed, why) of one health check of 127.0.0.1:port."""
    address = f"127.0.0.1:{port}"
    if cert is None:
        channel = grpc.insecure_channel(address)
    else:
        with open(ca or cert, "rb") as f:
            roots = f.read()
        with open(cert, "rb") as f:
            chain = f.read()
        with open(key, "rb") as f:
            private = f.read()
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(roots, private, chain), options=options)
    with channel:
        try:
            r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=HEALTH_SERVICE),
                                                          timeout=timeout)
        except grpc.RpcError as exc:
            return False, f"{address}: no health answer in {timeout:g}s ({exc.code().name}: {exc.details()})"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    if live or r.status == health_pb2.HealthCheckResponse.SERVING:
        return True, f"{address}: {status}"
    return False, f"{address}: {status}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h3serve.runtime.probe", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=GRPC_PORT)
    p.add_argument("--live", action="store_true", help="pass on any answer (NOT_SERVING too: draining, loading)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    p.add_argument("--tls-cert", help="this pod's certificate (presented: the stages require one)")
    p.add_argument("--tls-key")
    p.add_argument("--tls-ca", help="the CA the server's certificate is checked against")
    p.add_argument("--server-name", help="the name the server's certificate must carry (a Service DNS name)")
    a = p.parse_args(argv)
    if (a.tls_cert is None) != (a.tls_key is None):
        p.error("--tls-cert and --tls-key go together")
    try:
        ok, why = check(a.port, live=a.live, timeout=a.timeout, cert=a.tls_cert, key=a.tls_key, ca=a.tls_ca,
                        server_name=a.server_name)
        if not ok and a.tls_cert is not None and "UNAVAILABLE" in why:
            # a gang's follower pod serves only its rank's health, in plaintext (the leader holds the TLS server)
            ok, plain = check(a.port, live=a.live, timeout=a.timeout)
            why = plain if ok else f"{why}; plaintext: {plain}"
    except OSError as exc:
        ok, why = False, f"cannot read a TLS file: {exc.filename}: {exc.strerror}"
    word = ("alive" if ok else "not alive") if a.live else ("ready" if ok else "not ready")
    print(f"{word}: {why}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
