"""Webhooks (webhooks.py): where a URL may point (no internal addresses unless listed), the Standard Webhooks
signature, retries with backoff and the delivery log, against a real receiver (an HTTP server on loopback) and a
real gateway process."""

from __future__ import annotations

import base64
import http.server
import threading
import time

import pytest

from h3serve.config.request import validate_request
from h3serve.config.stage import StageConfig
from h3serve.errors import H3Error, RequestError
from h3serve.services.gateway.fields import Validated
from h3serve.services.gateway.jobs import JobTable
from h3serve.services.gateway.metrics import GatewayMetrics
from h3serve.services.gateway.webhooks import Policy, WebhookRefused, Webhooks, parse_secrets, sign, verify

SECRET = "whsec_" + base64.b64encode(b"sixteen-byte-key-of-alice").decode()
PUBLIC = "93.184.215.14"


class Receiver:
    """A webhook receiver on loopback: answers each POST with the next of `statuses` (then 200), keeps them all."""

    def __init__(self, statuses=()):
        self.statuses = list(statuses)
        self.got: list[tuple[dict, bytes, float]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                outer.got.append(({k.lower(): v for k, v in self.headers.items()}, body, time.monotonic()))
                self.send_response(outer.statuses.pop(0) if outer.statuses else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/h3?tenant=a"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, n: int, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while len(self.got) < n and time.monotonic() < end:
            time.sleep(0.02)
        assert len(self.got) >= n, f"{len(self.got)} of {n} deliveries within {timeout}s"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


# -- where a URL may point ------------------------------------------------------------------------------------

def _policy(allow, table=None):
    table = table or {"hooks.example.com": [PUBLIC], "internal.example.com": ["10.1.2.3"],
                      "rebind.example.com": [PUBLIC, "127.0.0.1"], "metadata.example.com": ["169.254.169.254"]}
    return Policy(allow, resolve=lambda host, port: table[host])


@pytest.mark.parametrize("url, why", [
    ("http://127.0.0.1:9/x", "not inside a listed network"),
    ("http://169.254.169.254/latest/meta-data", "not inside a listed network"),
    ("http://[::ffff:127.0.0.1]/x", "not inside a listed network"),
    ("http://[::1]/x", "not inside a listed network"),
    ("https://internal.example.com/x", "not a public address"),
    ("https://rebind.example.com/x", "resolves to 127.0.0.1"),
    ("https://metadata.example.com/x", "resolves to 169.254.169.254"),
    ("https://other.example.org/x", "not in this deployment's --webhook-allow"),
    ("file:///etc/passwd", "http(s) URL"),
    ("gopher://hooks.example.com/x", "http(s) URL"),
    ("https://user:pw@hooks.example.com/x", "without user:password"),
    ("https://hooks.example.com:99999/x", "not a URL"),
    ("https:///x", "with a host"),
    (42, "http(s) URL"),
])
def test_internal_and_unlisted_targets_are_refused(url, why):
    policy = _policy("hooks.example.com, *.example.com")
    with pytest.raises(WebhookRefused, match=why.replace("(", r"\(").replace(")", r"\)")):
        policy.check(url)


def test_listed_hosts_and_networks_are_accepted_and_pinned():
    policy = _policy("*.example.com,10.1.0.0/16")
    t = policy.check("https://hooks.example.com/a/b?c=1")
    assert (t.scheme, t.host, t.port, t.path, t.address) == ("https", "hooks.example.com", 443, "/a/b?c=1", PUBLIC)
    assert policy.check("https://internal.example.com/x").address == "10.1.2.3"   # inside the listed network
    assert policy.check("http://10.1.9.9:8080/").port == 8080
    with pytest.raises(WebhookRefused, match="sends no webhooks"):
        Policy(None).check("https://hooks.example.com/")
    with pytest.raises(H3Error, match="--webhook-allow"):
        Policy("hooks.example.com,not a host!")


def test_signature_is_standard_webhooks_and_tampering_is_caught():
    key = base64.b64decode(SECRET.removeprefix("whsec_"))
    body = b'{"type":"video.completed"}'
    ts = int(time.time())
    headers = {"webhook-id": "evt_1", "webhook-timestamp": str(ts), "webhook-signature": sign(key, "evt_1", ts, body)}
    assert verify(SECRET, headers, body) == {"type": "video.completed"}
    with pytest.raises(ValueError, match="no webhook-signature"):
        verify(SECRET, headers, body.replace(b"completed", b"failed"))
    with pytest.raises(ValueError, match="no webhook-signature"):
        verify(SECRET, {**headers, "webhook-id": "evt_2"}, body)
    old = ts - 3600
    with pytest.raises(ValueError, match="more than 300s"):
        verify(SECRET, {**headers, "webhook-timestamp": str(old), "webhook-signature": sign(key, "evt_1", old, body)},
               body)
    with pytest.raises(H3Error, match="line 2|:2:"):
        parse_secrets(f"alice {SECRET}\nbob sha256:abc\n", "secrets")


# -- deliveries from a job table --------------------------------------------------------------------------------

@pytest.fixture
def hooks(tmp_path):
    secrets = tmp_path / "secrets"
    secrets.write_text(f"# caller  secret\nalice {SECRET}\n")
    config = StageConfig.from_knobs(jobs_dir=str(tmp_path / "jobs"), webhook_allow="127.0.0.1/32",
                                    webhook_secrets_file=str(secrets), webhook_backoff_s=0.05, webhook_attempts=4,
                                    webhook_timeout_s=2.0)
    metrics = GatewayMetrics()
    table = JobTable(config, metrics)
    table.store.beat(table.instance, table.boot)
    webhooks = Webhooks(config, on_attempt=table.save_webhook, metrics=metrics)
    table.on_concluded = webhooks.enqueue
    webhooks.start()
    yield table, webhooks
    webhooks.close()
    table.close()


def _finished(table: JobTable, webhooks: Webhooks, url: str, exc=None):
    v = Validated(validate_request(prompt="p", seconds=5, width=320, height=256, steps=4), {}, "MiniMax-H3")
    job = table.new(v, kind="http", owner="alice")
    job.webhook = webhooks.for_job(url, "alice")
    table.admit(job, {})
    assert table.take() is job
    if exc is None:
        with open(table.mp4_path(job), "wb") as f:
            f.write(b"mp4")
    table.finish(job, exc)
    return job


def _wait_state(table, job, state, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rec = table.store.get_record(job.id)
        if rec and rec["webhook"]["state"] == state:
            return rec
        time.sleep(0.02)
    raise AssertionError(f"webhook of {job.id} not {state}: {table.store.get_record(job.id)['webhook']}")


def test_a_refused_delivery_is_retried_with_backoff_and_logged(hooks):
    table, webhooks = hooks
    rx = Receiver(statuses=(503, 429))
    try:
        job = _finished(table, webhooks, rx.url)
        rec = _wait_state(table, job, "delivered")
        assert [d["status"] for d in rec["webhook"]["deliveries"]] == [503, 429, 200]
        assert len(rx.got) == 3
        ids = {h["webhook-id"] for h, _, _ in rx.got}
        assert ids == {rec["webhook"]["event_id"]}   # one event, retried: the receiver drops repeats by id
        gaps = [b[2] - a[2] for a, b in zip(rx.got, rx.got[1:])]
        assert gaps[0] >= 0.025 and gaps[1] >= 0.05, gaps   # jittered: at least half of 0.05 s, then of 0.1 s
        for headers, body, _ in rx.got:
            ev = verify(SECRET, headers, body)
            assert ev["type"] == "video.completed" and ev["data"]["id"] == job.id
            assert ev["data"]["status"] == "completed" and ev["data"]["model"] == "MiniMax-H3"
        assert table.metrics.webhooks.labels(outcome="retried")._value.get() == 2
        assert table.metrics.webhooks.labels(outcome="delivered")._value.get() == 1
    finally:
        rx.close()


def test_a_failed_job_is_sent_and_a_4xx_or_a_dead_receiver_ends_the_deliveries(hooks):
    table, webhooks = hooks
    rx = Receiver(statuses=(410,))
    try:
        job = _finished(table, webhooks, rx.url, exc=RequestError("seconds", 99, "4.5..14.375"))
        rec = _wait_state(table, job, "failed")
        assert [d["status"] for d in rec["webhook"]["deliveries"]] == [410]   # the receiver said no: not retried
        ev = verify(SECRET, rx.got[0][0], rx.got[0][1])
        assert ev["type"] == "video.failed" and ev["data"]["error"]["param"] == "seconds"
    finally:
        rx.close()
    dead = rx.url   # nobody listens there now
    job = _finished(table, webhooks, dead)
    rec = _wait_state(table, job, "failed")
    log = rec["webhook"]["deliveries"]
    assert [d["attempt"] for d in log] == [1, 2, 3, 4] and all(d["status"] is None for d in log)
    assert "ConnectionRefusedError" in log[-1]["error"]


def test_submit_refuses_what_cannot_be_sent(hooks):
    _, webhooks = hooks
    with pytest.raises(RequestError, match="webhook_url.*not inside a listed network"):
        webhooks.for_job("http://10.0.0.1/x", "alice")
    with pytest.raises(RequestError, match="no webhook secret for caller 'bob'"):
        webhooks.for_job("http://127.0.0.1:9/x", "bob")
    assert webhooks.for_job(None, "alice") is None


def test_a_deleted_job_is_not_written_back_by_its_deliveries(hooks):
    table, webhooks = hooks
    rx = Receiver(statuses=(503, 503, 503))
    try:
        job = _finished(table, webhooks, rx.url)
        rx.wait(1)
        table.delete(job.id, owner="alice")
        rx.wait(3)
        time.sleep(0.3)
        assert table.store.get_record(job.id) is None
    finally:
        rx.close()
