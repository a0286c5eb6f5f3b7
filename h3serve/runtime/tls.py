"""TLS for every gRPC server and channel of a deployment, and the peers a stage may dial.

    --tls-cert FILE --tls-key FILE   this process's certificate: its gRPC server (and the gateway's HTTPS) and, with
                                     --tls-ca, its client certificate when it dials a peer
    --tls-ca FILE                    the CA of the deployment's peers: stage servers require a client certificate it
                                     signed (mTLS), and every channel to a peer verifies the peer's certificate
                                     against it. The gateway's front door asks callers for none (they use API keys).
    --tls-peer-name NAME             the name checked in a peer's certificate instead of the host dialled (the
                                     operator sets it: disaggregated stages dial each other by pod IP)
    --peers LIST                     comma list of what a stage may dial when a request names an address (a sink):
                                     IP:PORT; NAME:PORT (an IP the name resolves to now, that very port: the
                                     operator names the headless Services of the stages a pod streams to); or
                                     NET/LEN (any port in that network, e.g. a pod CIDR). The launcher sets it to the
                                     stages it started. Unset: any address (with a warning).

With a certificate configured a server listens for TLS only, so a plaintext client is refused at the handshake.
Files are read when the server or channel is made (a restart picks up a renewed certificate).

A stage (encoder, DiT, VAE, muxer) takes calls without API keys: its callers are its deployment's peers. So beyond
loopback it listens only with mTLS (--tls-cert, --tls-key, --tls-ca), or where the operator says a network fences
its port (--no-peer-auth); otherwise it refuses to start (`h3serve.runtime.prechecks.check_stage_exposure`).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import Future, TimeoutError
from dataclasses import dataclass

import grpc

from h3serve.config.stage import StageConfig
from h3serve.errors import H3Error, RequestError
from h3serve.runtime.prechecks import check_tls_files, is_loopback
from h3serve.transport.channel import channel_options, MESSAGE_LIMIT

log = logging.getLogger("h3serve.runtime.tls")

NAME_TTL_S = 5.0          # a --peers name's addresses are resolved again after this long (scale-ups are seen)
NAME_RETRY_S = 1.0        # ... and at once when an address is not among them and they are older than this
RESOLVE_TIMEOUT_S = 2.0   # a name that does not resolve in this long refuses the address


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise H3Error(f"--{what} {path}: {exc.strerror}") from None


def peer_host(peer: str) -> str:
    """The host of a gRPC `context.peer()` ('ipv4:10.0.0.5:41234', 'ipv6:[::1]:41234' (maybe %-encoded),
    'unix:...' as 'localhost')."""
    scheme, _, rest = urllib.parse.unquote(peer or "").partition(":")
    if scheme in ("unix", "unix-abstract"):
        return "localhost"
    host = rest.rpartition(":")[0] if scheme in ("ipv4", "ipv6") else rest
    return host.strip("[]")


def authenticated_peer(context) -> bool:
    """A caller that proved a certificate of the deployment's CA (mTLS), or one on this host."""
    if context is None:
        return True
    try:
        if context.peer_identities():
            return True
        return is_loopback(peer_host(context.peer()))
    except Exception:  # noqa: BLE001 - no peer known: not authenticated
        return False


def peer_identity(context) -> str:
    """Whom a stage call comes from, for per-peer limits: the caller's address (each pod its own IP; a shared
    deployment certificate names every peer alike, so it is not the identity)."""
    try:
        return peer_host(context.peer()) or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


