"""Who may call the gateway: bearer API keys from a file, held hashed, re-read when the file changes (a key is
rotated by editing the file or the Secret mounted there — no restart).

The keys file (`--api-keys-file`, or $H3SERVE_API_KEYS_FILE), one caller per line:

    # NAME  sha256:HEX      (HEX = sha256 of the key: printf %s "$KEY" | sha256sum)
    alice   sha256:2bd806c97f0e00af1a1fc3328fa763a9269723c8db8fac4f93af71db186d6e90
    alice   sha256:...      (a second key for the same caller while it rotates)
    batch   sha256:...

A job belongs to the NAME of the key that created it; every key of that name sees it. HTTP sends
`Authorization: Bearer KEY`, gRPC the `authorization` metadata with the same value. No key or an unknown one is
Unauthenticated (401 / UNAUTHENTICATED); another caller's job is PermissionDenied (403 / PERMISSION_DENIED).

With no keys file the gateway serves without authentication only on a loopback address (a laptop); anywhere else it
refuses to start unless `--no-auth` says so (`h3serve.runtime.prechecks.check_exposure`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
import time

import grpc

from h3serve.errors import H3Error, Unauthenticated
from h3serve.errortable import MD_CODE, classify

log = logging.getLogger("h3serve.gateway")

RECHECK_S = 1.0               # the file is stat()ed at most this often
_LINE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._@-]{0,127})\s+sha256:(?P<hex>[0-9a-fA-F]{64})$")
# gRPC methods any caller may use without a key: health checks (probes) and reflection
OPEN_GRPC = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class KeysFileError(H3Error):
    """The keys file is missing or has a line that is not `NAME sha256:HEX`."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keys(text: str, path: str) -> dict[str, str]:
    """sha256 hex -> caller name."""
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise KeysFileError(f"{path}:{n}: expected 'NAME sha256:HEX' (NAME of letters, digits, ._@-; HEX the "
                                "64-digit sha256 of the key), got a line of another form")
        out[m["hex"].lower()] = m["name"]
    return out


class Authenticator:
    """Bearer keys from `path` (None: authentication off, every caller is None)."""

    def __init__(self, path: str | None):
        self.path = path
        self._keys: dict[str, str] = {}
        self._stamp: tuple | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        if path is not None:
            self._reload(force=True)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def _reload(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < RECHECK_S:
            return
        with self._lock:
            self._checked = now
            try:
                st = os.stat(self.path)   # follows the Secret volume's ..data symlink
            except OSError as exc:
                if force:
                    raise KeysFileError(f"--api-keys-file {self.path}: {exc.strerror}") from None
                log.warning("API keys file %s: %s; keeping the %d keys read before", self.path, exc.strerror,
                            len(self._keys))
                return
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            try:
                with open(self.path, encoding="utf-8") as f:
                    keys = parse_keys(f.read(), self.path)
            except (OSError, UnicodeDecodeError, KeysFileError) as exc:
                if force:
                    raise KeysFileError(str(exc)) from None
                log.warning("API keys file %s not reloaded: %s; keeping the %d keys read before", self.path, exc,
                            len(self._keys))
                return
            if not force:
                log.info("API keys file %s reloaded: %d keys of %d callers", self.path, len(keys),
                         len(set(keys.values())))
            self._keys, self._stamp = keys, stamp

    def caller(self, authorization: str | None) -> str | None:
        """The caller's name for an `Authorization` value; None when authentication is off. Raises
        Unauthenticated naming what is wrong."""
        if not self.enabled:
            return None
        self._reload()
        if not authorization:
            raise Unauthenticated("missing API key: send the header 'Authorization: Bearer KEY' (gRPC: the "
                                  "'authorization' metadata)")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("the authorization must be 'Bearer KEY'")
        digest = hash_key(key.strip())
        for known, name in self._keys.items():
            if hmac.compare_digest(known, digest):
                return name
        raise Unauthenticated("unknown API key (revoked, mistyped, or of another deployment)")

    def caller_of(self, metadata) -> str | None:
        """The caller of a gRPC call from its invocation metadata (one `authorization` entry, no more)."""
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if len(values) > 1 and self.enabled:
            raise Unauthenticated(f"{len(values)} 'authorization' metadata entries: send exactly one")
        value = values[0] if values else None
        return self.caller(value if isinstance(value, str) else (value.decode() if value else None))


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses a gRPC call without a valid key before its message is read (health and reflection stay open)."""

    def __init__(self, auth: Authenticator):
        self.auth = auth

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if not self.auth.enabled or method.startswith(OPEN_GRPC):
            return continuation(handler_call_details)
        try:
            self.auth.caller_of(handler_call_details.invocation_metadata)
        except Unauthenticated as exc:
            return _refuse(exc, continuation(handler_call_details))
        return continuation(handler_call_details)


def _refuse(exc: Unauthenticated, handler):
    c = classify(exc)

    def abort(request_or_iterator, context):
        context.set_trailing_metadata(((MD_CODE, c.kind.code),))
        context.abort(c.kind.grpc, c.message)

    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)
