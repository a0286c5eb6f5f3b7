"""Webhooks: when an HTTP job ends (completed or failed) the gateway POSTs a signed event to the caller's URL, so a
caller need not poll.

    job concluded ──► Deliveries.enqueue ──► POST (pinned IP, no redirects, timeout) ──► 2xx: delivered
                                                  │ refused address, network error, 408/425/429/5xx
                                                  └─► again after a jittered backoff, `webhook_attempts` in all

The event (JSON): `{"id": "evt_…", "object": "event", "type": "video.completed" | "video.failed", "created_at",
"data": {"id", "object": "video", "status", "model", "error", "mp4_bytes", "sha256", "completed_at"}}`, the event
types OpenAI's videos API defined. Signed as Standard Webhooks specifies (what OpenAI's webhooks use): headers
`webhook-id`, `webhook-timestamp` (unix seconds) and `webhook-signature: v1,<base64 HMAC-SHA256 over
"{id}.{timestamp}.{body}">` with the caller's secret (`whsec_<base64>`, from `--webhook-secrets-file`). The id is
the same on every attempt of one event, so a receiver drops repeats by it.

Where a URL may point: `--webhook-allow`, a comma list of host names (`hooks.example.com`, `*.example.com`) and
networks (`10.20.0.0/16`). A named host is accepted only while every address it resolves to is a public one; an
address inside a listed network is accepted whatever it is. So the gateway cannot be aimed at loopback, the pod
network, link-local metadata services or private ranges unless the deployment lists them. The name is resolved at
submit (a refused URL is a 400 naming `webhook_url`) and again at each attempt, and the POST goes to the address
that was checked (no second lookup a rebinding DNS could answer differently). Redirects are not followed.

Each attempt is logged on the job (`webhook.deliveries`, read back with the job) and counted in
`h3serve_webhook_deliveries{outcome}`. The gateway that ran the job delivers its event; deliveries still waiting
when it stops are lost (the log says how far they got).
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import hmac
import http.client
import ipaddress
import json
import logging
import os
import random
import re
import socket
import ssl
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

from h3serve.config.stage import StageConfig
from h3serve.errors import H3Error, RequestError
from h3serve.errortable import error_object

if TYPE_CHECKING:
    from .jobs import Job

log = logging.getLogger("h3serve.gateway")

EVENT_TYPES = {"completed": "video.completed", "failed": "video.failed"}
MAX_URL = 2048
RETRY_STATUS = frozenset((408, 425, 429))    # and every 5xx: the receiver may take it later
MAX_BACKOFF_S = 300.0
MAX_LOG = 20                                 # attempts kept on the job
SECRET_PREFIX = "whsec_"
DEFAULT_CALLER = "*"                         # the secrets file's line for callers without their own (auth off: all)
_SECRET_LINE = re.compile(r"^(?P<name>\*|[A-Za-z0-9][A-Za-z0-9._@-]{0,127})\s+whsec_(?P<b64>[A-Za-z0-9+/=]{16,})$")


class WebhookRefused(Exception):
    """A URL the policy does not allow (at submit: a RequestError naming webhook_url; at delivery: an attempt that
    failed and is retried, since DNS may answer differently later)."""


# -- where a webhook may point ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    url: str
    scheme: str
    host: str
    port: int
    path: str
    address: str           # the checked address the POST connects to


class Policy:
    """`--webhook-allow`: host names (exact or `*.suffix`) and networks. Empty: webhooks are refused."""

    def __init__(self, allow: str | None, resolve: Callable[[str, int], list[str]] | None = None):
        self.hosts: list[str] = []
        self.networks: list[ipaddress._BaseNetwork] = []
        for entry in (allow or "").split(","):
            entry = entry.strip().lower()
            if not entry:
                continue
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if not re.fullmatch(r"(\*\.)?[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*", entry):
                    raise H3Error(f"--webhook-allow: {entry!r} is neither a host name (a.example.com, "
                                  "*.example.com) nor a network (10.0.0.0/8)") from None
                self.hosts.append(entry)
        self.resolve = resolve or _resolve

    @property
    def enabled(self) -> bool:
        return bool(self.hosts or self.networks)

    def _named(self, host: str) -> bool:
        return any(host == h or (h.startswith("*.") and host.endswith(h[1:])) for h in self.hosts)

    def check(self, url: Any) -> Target:
        """The URL's target with the address to connect to, or WebhookRefused saying why."""
        if not isinstance(url, str) or not url or len(url) > MAX_URL:
            raise WebhookRefused(f"an http(s) URL of at most {MAX_URL} characters")
        if not self.enabled:
            raise WebhookRefused("this deployment sends no webhooks (its --webhook-allow is empty)")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise WebhookRefused(f"not a URL ({exc})") from None
        if parts.scheme not in ("https", "http"):
            raise WebhookRefused("an http(s) URL")
        if parts.username is not None or parts.password is not None:
            raise WebhookRefused("a URL without user:password (the event is signed instead)")
        host = (parts.hostname or "").lower()
        if not host:
            raise WebhookRefused("a URL with a host")
        port = port or (443 if parts.scheme == "https" else 80)
        try:
            literal = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if literal is None and not self._named(host) and not self.networks:
            raise WebhookRefused(f"host {host} is not in this deployment's --webhook-allow")
        try:
            addresses = [literal.compressed] if literal is not None else self.resolve(host, port)
        except OSError as exc:
            raise WebhookRefused(f"host {host} does not resolve ({exc})") from None
        if not addresses:
            raise WebhookRefused(f"host {host} does not resolve")
        for a in addresses:
            ip = ipaddress.ip_address(a)
            ip = getattr(ip, "ipv4_mapped", None) or ip
            if any(ip in n for n in self.networks):
                continue
            if literal is None and self._named(host) and ip.is_global:
                continue
            why = "a public address of a listed host name" if self._named(host) else "inside a listed network"
            where = f"address {a}" if literal is not None else f"{host} resolves to {a}, which"
            raise WebhookRefused(f"{where} is not {why} (--webhook-allow)")
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        return Target(url, parts.scheme, host, port, path, addresses[0])


