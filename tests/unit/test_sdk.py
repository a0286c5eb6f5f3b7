"""The SDK's own contract, no gateway needed: a light import, the typed request made from the request table, the two
clients' equal method sets, the retry policy, the oversize check (against a real gRPC server's own refusal too)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
import tomllib
from concurrent import futures
from pathlib import Path

import grpc
import pytest

import h3serve
from h3serve._proto import gateway_pb2
from h3serve.client import (AsyncClient, AsyncGeneration, Client, Generation, QueueFull, Retry, StageUnavailable,
                            TooLarge, VideoRequest, build_request)
from h3serve.client import _request, _retryable
from h3serve.config.request import REQUEST_FIELDS
from h3serve.errortable import from_grpc

REPO = Path(__file__).resolve().parents[2]


def test_import_loads_no_torch_and_is_fast():
    code = ("import sys, time; t = time.perf_counter(); import h3serve.client; dt = time.perf_counter() - t; "
            "import json; print(json.dumps({'s': dt, 'heavy': sorted(m for m in ('torch', 'numpy', 'av', "
            "'h3serve.models', 'h3serve.runtime', 'h3serve.pipeline', 'diffusers', 'transformers') "
            "if m in sys.modules)}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    report = json.loads(out.stdout)
    assert report["heavy"] == [], report
    assert report["s"] < 2.0, report   # ~0.3 s here; torch alone takes longer than this bound
    print("FIGURES", {"import_h3serve_client_s": round(report["s"], 3)})


def test_video_request_is_the_request_table_as_grpc_carries_it():
    proto = [fd.name for fd in gateway_pb2.GenerateRequest.DESCRIPTOR.fields if fd.name != "validate_only"]
    rows = {row.metadata["json"]: row for row in REQUEST_FIELDS}
    fields = {f.name: f for f in dataclasses.fields(VideoRequest)}
    assert sorted(fields) == sorted(proto)   # every GenerateRequest field, each a row of the one table
    for name, f in fields.items():
        assert f.metadata["doc"] == rows[name].metadata["doc"]
        assert (f.default is dataclasses.MISSING) == rows[name].metadata["required"]
    assert "steps" not in fields and "prompt" in inspect.signature(VideoRequest).parameters
    assert "num_inference_steps (int | None): Sigma grid points" in VideoRequest.__doc__


def test_keywords_and_a_video_request_make_the_same_message():
    typed = build_request(_request(VideoRequest(prompt="a kite", seconds=5, size="320x256"), {"seed": 3}))
    keywords = build_request(_request("a kite", {"seconds": 5, "size": "320x256", "seed": 3}))
    assert typed == keywords and typed.seed == 3
    assert build_request(_request("a kite", {"steps": 4})).num_inference_steps == 4   # the CLI's name
    with pytest.raises(TypeError, match=r"unknown request fields \['sizes'\]; allowed: prompt, seconds, size"):
        _request("a kite", {"sizes": "320x256"})
    with pytest.raises(TypeError, match="give the prompt once"):
        _request("a kite", {"prompt": "another"})


def test_an_oversize_request_is_too_large_before_sending():
    req = VideoRequest(prompt="x", first_image=bytes(2048))
    assert build_request(req, max_bytes=4096).first_image == bytes(2048)
    with pytest.raises(TooLarge, match=r"^the request is 20\d\d bytes \(0\.0 MiB\), more than the gRPC message limit "
                                       r"of 1024 bytes") as info:
        build_request(req, max_bytes=1024)
    assert not _retryable(info.value)


def test_grpcs_own_size_refusal_is_too_large_not_queue_full():
    """A real server whose limit is 1 KiB, sent 4 KiB: gRPC's RESOURCE_EXHAUSTED names sizes, not a queue."""
    handler = grpc.method_handlers_generic_handler("t.T", {"M": grpc.unary_unary_rpc_method_handler(
        lambda req, ctx: b"ok", request_deserializer=None, response_serializer=None)})
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler],
                         options=[("grpc.max_receive_message_length", 1024)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.T/M")
            assert call(b"small", timeout=5) == b"ok"
            with pytest.raises(grpc.RpcError) as info:
                call(bytes(4096), timeout=5)
    finally:
        server.stop(0)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    err = from_grpc(info.value, stage="gateway")
    assert isinstance(err, TooLarge) and not _retryable(err), err
    assert "is 4096 bytes" in str(err) and "limit of 1024 bytes" in str(err)
    assert _retryable(QueueFull("queue full")) and _retryable(StageUnavailable("dit"))


def test_both_clients_have_the_same_methods_arguments_and_docs():
    def public(cls):
        return {n: m for n, m in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}

    sync, aio = public(Client), public(AsyncClient)
    assert sorted(sync) == sorted(aio)
    assert {"generate", "stream", "attach", "generate_sync", "validate", "cancel", "info", "wait_ready"} <= set(sync)
    for name in sync:
        a, b = inspect.signature(sync[name]), inspect.signature(aio[name])
        assert [(p.name, p.kind, p.default) for p in a.parameters.values()] == \
            [(p.name, p.kind, p.default) for p in b.parameters.values()], name
        assert sync[name].__doc__ and aio[name].__doc__, name
        assert inspect.iscoroutinefunction(aio[name]) == (name not in ("stream", "attach", "stream_content")), name   # streams: iterables
    assert inspect.signature(Client).parameters.keys() == inspect.signature(AsyncClient).parameters.keys()
    assert sorted(public(Generation)) == sorted(public(AsyncGeneration))


def test_retry_backoff_is_jittered_exponential_and_bounded():
    r = Retry(attempts=4, initial_backoff_s=1.0, max_backoff_s=3.0, multiplier=2.0, deadline_s=None)
    for attempt, cap in ((0, 1.0), (1, 2.0), (2, 3.0), (5, 3.0)):
        waits = [r.backoff(attempt) for _ in range(200)]
        assert 0.0 <= min(waits) and max(waits) <= cap and len(set(waits)) > 100   # jittered over [0, cap]
        assert max(waits) > 0.8 * cap
    import time
    now = time.monotonic()
    assert r.allows(2, now, None) is not None and r.allows(3, now, None) is None   # 4 tries in all
    assert Retry(deadline_s=0.0).allows(0, now - 1, None) is None                # past its deadline
    assert Retry().allows(0, now, now + 0.0) is None                             # past the call's timeout
    assert Retry(attempts=1).allows(0, now, None) is None


def test_py_typed_ships():
    assert (Path(h3serve.__file__).parent / "py.typed").is_file()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["h3serve"]


def test_cli_refuses_a_task_that_contradicts_the_keyframes_and_model_without_server(tmp_path, capsys):
    from h3serve.cli import main

    first = tmp_path / "first.png"
    first.write_bytes(b"not read: refused before")
    out = str(tmp_path / "x.mp4")
    assert main(["generate", "--server", "127.0.0.1:1", "--prompt", "x", "--task", "t2va", "--first-image",
                 str(first), "-o", out]) != 0
    assert "--first-image: keyframes are task fl2va's (they imply it), but --task is t2va" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x", "--model", "fasth3", "-o", out]) != 0
    assert "--model fasth3: selects a pool of a gateway (with --server)" in capsys.readouterr().err
