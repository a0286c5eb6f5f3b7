"""TLS for every gRPC server and channel of a deployment, and the peers a stage may dial.

    --tls-cert FILE --tls-key FILE   this process's certificate: its gRPC server (and the gateway's HTTPS) and, with
                                     --tls-ca, its client certificate when it dials a peer
    --tls-ca FILE                    the CA of the deployment's peers: stage servers require a client certificate it
                                     signed (mTLS), and every channel to a peer verifies the peer's certificate
                                     against it. The gateway's front door asks callers for none (they use API keys).
    --tls-peer-name NAME             the name checked in a peer's certificate instead of the host dialled (the
                                     operator sets it: disaggregated stages dial each other by pod IP)
    --peers LIST                     comma list of what a stage may dial when a request names an address (a sink):
                                     HOST:PORT, or NET/LEN (any port in that network, e.g. a pod CIDR). The
                                     launcher sets it to the stages it started. Unset: any address (with a warning).

With a certificate configured a server listens for TLS only, so a plaintext client is refused at the handshake.
Files are read when the server or channel is made (a restart picks up a renewed certificate).
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass

import grpc

from h3serve.config.stage import StageConfig
from h3serve.errors import H3Error, RequestError
from h3serve.transport.grpc import channel_options, MESSAGE_LIMIT

log = logging.getLogger("h3serve.runtime.tls")


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise H3Error(f"--{what} {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class Tls:
    """The certificate files of one process (all None: plaintext)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    peer_name: str | None = None   # checked in every peer's certificate instead of the dialled host

    @classmethod
    def of(cls, config: StageConfig) -> "Tls":
        tls = cls(config.tls_cert, config.tls_key, config.tls_ca, config.tls_peer_name)
        if (tls.cert is None) != (tls.key is None):
            raise H3Error("--tls-cert and --tls-key go together: give both or neither")
        if tls.ca is not None and tls.cert is None:
            raise H3Error("--tls-ca needs --tls-cert and --tls-key (this process's certificate for mTLS)")
        return tls

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    def server_credentials(self, *, require_client: bool) -> grpc.ServerCredentials:
        pair = (_read(self.key, "tls-key"), _read(self.cert, "tls-cert"))
        ca = _read(self.ca, "tls-ca") if self.ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=require_client and ca
                                           is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca = _read(self.ca, "tls-ca") if self.ca else None
        if self.ca:
            return grpc.ssl_channel_credentials(ca, _read(self.key, "tls-key"), _read(self.cert, "tls-cert"))
        return grpc.ssl_channel_credentials(ca)

    def channel(self, address: str, max_message: int = MESSAGE_LIMIT, extra: tuple = ()) -> grpc.Channel:
        """A channel to a peer: TLS (verified against the CA, with this process's certificate) when configured."""
        options = [*channel_options(max_message), *extra]
        if not self.enabled:
            return grpc.insecure_channel(address, options=options)
        if self.peer_name:
            options.append(("grpc.ssl_target_name_override", self.peer_name))
        return grpc.secure_channel(address, self.channel_credentials(), options=options)

    def add_port(self, server: grpc.Server, address: str, *, require_client: bool) -> int:
        if not self.enabled:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.server_credentials(require_client=require_client))


def parse_peers(text: str | None) -> tuple | None:
    """`--peers` as (host, port) pairs and networks; None when unset."""
    if text is None:
        return None
    out: list = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        if "/" in item:
            try:
                out.append(ipaddress.ip_network(item, strict=False))
                continue
            except ValueError:
                raise RequestError("peers", item, "HOST:PORT or NET/LEN") from None
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise RequestError("peers", item, "HOST:PORT or NET/LEN")
        out.append((host.strip("[]"), int(port)))
    return tuple(out)


def check_peer(peers: tuple | None, address: str, field: str) -> None:
    """Refuse an address a request names unless the deployment declares it (RequestError naming `field`)."""
    if peers is None:
        return
    host, sep, port = address.rpartition(":")
    allowed = "an address of this deployment's peers (--peers)"
    if not sep or not port.isdigit() or not host or "/" in host:
        raise RequestError(field, address, allowed)
    host = host.strip("[]")
    for p in peers:
        if isinstance(p, tuple):
            if p == (host, int(port)):
                return
        else:
            try:
                if ipaddress.ip_address(host) in p:
                    return
            except ValueError:
                pass
    raise RequestError(field, address, allowed)