def _resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


# -- whose secret signs it ----------------------------------------------------------------------------------------------

class Secrets:
    """`--webhook-secrets-file`: `NAME whsec_BASE64` a line (`*` for callers without a line of their own), re-read
    when the file changes, like the API keys file."""

    def __init__(self, path: str | None):
        self.path = path
        self._stamp: tuple | None = None
        self._secrets: dict[str, bytes] = {}
        self._lock = threading.Lock()
        if path is not None:
            self._reload(strict=True)

    def _reload(self, strict: bool = False) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            with open(self.path, encoding="utf-8") as f:
                secrets = parse_secrets(f.read(), self.path)
        except (OSError, UnicodeDecodeError, H3Error) as exc:
            if strict:
                raise H3Error(f"--webhook-secrets-file {self.path}: {exc}") from None
            log.warning("webhook secrets file %s not reloaded: %s; keeping the %d read before", self.path, exc,
                        len(self._secrets))
            return
        with self._lock:
            self._secrets, self._stamp = secrets, stamp

    def secret(self, caller: str | None) -> bytes | None:
        if self.path is None:
            return None
        self._reload()
        with self._lock:
            return self._secrets.get(caller or DEFAULT_CALLER, self._secrets.get(DEFAULT_CALLER))


def parse_secrets(text: str, path: str) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SECRET_LINE.match(line)
        try:
            secret = base64.b64decode(m["b64"], validate=True) if m else b""
        except ValueError:
            secret = b""
        if not secret:
            raise H3Error(f"{path}:{n}: expected 'NAME whsec_BASE64' (NAME a caller's key name or *; the secret "
                          "base64, at least 16 characters)")
        out[m["name"]] = secret
    return out