@dataclass(frozen=True)
class Tls:
    """The certificate files of one process (all None: plaintext)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    peer_name: str | None = None   # checked in every peer's certificate instead of the dialled host

    @classmethod
    def of(cls, config: StageConfig) -> "Tls":
        check_tls_files(config)
        return cls(config.server.tls_cert, config.server.tls_key, config.server.tls_ca, config.server.tls_peer_name)

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


@dataclass(frozen=True)
class PeerName:
    """A `--peers` item naming a host (e.g. a stage's headless Service): an address is this peer when its IP is
    among the name's current addresses and its port is exactly this one."""

    host: str
    port: int


def _resolve(host: str) -> frozenset:
    """The IP addresses `host` resolves to now (socket.getaddrinfo: /etc/hosts, then DNS)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return frozenset(ipaddress.ip_address(str(sa[0]).split("%")[0]) for *_, sa in infos)


class Peers:
    """What a stage may dial when a request names an address (`--peers`): IP:PORT and HOST:PORT items, networks.

    A name's addresses are resolved when an address is checked against it, cached NAME_TTL_S (so a scale-up is seen
    within seconds) and resolved again at once when an address is not among them and they are older than
    NAME_RETRY_S (a replica that just became ready). A resolution takes at most RESOLVE_TIMEOUT_S; one that fails or
    takes longer refuses the address (a RequestError naming the field and the name), and one in flight is shared by
    every check that needs it."""

    def __init__(self, items: tuple, resolve: Callable[[str], frozenset] = _resolve):
        self.items = items
        self._resolve = resolve
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, frozenset]] = {}      # host -> (resolved at, its addresses)
        self._pending: dict[str, Future] = {}                     # host -> the resolution in flight

    def check(self, address: str, field: str) -> None:
        """Refuse `address` unless the deployment declares it (RequestError naming `field`)."""
        host, sep, port = address.rpartition(":")
        allowed = "an address of this deployment's peers (--peers)"
        if not sep or not _ascii_port(port) or not host or "/" in host:
            raise RequestError(field, address, allowed)
        host, port_n = host.strip("[]"), int(port)
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None   # a name: only a declared one, as written (it is dialled by that name)
        failures = []
        for p in self.items:
            if isinstance(p, PeerName):
                if p.port != port_n:
                    continue
                if p.host.lower() == host.lower():   # the declared name itself, as written
                    return
                if ip is None:
                    continue
                try:
                    if ip in self._addresses(p.host, NAME_TTL_S) or ip in self._addresses(p.host, NAME_RETRY_S):
                        return
                except _Unresolved as exc:
                    failures.append(str(exc))
            elif isinstance(p, tuple):
                if ip is not None and p == (ip, port_n):
                    return
            elif ip is not None and ip.version == p.version and ip in p:
                return
        if failures:
            allowed += ": " + "; ".join(failures)
        raise RequestError(field, address, allowed)

    def _addresses(self, host: str, max_age: float) -> frozenset:
        """`host`'s addresses, resolved at most `max_age` seconds ago."""
        with self._lock:
            cached = self._cache.get(host)
            if cached is not None and time.monotonic() - cached[0] < max_age:
                return cached[1]
            future = self._pending.get(host)
            if future is None:
                future = self._pending[host] = Future()
                # a daemon thread: a resolver that never answers holds up neither a request nor the exit
                threading.Thread(target=self._run, args=(host, future), name="h3serve-peers", daemon=True).start()
        try:
            return future.result(timeout=RESOLVE_TIMEOUT_S)
        except TimeoutError:
            raise _Unresolved(f"{host} did not resolve within {RESOLVE_TIMEOUT_S:g} s") from None
        except OSError as exc:
            raise _Unresolved(f"{host} did not resolve ({exc.strerror or exc})") from None

    def _run(self, host: str, future: Future) -> None:
        try:
            addresses = self._resolve(host)
        except Exception as exc:  # noqa: BLE001 - any failure (gaierror, a label too long) refuses, never hangs
            with self._lock:
                self._pending.pop(host, None)
            future.set_exception(exc if isinstance(exc, OSError) else OSError(str(exc) or type(exc).__name__))
            return
        with self._lock:
            self._cache[host] = (time.monotonic(), addresses)
            self._pending.pop(host, None)
        future.set_result(addresses)


class _Unresolved(Exception):
    """A name of --peers did not resolve (in time)."""


def parse_peers(text: str | None) -> Peers | None:
    """`--peers` as Peers (IP:PORT pairs, HOST:PORT names and networks); None when unset."""
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
        if not sep or not _ascii_port(port) or not host:
            raise RequestError("peers", item, "HOST:PORT or NET/LEN")
        host = host.strip("[]")
        try:
            out.append((ipaddress.ip_address(host), int(port)))
        except ValueError:
            out.append(PeerName(host, int(port)))
    return Peers(tuple(out))


def check_peer(peers: Peers | None, address: str, field: str) -> None:
    """Refuse an address a request names unless the deployment declares it (RequestError naming `field`). Without
    --peers any address passes, but a port must be one: ASCII digits in 1..65535 (not '５' or '²')."""
    if peers is not None:
        peers.check(address, field)
        return
    port = address.rpartition(":")[2]
    if port and any(c.isdigit() for c in port) and not (_ascii_port(port) and 0 < int(port) < 65536):
        raise RequestError(field, address, "HOST:PORT with a port of ASCII digits in 1..65535")


def _ascii_port(text: str) -> bool:
    return text.isascii() and text.isdigit()
