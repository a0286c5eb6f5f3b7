"""A real gateway process (`h3serve serve`, tiny checkpoint) with API keys, webhooks and an admin caller: the signed
event of a finished job reaches a real receiver, and the job's usage record is in the store, in /v1/usage (own only;
the admin sees all) and in the per-caller counters."""

from __future__ import annotations

import hashlib
import time

import httpx
import pytest

from h3serve.services.gateway.store import DiskStore, S3Store, usage_days

from .conftest import REQUEST, Stack, finished_job
from .s3server import S3Server
from .test_webhooks import SECRET, Receiver
from h3serve.services.gateway.webhooks import verify

KEYS = {"alice": "alice-key", "bob": "bob-key", "ops": "ops-key"}


@pytest.fixture(scope="module")
def gateway(tiny_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("usage")
    keys, secrets = tmp / "keys", tmp / "secrets"
    keys.write_text("".join(f"{n} sha256:{hashlib.sha256(k.encode()).hexdigest()}\n" for n, k in KEYS.items()))
    secrets.write_text(f"alice {SECRET}\n")
    rx = Receiver(statuses=(500,))
    stack = Stack(tiny_checkpoint, "--api-keys-file", str(keys), "--jobs-dir", str(tmp / "jobs"),
                  "--webhook-allow", "127.0.0.1/32", "--webhook-secrets-file", str(secrets),
                  "--webhook-backoff-s", "0.1", "--admin-callers", "ops",
                  "--caller-limits", '{"bob": {"video_seconds_per_hour": 6}}')
    clients = {n: httpx.Client(base_url=stack.http, timeout=60, headers={"Authorization": f"Bearer {k}"})
               for n, k in KEYS.items()}
    try:
        yield stack, clients, rx, tmp / "jobs"
    finally:
        for c in clients.values():
            c.close()
        rx.close()
        assert stack.stop() == 0


def test_a_finished_job_sends_its_signed_event_and_records_its_usage(gateway):
    stack, c, rx, jobs_dir = gateway
    alice = c["alice"]
    r = alice.post("/v1/videos", json={**REQUEST, "webhook_url": "http://169.254.169.254/latest"})
    err = r.json()["error"]   # the invalid-request status of the dialect (docs/openai-compat.md)
    assert err["code"] == "invalid_request" and 400 <= r.status_code < 500, r.text
    assert err["param"] == "webhook_url" and "169.254.169.254" in err["message"]
    r = c["bob"].post("/v1/videos", json={**REQUEST, "webhook_url": rx.url})   # bob has no webhook secret
    assert r.status_code < 500 and "no webhook secret for caller 'bob'" in r.json()["error"]["message"], r.text

    video = alice.post("/v1/videos", json={**REQUEST, "webhook_url": rx.url}).json()
    assert video["webhook"]["url"] == rx.url and video["webhook"]["state"] == "pending"
    got = finished_job(alice, video["id"])
    assert got["status"] == "completed"
    rx.wait(2, timeout=30)
    ev = verify(SECRET, rx.got[1][0], rx.got[1][1])
    assert ev["type"] == "video.completed" and ev["data"]["id"] == video["id"]
    assert ev["data"]["sha256"] == got["sha256"] and ev["data"]["mp4_bytes"] == got["mp4_bytes"]
    end = time.monotonic() + 10
    while got["webhook"]["state"] != "delivered" and time.monotonic() < end:
        time.sleep(0.05)
        got = alice.get(f"/v1/videos/{video['id']}").json()
    assert [d["status"] for d in got["webhook"]["deliveries"]] == [500, 200]

    usage = alice.get("/v1/usage").json()
    (rec,) = usage["data"]
    assert (rec["id"], rec["caller"], rec["task"], rec["status"]) == (video["id"], "alice", "t2va", "completed")
    assert rec["frames"] == got["num_frames"] == 124 and rec["video_seconds"] == pytest.approx(124 / 24)
    assert all(rec["stage_seconds"][s] > 0 for s in ("encoder", "dit", "vae")), rec["stage_seconds"]
    assert rec["gpu_seconds_total"] == 0.0   # the CPU: seconds, but no GPU occupied
    assert usage["totals"]["jobs"] == 1 and usage["totals"]["video_seconds"] == rec["video_seconds"]
    # the job deleted: its usage stays (what the caller is billed by)
    assert alice.delete(f"/v1/videos/{video['id']}").status_code == 200
    assert alice.get("/v1/usage").json()["data"] == [rec]
    metrics = alice.get("/metrics").text
    assert 'h3serve_webhook_deliveries_total{outcome="delivered"} 1.0' in metrics
    assert 'h3serve_usage_jobs_total{caller="alice",outcome="completed"} 1.0' in metrics
    assert f'h3serve_usage_video_seconds_total{{caller="alice",model="{video["model"]}"}} {round(124 / 24, 6)}' in metrics


def test_usage_is_the_callers_own_and_the_admins_all(gateway):
    stack, c, rx, _ = gateway
    bob = c["bob"]
    job = bob.post("/v1/videos", json=REQUEST).json()
    bob.post(f"/v1/videos/{job['id']}/cancel")
    finished_job(bob, job["id"])
    r = bob.post("/v1/videos", json=REQUEST)   # 5.17 s more would pass bob's 6 s an hour
    assert r.status_code == 429 and r.json()["error"]["code"] == "quota_exceeded", r.text
    assert r.json()["error"]["param"] == "video_seconds_per_hour" and 3500 <= int(r.headers["retry-after"]) <= 3600
    own = bob.get("/v1/usage").json()
    assert [r["id"] for r in own["data"]] == [job["id"]] and own["data"][0]["caller"] == "bob"
    assert own["data"][0]["video_seconds"] == 0.0 and own["totals"]["completed"] in (0, 1)
    r = bob.get("/v1/usage", params={"caller": "alice"})
    assert r.status_code == 403 and "its own usage only" in r.json()["error"]["message"]
    everyone = c["ops"].get("/v1/usage").json()
    assert {r["caller"] for r in everyone["data"]} >= {"alice", "bob"} and everyone["caller"] is None
    only_alice = c["ops"].get("/v1/usage", params={"caller": "alice"}).json()
    assert {r["caller"] for r in only_alice["data"]} == {"alice"}
    past = c["ops"].get("/v1/usage", params={"from": "2026-01-01T00:00:00Z", "to": "2026-01-02"}).json()
    assert past["data"] == [] and past["totals"]["jobs"] == 0
    for params, field in (({"from": "yesterday"}, "from"), ({"from": 0, "to": 10 ** 9}, "from")):
        r = c["ops"].get("/v1/usage", params=params)
        assert r.status_code < 500 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("kind", ["disk", "s3"])
def test_usage_records_are_read_by_caller_and_time_range(kind, tmp_path):
    s3 = S3Server(tmp_path / "s3") if kind == "s3" else None
    store = (S3Store("s3://h3serve-jobs/u", str(tmp_path / "spool"), env=s3.env) if s3 is not None
             else DiskStore(str(tmp_path / "jobs")))
    try:
        day = 86400.0
        t0 = 1_764_547_200.0   # 2025-12-01T00:00:00Z
        recs = [{"id": f"video_{i}", "caller": caller, "completed_at": t0 + i * day / 2, "video_seconds": 5.0}
                for i, caller in enumerate(["alice", "bob", "alice", None, "alice"])]
        for r in recs:
            store.put_usage(r)
        assert [r["id"] for r in store.usage("alice", t0, t0 + 2 * day)] == ["video_0", "video_2", "video_4"]
        assert [r["id"] for r in store.usage("alice", t0 + 1, t0 + day)] == ["video_2"]
        assert [r["id"] for r in store.usage(None, t0, t0 + 2 * day)] == ["video_3"]
        assert sorted(r["id"] for r in store.usage(None, t0, t0 + 2 * day, everyone=True)) == [
            f"video_{i}" for i in range(5)]
        assert usage_days(t0 - 1, t0 + day) == ["2025-11-30", "2025-12-01", "2025-12-02"]
    finally:
        store.close()
        if s3 is not None:
            s3.close()


def test_n_outputs_have_consecutive_seeds_one_encode_and_each_equals_its_single_request(gateway):
    stack, c, _, _ = gateway
    ops = c["ops"]
    encodes = stack.status("encoder").requests_total
    t0 = time.monotonic()
    video = ops.post("/v1/videos", json={**REQUEST, "seed": 7, "n": 3}).json()
    got = finished_job(ops, video["id"])
    t_three = time.monotonic() - t0
    assert got["status"] == "completed" and got["n"] == 3, got.get("error", got)
    assert stack.status("encoder").requests_total == encodes + 1   # the prompt encoded once for the three
    assert [(o["index"], o["seed"]) for o in got["outputs"]] == [(0, 7), (1, 8), (2, 9)]
    mp4s = [ops.get(f"/v1/videos/{video['id']}/content", params={"variant": i}).content for i in range(3)]
    assert [hashlib.sha256(m).hexdigest() for m in mp4s] == [o["sha256"] for o in got["outputs"]]
    assert mp4s[0] == ops.get(f"/v1/videos/{video['id']}/content").content and len(set(mp4s)) == 3
    t0 = time.monotonic()
    single = ops.post("/v1/videos", json={**REQUEST, "seed": 8}).json()
    assert finished_job(ops, single["id"])["status"] == "completed"
    t_one = time.monotonic() - t0
    assert ops.get(f"/v1/videos/{single['id']}/content").content == mp4s[1]   # output 1 = the request of seed 8
    print("FIGURES", got["stage_durations"], {"n3_s": round(t_three, 3), "n1_s": round(t_one, 3),
                      "videos_per_s_gain": round(3 * t_one / t_three, 3)})
    r = ops.get(f"/v1/videos/{video['id']}/content", params={"variant": 3})
    assert r.status_code < 500 and r.json()["error"]["param"] == "variant" and "[0, 2]" in r.text
    for bad in (0, 11, "x", 2.5):
        r = ops.post("/v1/videos", json={**REQUEST, "n": bad})
        assert r.status_code < 500 and r.json()["error"]["param"] == "n" and "[1, 10]" in r.text, r.text
    r = ops.post("/v1/videos/sync", json={**REQUEST, "n": 2})
    assert r.status_code < 500 and "POST /v1/videos makes several" in r.text
    rec = next(r for r in ops.get("/v1/usage", params={"caller": "ops"}).json()["data"] if r["id"] == video["id"])
    assert rec["outputs"] == 3 and rec["frames"] == 3 * 124
    assert ops.delete(f"/v1/videos/{video['id']}").status_code == 200
    assert not list((gateway[3] / "videos").glob(f"{video['id']}*"))   # every output's MP4 went with the job
