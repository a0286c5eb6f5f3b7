"""Schemathesis against the running gateway's own /openapi.json (bounded, seeded, derandomized): every operation
the document declares is called with generated inputs that fit its schema and inputs that do not; no answer is a
5xx, and an answer whose status the document declares matches the declared schema and content type.

Generations are kept out: a POST /v1/videos is sent with `validate_only=true` (it validates and aligns every field
as a real submit does, then stops), and of the bodies that would pass validation on /v1/videos/sync (probed with
validate_only, which parses and validates them as sync does) none is sent to it; one real generation, the
canonical small request, goes through /v1/videos/sync and its MP4 is checked against the document too."""

from __future__ import annotations

import json
import os
import time

from .conftest import REQUEST

MAX_EXAMPLES = int(os.environ.get("H3SERVE_OPENAPI_FUZZ_N", "50"))   # per operation and mode; raise for more


def _wait_idle(base_url: str, timeout: float = 120.0) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ready = httpx.get(f"{base_url}/ready", timeout=10).json()
        if ready["inflight"] == 0 and ready["queue_depth"] == 0:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the gateway still has jobs after {timeout}s: {ready}")


def test_openapi_operations_get_no_5xx_and_match_their_schema(stack):
    import httpx
    import schemathesis
    from hypothesis import HealthCheck, given, seed, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
    )

    checks = [not_a_server_error, response_schema_conformance, content_type_conformance]
    schema = schemathesis.openapi.from_url(f"{stack.http}/openapi.json", timeout=30)
    operations = [r.ok() for r in schema.get_all_operations()]
    validate = schema["/v1/videos"]["POST"]
    tally = {"requests": 0, "status_counts": {}}
    failures, no_negative = [], []

    def send(case, timeout=120.0):
        response = case.call(base_url=stack.http, timeout=timeout)
        tally["requests"] += 1
        tally["status_counts"][response.status_code] = tally["status_counts"].get(response.status_code, 0) + 1
        case.validate_response(response, checks=checks)
        return response

    t0 = time.monotonic()
    for op in operations:
        key = (op.method.upper(), op.path)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @seed(15)
            @settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                key = (case.operation.method.upper(), case.operation.path)
                if key == ("POST", "/v1/videos"):
                    case.query = {**(case.query or {}), "validate_only": "true"}   # malformed inputs are the point
                if key == ("POST", "/v1/videos/sync"):
                    probe = validate.Case(body=case.body, media_type=case.media_type, headers=case.headers,
                                          query={"validate_only": "true"})
                    if send(probe).status_code == 200:   # it would start a generation: checked by the probe
                        return
                send(case)

            try:
                run()
            except Unsatisfiable:
                if mode is GenerationMode.POSITIVE:
                    raise
                no_negative.append(f"{key[0]} {key[1]}")   # nothing to negate: a string path parameter or none
            except (Exception, BaseExceptionGroup) as exc:   # noqa: BLE001 - all are reported below
                failures.append(f"{key} {mode.value}: {type(exc).__name__}: {str(exc)[:1500]}")

    # one real generation through /v1/videos/sync: the canonical small request; its MP4 matches the document
    _wait_idle(stack.http)   # queue size 1: a job an earlier test left running would make it a 429
    mp4 = send(schema["/v1/videos/sync"]["POST"].Case(body=dict(REQUEST), media_type="application/json"), 300)
    assert mp4.status_code == 200 and mp4.content[4:8] == b"ftyp"

    with httpx.Client(base_url=stack.http, timeout=30) as http:   # leave the shared stack idle
        for job in http.get("/v1/videos?limit=100").json()["data"]:
            http.delete(f"/v1/videos/{job['id']}")
    elapsed = round(time.monotonic() - t0, 1)
    n5xx = sum(v for k, v in tally["status_counts"].items() if k >= 500)
    print("FIGURES", json.dumps({"operations": len(operations), "examples_per_operation_and_mode": MAX_EXAMPLES,
                                 "requests": tally["requests"], "5xx": n5xx, "seconds": elapsed,
                                 "operations_without_negative_inputs": len(no_negative),
                                 "status_counts": dict(sorted(tally["status_counts"].items()))}))
    assert not failures, "\n\n".join(failures)
    assert n5xx == 0 and len(operations) >= 10
