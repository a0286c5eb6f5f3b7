"""The rest of the API surface: cancel by id (gRPC), the asyncio client cancelled by its task, HTTP job cancel /
content-before-ready / deletion of a running job, HTTP deadline header and query validation."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from h3serve.client import AsyncClient, Cancelled, Client, NotFound, Progress

from .conftest import REQUEST

LONG = dict(REQUEST, num_inference_steps=300)


def _dit_started(stack, timeout=30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = stack.status("dit")
        if st.current_request_id and st.work_units_total > 0:
            return
        time.sleep(0.05)
    raise TimeoutError("the DiT did not start")


def test_cancel_by_id_from_another_client(stack):
    with Client(stack.grpc, timeout=120) as a, Client(stack.grpc) as b:
        gen = a.stream(**dict(LONG, request_id="cancel-me"))
        for event in gen:
            if isinstance(event, Progress) and event.stage == "dit":
                break
        state = b.cancel("cancel-me")
        assert state.cancelled and state.status in ("queued", "in_progress"), state
        with pytest.raises(Cancelled):
            gen.result()
        again = b.cancel("cancel-me")   # idempotent: the request's end, not NotFound
        assert (again.cancelled, again.status, again.error_code) == (False, "failed", "cancelled"), again
        with pytest.raises(NotFound, match="no request 'never-sent'"):
            b.cancel("never-sent")
    st = stack.wait_idle("dit")
    assert st.last.request_id == "cancel-me" and st.last.outcome == "cancelled"
    assert st.last.units_done - st.last.units_at_signal <= 1


def test_asyncio_task_cancel_stops_the_request(stack):
    async def run():
        async with AsyncClient(stack.grpc, timeout=120) as client:
            started = asyncio.Event()

            async def on_progress(p):
                if p.stage == "dit":
                    started.set()

            task = asyncio.create_task(client.generate(on_progress=on_progress, **LONG))
            await asyncio.wait_for(started.wait(), 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(run())
    st = stack.wait_idle("dit")
    assert st.last.outcome == "cancelled", st.last
    assert st.last.units_done - st.last.units_at_signal <= 1


def test_http_cancel_content_before_ready_and_delete_running(stack):
    body = {"prompt": "a long one", "size": "320x256", "num_inference_steps": 300}
    with httpx.Client(base_url=stack.http, timeout=30) as http:
        job = http.post("/v1/videos", json=body).json()
        _dit_started(stack)
        r = http.get(f"/v1/videos/{job['id']}/content")
        assert r.status_code == 409 and r.json()["error"]["code"] == "not_ready"
        r = http.post(f"/v1/videos/{job['id']}/cancel")
        assert r.status_code == 200
        job = r.json()
        assert job["status"] == "failed" and job["error"]["code"] == "cancelled", job
        assert http.get(f"/v1/videos/{job['id']}/content").status_code == 409
        st = stack.wait_idle("dit")
        assert st.last.outcome == "cancelled" and st.last.units_done - st.last.units_at_signal <= 1
        assert http.delete(f"/v1/videos/{job['id']}").json()["deleted"] is True

        job = http.post("/v1/videos", json=body).json()     # DELETE of a running job cancels it
        _dit_started(stack)
        assert http.delete(f"/v1/videos/{job['id']}").status_code == 200
        st = stack.wait_idle("dit")
        assert st.last.outcome == "cancelled"
        assert http.get(f"/v1/videos/{job['id']}").status_code == 404


def test_http_deadline_header_and_query_validation(stack):
    with httpx.Client(base_url=stack.http, timeout=30) as http:
        r = http.post("/v1/videos", json={"prompt": "x"}, headers={"X-Request-Timeout": "soon"})
        assert r.status_code == 400 and r.json()["error"]["field"] == "X-Request-Timeout"
        r = http.get("/v1/videos", params={"limit": "many"})
        assert r.status_code == 400 and r.json()["error"]["field"] == "limit"
        r = http.get("/v1/videos", params={"limit": 0})   # no items; has_more says whether any
        assert r.status_code == 200 and r.json()["data"] == [], r.text
        r = http.get("/v1/videos", params={"limit": 101})
        assert r.status_code == 400 and r.json()["error"]["field"] == "limit"
        r = http.get("/v1/videos/video_nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        t0 = time.monotonic()
        r = http.post("/v1/videos/sync", json={**{k: v for k, v in LONG.items() if k != "size"},
                                               "size": "320x256"}, headers={"X-Request-Timeout": "2"})
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
        assert time.monotonic() - t0 < 4.0
    stack.wait_idle("dit")


def test_dit_refuses_a_conditioned_task_without_its_conditions(stack):
    """fl2va needs keyframe latents: without them, a clear error naming condition_kinds, not a t2va run."""
    import grpc

    from h3serve._proto import common_pb2, dit_pb2, dit_pb2_grpc

    params = dit_pb2.DiTParams(request_id="fl2va-direct", latent_frames=37, latent_height=8, latent_width=10,
                               audio_latents=207, seed=0, task="fl2va", profile="base", steps=4)
    inputs = [dit_pb2.DiTInput(params=params), dit_pb2.DiTInput(end=common_pb2.StreamEnd(tensors=0))]
    with grpc.insecure_channel(stack.addresses["dit"]) as ch:
        with pytest.raises(grpc.RpcError) as err:
            for _ in dit_pb2_grpc.DiTStub(ch).Generate(iter(inputs), timeout=30):
                pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "condition_kinds" in err.value.details() and "fl2va" in err.value.details()
