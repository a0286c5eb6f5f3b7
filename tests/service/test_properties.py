"""Property-based bad inputs over the HTTP and gRPC request fields: never a 5xx or a crash; every rejection is
400 / INVALID_ARGUMENT and names a field the caller sent (or the body / the required prompt)."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from h3serve.errortable import MD_CODE, MD_FIELD

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                 st.dictionaries(st.text(max_size=6), inner,
                                                                                 max_size=3)), max_leaves=6)
ints = st.one_of(st.integers(-100, 5000), st.integers(-2**40, 2**40))
numeric_text = st.sampled_from(["5", "4", "4.5", "15", "15.1", "3.99", "1e3", "-5", "", " 5 ", "five", "0x10", "nan",
                                "inf", "5.0", "124", "256", "320", "24", "2"])

HTTP_FIELDS = {
    "prompt": st.one_of(st.text(max_size=40), st.sampled_from(["a kite", "", " ", "x" * 20001]), json_values),
    "seconds": st.one_of(st.floats(-10, 30), st.integers(-10, 30), numeric_text, json_values),
    "size": st.one_of(st.sampled_from(["320x256", "256x256", "250x256", "8192x256", "1344x768", "2048x256", "x",
                                       "320X256", "320*256", "", "320x256x3"]), st.text(max_size=10), json_values),
    "width": st.one_of(ints, numeric_text, json_values),
    "height": st.one_of(ints, numeric_text, json_values),
    "num_frames": st.one_of(ints, numeric_text, json_values),
    "fps": st.one_of(st.just(24), ints, numeric_text, json_values),
    "seed": st.one_of(st.integers(-2**70, 2**70), numeric_text, json_values),
    "num_inference_steps": st.one_of(st.integers(-5, 2000), numeric_text, json_values),
    "quality": st.one_of(st.sampled_from(["lossless", "high", "LOSSLESS"]), json_values),
    "model": st.one_of(st.sampled_from(["MiniMax-H3", "h3", "FastH3", "sora-2"]), json_values),
    "extra_params": st.one_of(
        st.fixed_dictionaries({}, optional={
            "task": st.one_of(st.sampled_from(["t2va", "fl2va", "ref2va", "i2v", "T2VA"]), json_values),
            "duration": st.one_of(st.floats(-1, 20), numeric_text, json_values),
            "audio_flow_shift": json_values, "unknown_knob": json_values}),
        st.sampled_from(['{"task": "t2va"}', "{", "[]"]), json_values),
    "negative_prompt": json_values,
    "guidance_scale": json_values,
    "some_unknown_field": json_values,
}

VALID = {"prompt": "a kite over the sea", "size": "320x256", "seconds": 5, "num_inference_steps": 4}
# any mix of fields, or a valid request with one field changed (so that acceptance is exercised too)
http_bodies = st.one_of(
    st.fixed_dictionaries({}, optional=HTTP_FIELDS),
    st.sampled_from(sorted(HTTP_FIELDS)).flatmap(lambda k: HTTP_FIELDS[k].map(lambda v: {**VALID, k: v})))


def _allowed_fields(body: dict) -> set[str]:
    # a missing keyframe / reference (task fl2va / ref2va without one) names the field that would carry it
    names = set(body) | {"prompt", "body", "input_reference", "image_reference"}
    extra = body.get("extra_params")
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            extra = None
    if isinstance(extra, dict):
        names |= {f"extra_params.{k}" for k in extra}
    return names


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.http, timeout=30) as client:
        yield client


@SETTINGS
@given(body=http_bodies)
@example(body={"extra_params": {"task": []}})   # a wrong type named as sent: extra_params.task
@example(body={**VALID, "model": "FastH3", "quality": "high"})
def test_http_fields_never_5xx_and_rejections_name_the_field(http, body):
    r = http.post("/v1/videos", params={"validate_only": "true"}, json=body)
    event(f"HTTP {r.status_code}")
    assert r.status_code in (200, 400), (r.status_code, r.text)
    if r.status_code == 200:
        assert r.json()["status"] == "validated"
        return
    err = r.json()["error"]
    assert err["code"] == "invalid_request"
    assert err["field"] in _allowed_fields(body), (err, body)
    assert err["field"] in err["message"]


@SETTINGS
@given(raw=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode)),
       ctype=st.sampled_from(["application/json", "", "text/plain", "application/x-www-form-urlencoded"]))
@example(raw=b"=", ctype="application/x-www-form-urlencoded")  # a form field with an empty name
def test_http_raw_bodies_never_5xx(http, raw, ctype):
    headers = {"content-type": ctype} if ctype else {}
    r = http.post("/v1/videos", params={"validate_only": "true"}, content=raw, headers=headers)
    assert r.status_code in (200, 400), (r.status_code, r.text)
    if r.status_code == 400:
        err = r.json()["error"]
        assert err["field"] and err["field"] in err["message"]


GRPC_FIELDS = {
    "seconds": st.floats(allow_nan=True, allow_infinity=True),
    "size": st.one_of(st.sampled_from(["320x256", "250x256", "1344x768", "", "x"]), st.text(max_size=10)),
    "width": st.integers(-2**31, 2**31 - 1),
    "height": st.integers(-2**31, 2**31 - 1),
    "num_frames": st.integers(-2**31, 2**31 - 1),
    "fps": st.one_of(st.just(24), st.integers(-2**31, 2**31 - 1)),
    "seed": st.integers(-2**63, 2**63 - 1),
    "num_inference_steps": st.one_of(st.integers(0, 60), st.integers(-2**31, 2**31 - 1)),
    "task": st.one_of(st.sampled_from(["t2va", "fl2va", "ref2va", "x"]), st.text(max_size=8)),
    "quality": st.one_of(st.sampled_from(["lossless", "high"]), st.text(max_size=8)),
    "model": st.one_of(st.sampled_from(["MiniMax-H3", "sora"]), st.text(max_size=8)),
    "request_id": st.one_of(st.sampled_from(["abc", "a b", "x" * 65]), st.text(max_size=70)),
}


@pytest.fixture(scope="module")
def gateway_stub(stack):
    from h3serve._proto import gateway_pb2_grpc

    with grpc.insecure_channel(stack.grpc) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


grpc_fields = st.one_of(
    st.fixed_dictionaries({}, optional=GRPC_FIELDS),
    st.sampled_from(sorted(GRPC_FIELDS)).flatmap(
        lambda k: GRPC_FIELDS[k].map(lambda v: {"size": "320x256", "seconds": 5.0, "num_inference_steps": 4, k: v})))


@SETTINGS
@given(prompt=st.one_of(st.text(max_size=40), st.just("")), fields=grpc_fields)
def test_grpc_fields_never_crash_and_rejections_name_the_field(gateway_stub, prompt, fields):
    from h3serve._proto import gateway_pb2

    req = gateway_pb2.GenerateRequest(prompt=prompt, validate_only=True, **fields)
    try:
        events = list(gateway_stub.Generate(req, timeout=30))
    except grpc.RpcError as err:
        event(err.code().name)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details(), fields)
        md = dict(err.trailing_metadata() or ())
        assert md[MD_CODE] == "invalid_request"
        # a given field, or one the task requires (fl2va: a keyframe; ref2va: references)
        assert md[MD_FIELD] in set(fields) | {"prompt", "first_image", "references"}, (md, fields)
        assert md[MD_FIELD] in err.details()
        return
    event("OK")
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == ["accepted", "done"]
    acc = events[0].accepted
    assert acc.num_frames % 17 == 5 and acc.width % 32 == 0 and acc.height % 32 == 0