def sign(secret: bytes, event_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header's value (Standard Webhooks v1)."""
    mac = hmac.new(secret, f"{event_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def verify(secret: str, headers: dict[str, str], body: bytes, tolerance_s: float = 300.0) -> dict:
    """What a receiver does (docs/api.md): check the signature and the timestamp's age; the event, or ValueError."""
    headers = {k.lower(): v for k, v in headers.items()}
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    ts = int(headers["webhook-timestamp"])
    if abs(time.time() - ts) > tolerance_s:
        raise ValueError(f"webhook-timestamp {ts} is more than {tolerance_s:g}s from now")
    want = sign(key, headers["webhook-id"], ts, body).encode()
    if not any(hmac.compare_digest(want, s.encode()) for s in headers["webhook-signature"].split()):
        raise ValueError("no webhook-signature matches")
    return json.loads(body)


# -- the deliveries -------------------------------------------------------------------------------------------------

def event(job: "Job") -> dict:
    """The event a concluded job sends (the same on every attempt)."""
    return {"id": f"evt_{uuid.uuid4().hex}", "object": "event", "type": EVENT_TYPES[job.status],
            "created_at": int(time.time()),
            "data": {"id": job.id, "object": "video", "status": job.status, "model": job.validated.model,
                     "error": error_object(job.error) if job.error else None, "mp4_bytes": job.mp4_bytes or None,
                     "sha256": job.sha256 or None, "outputs": job.outputs or None,
                     "completed_at": int(job.completed_at) if job.completed_at else None}}


class Webhooks:
    """The gateway's webhooks: the submit-time check, and a thread that delivers events with retries."""

    def __init__(self, config: StageConfig, on_attempt: Callable[["Job"], None], metrics=None):
        g = config.gateway
        self.policy = Policy(g.webhook_allow)
        self.secrets = Secrets(g.webhook_secrets_file)
        self.default_url = g.webhook_url
        self.attempts, self.backoff_s, self.timeout_s = g.webhook_attempts, g.webhook_backoff_s, g.webhook_timeout_s
        self.on_attempt = on_attempt
        self.metrics = metrics
        self._heap: list[tuple[float, int, Job, dict, bytes]] = []
        self._seq = 0
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="h3serve-webhooks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def for_job(self, url: str | None, owner: str | None) -> dict | None:
        """The job's webhook state for the URL it gave (or the deployment's), checked now; RequestError naming
        webhook_url when it cannot be sent."""
        url = url or self.default_url
        if url is None:
            return None
        try:
            self.policy.check(url)
        except WebhookRefused as exc:
            raise RequestError("webhook_url", url if isinstance(url, str) else repr(url)[:60], str(exc)) from None
        if self.secrets.secret(owner) is None:
            raise RequestError("webhook_url", url, f"no webhook secret for caller {owner or DEFAULT_CALLER!r} in the "
                                                   "deployment's --webhook-secrets-file")
        return {"url": url, "state": "pending", "event_id": None, "deliveries": []}

    def enqueue(self, job: "Job") -> None:
        """A concluded HTTP job with a webhook: its event goes out now (then retried)."""
        if not job.webhook or job.webhook["state"] != "pending" or job.status not in EVENT_TYPES:
            return
        ev = event(job)
        job.webhook["event_id"] = ev["id"]
        self._push(time.monotonic(), job, ev, json.dumps(ev, separators=(",", ":")).encode())

    def _push(self, due: float, job: "Job", ev: dict, body: bytes) -> None:
        with self._cond:
            self._seq += 1
            heapq.heappush(self._heap, (due, self._seq, job, ev, body))
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic()))
                if self._stop:
                    return
                _, _, job, ev, body = heapq.heappop(self._heap)
            try:
                self._attempt(job, ev, body)
            except Exception:   # noqa: BLE001 - one bad delivery never stops the others
                log.exception("webhook of request %s", job.id)

    def _attempt(self, job: "Job", ev: dict, body: bytes) -> None:
        hook = job.webhook
        n = len(hook["deliveries"]) + 1
        t0 = time.monotonic()
        status, error = None, None
        try:
            target = self.policy.check(hook["url"])
            secret = self.secrets.secret(job.owner)
            if secret is None:
                raise WebhookRefused(f"no webhook secret for caller {job.owner or DEFAULT_CALLER!r}")
            status = post(target, body, self._headers(secret, ev, body), self.timeout_s)
        except (WebhookRefused, OSError, http.client.HTTPException, ssl.SSLError) as exc:
            error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, WebhookRefused) else f"refused: {exc}"
        ok = status is not None and 200 <= status < 300
        retry = not ok and (status is None or status >= 500 or status in RETRY_STATUS) and n < self.attempts
        hook["deliveries"] = (hook["deliveries"] + [{"attempt": n, "at": round(time.time(), 3), "status": status,
                                                      "error": error, "seconds": round(time.monotonic() - t0, 3)}]
                              )[-MAX_LOG:]
        hook["attempts"] = n
        hook["state"] = "delivered" if ok else "pending" if retry else "failed"
        if self.metrics is not None:
            self.metrics.webhooks.labels(outcome="delivered" if ok else "retried" if retry else "failed").inc()
        if not ok:
            log.warning("webhook of request %s, attempt %d/%d: %s", job.id, n, self.attempts,
                        error or f"HTTP {status}")
        self.on_attempt(job)
        if retry:   # full jitter: the receivers of many jobs are not hit in step
            delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (n - 1)) * random.uniform(0.5, 1.0)
            self._push(time.monotonic() + delay, job, ev, body)

    @staticmethod
    def _headers(secret: bytes, ev: dict, body: bytes) -> dict[str, str]:
        ts = int(time.time())
        return {"content-type": "application/json", "user-agent": "h3serve-webhooks",
                "webhook-id": ev["id"], "webhook-timestamp": str(ts), "webhook-signature": sign(secret, ev["id"], ts,
                                                                                                  body)}


class _Pinned(http.client.HTTPConnection):
    """A connection to the checked address, the URL's host in Host (and in TLS's SNI and certificate check)."""

    def __init__(self, target: Target, timeout: float):
        super().__init__(target.host, target.port, timeout=timeout)
        self.target = target

    def connect(self):
        self.sock = socket.create_connection((self.target.address, self.target.port), self.timeout)
        if self.target.scheme == "https":
            self.sock = ssl.create_default_context().wrap_socket(self.sock, server_hostname=self.target.host)


def post(target: Target, body: bytes, headers: dict[str, str], timeout: float) -> int:
    """POST the body; the response's status (its body read up to 64 KiB and dropped; redirects not followed)."""
    conn = _Pinned(target, timeout)
    try:
        conn.request("POST", target.path, body=body, headers=headers)
        resp = conn.getresponse()
        resp.read(64 << 10)
        return resp.status
    finally:
        conn.close()
