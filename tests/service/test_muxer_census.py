"""A census of bad direct calls to a real muxer process: every field of every muxer RPC (protos/h3serve/v1/
muxer.proto and the TensorChunk / StreamEnd it carries) given an out-of-range, wrong-type or missing value. Each is
answered INVALID_ARGUMENT naming the field in `h3serve-field` (NOT_FOUND for a session it does not hold), never
INTERNAL, UNKNOWN or a retryable UNAVAILABLE; the muxer serves a good session afterwards."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Callable

import grpc
import numpy as np
import pytest

from h3serve._proto import common_pb2, muxer_pb2, muxer_pb2_grpc
from h3serve.errors import StageFailed
from h3serve.transport.control import peer_error

from .conftest import LoneStage

W, H, RATE = 64, 64, 32000
GOOD_OPEN = dict(request_id="census", width=W, height=H, fps=24, sample_rate=RATE, channels=2, ttl_s=60)
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


@pytest.fixture(scope="module")
def muxer():
    mux = LoneStage("muxer", env={})
    yield mux
    mux.stop()


def chunk(name: str, array: np.ndarray | None = None, **override) -> muxer_pb2.PushMessage:
    """One PushMessage carrying `array` whole as one chunk, with any TensorChunk field overridden."""
    fields: dict[str, Any] = dict(name=name, last=True)
    if array is not None:
        data = np.ascontiguousarray(array).tobytes()
        fields.update(dtype=str(array.dtype), shape=list(array.shape), offset=0, total_bytes=len(data), data=data)
    fields.update(override)
    return muxer_pb2.PushMessage(chunk=common_pb2.TensorChunk(**fields))


def frames(n: int = 2, h: int = H, w: int = W, c: int = 3, dtype=np.uint8) -> np.ndarray:
    return np.full((n, h, w, c), 128, dtype)


def pcm(channels: int = 2, n: int = 2048, dtype=np.float32, value: float = 0.0) -> np.ndarray:
    return np.full((channels, n), value, dtype)


def end(tensors: int) -> muxer_pb2.PushMessage:
    return muxer_pb2.PushMessage(end=common_pb2.StreamEnd(tensors=tensors))


@dataclass
class Case:
    name: str
    field: str | None             # the field the answer must name (None: NOT_FOUND, no field)
    call: Callable[[Any, str], Any]   # (stub, a fresh open session id) -> the call's result
    code: grpc.StatusCode = INVALID


def open_case(name: str, field: str, **bad) -> Case:
    return Case(name, field, lambda stub, _sid: stub.OpenSession(
        muxer_pb2.OpenSessionRequest(**{**GOOD_OPEN, **bad}), timeout=10))


def push_case(name: str, field: str | None, body: Callable[[str], list], code=INVALID) -> Case:
    return Case(name, field, lambda stub, sid: stub.Push(iter(body(sid)), timeout=30), code)


def opened(sid: str, **kw) -> muxer_pb2.PushMessage:
    return muxer_pb2.PushMessage(open=muxer_pb2.PushOpen(session_id=sid, **kw))


def raw(method: str, payload: bytes) -> Callable[[Any, str], Any]:
    """A unary call whose request bytes are `payload` as given (a wrong wire type, a truncated message)."""
    def call(stub, _sid):
        fn = stub._channel.unary_unary(f"/h3serve.v1.Muxer/{method}", request_serializer=None,
                                       response_deserializer=None)
        return fn(payload, timeout=10)
    return call


def raw_push(stub, sid):
    """A Push whose second message's bytes are cut short (a chunk announced 255 bytes long, 1 sent)."""
    fn = stub._channel.stream_unary("/h3serve.v1.Muxer/Push", request_serializer=None, response_deserializer=None)
    return fn(iter([opened(sid).SerializeToString(), b"\x12\xff\x01\x0a"]), timeout=10)


def push_short(stub, _sid):
    sid = stub.OpenSession(muxer_pb2.OpenSessionRequest(**GOOD_OPEN, expected_frames=3), timeout=10).session_id
    try:
        return stub.Push(iter([opened(sid), chunk("frames", frames()), chunk("pcm", pcm()), end(2)]), timeout=30)
    finally:
        stub.Abort(muxer_pb2.AbortRequest(session_id=sid), timeout=10)


def control_garbage(stub, sid):
    """A first Control message whose data is no control message, the stream kept open (not a producer leaving)."""
    done = threading.Event()

    def requests():
        yield muxer_pb2.ControlMessage(session_id=sid, transport="nixl", data=b"\xff\x00")
        done.wait(30)
    try:
        return list(stub.Control(requests(), timeout=10))
    finally:
        done.set()


def cases() -> list[Case]:
    out = []
    bounds = {"width": (2, 8192), "height": (2, 8192), "fps": (1, 240), "sample_rate": (8000, 192000),
              "channels": (1, 2)}
    for field, (lo, hi) in bounds.items():
        for value in sorted({0, -1, lo - 1, hi + 1, 2**31 - 1, -2**31}):
            out.append(open_case(f"OpenSession {field}={value}", field, **{field: value}))
    out += [open_case("OpenSession width odd", "width", width=65),
            open_case("OpenSession height odd", "height", height=63),
            open_case("OpenSession no fields", "width", **{k: 0 for k in bounds}),
            open_case("OpenSession expected_frames=-1", "expected_frames", expected_frames=-1),
            open_case("OpenSession expected_frames=2**31-1", "expected_frames", expected_frames=2**31 - 1),
            open_case("OpenSession transport=carrier-pigeon", "transport", transport="carrier-pigeon")]
    for ttl in (1e300, float("inf"), float("-inf"), float("nan"), -1.0, 7201.0):
        out.append(open_case(f"OpenSession ttl_s={ttl}", "ttl_s", ttl_s=ttl))
    # wrong wire types: width (2) as a string, ttl_s (8) as a varint, request_id (1) as a varint
    out += [Case("OpenSession width as bytes", "width", raw("OpenSession", b"\x12\x03abc")),
            Case("OpenSession truncated message", "request", raw("OpenSession", b"\x0a\x10abc")),
            Case("Abort truncated message", "request", raw("Abort", b"\x0a\xff")),
            Case("Push truncated message", "request", raw_push)]

    out += [Case("Fetch unknown session", None, lambda stub, _sid: list(stub.Fetch(
                muxer_pb2.FetchRequest(session_id="no-such-session"), timeout=10)), NOT_FOUND),
            Case("Fetch no session_id", "session_id", lambda stub, _sid: list(stub.Fetch(
                muxer_pb2.FetchRequest(), timeout=10))),
            Case("Abort no session_id", "session_id", lambda stub, _sid: stub.Abort(
                muxer_pb2.AbortRequest(reason="x"), timeout=10))]

    # Push: the stream's first message, the session, then every TensorChunk and StreamEnd field
    f, p = frames(), pcm()
    out += [push_case("Push empty stream", "open", lambda sid: []),
            push_case("Push chunk before open", "open", lambda sid: [chunk("frames", f)]),
            push_case("Push open without session_id", "open.session_id", lambda sid: [opened("")]),
            push_case("Push unknown session", None, lambda sid: [opened("no-such-session")], NOT_FOUND),
            push_case("Push open.transport=carrier-pigeon", "open.transport",
                      lambda sid: [opened(sid, transport="carrier-pigeon"), chunk("frames", f), chunk("pcm", p),
                                   end(2)]),
            push_case("Push a second open", "open", lambda sid: [opened(sid), opened(sid)]),
            # the producer's own abort (GrpcStreamSender.abort): the call is answered CANCELLED, Fetch names the VAE
            push_case("Push ends without end", None, lambda sid: [opened(sid), chunk("frames", f)],
                      grpc.StatusCode.CANCELLED),
            push_case("Push end.tensors wrong", "end.tensors",
                      lambda sid: [opened(sid), chunk("frames", f), chunk("pcm", p), end(5)]),
            push_case("Push end inside a tensor", "end",
                      lambda sid: [opened(sid), chunk("frames", f, last=False), end(1)]),
            Case("Push fewer frames than expected_frames", "frames", push_short),
            push_case("Push no frames", "frames", lambda sid: [opened(sid), chunk("pcm", p), end(1)]),
            push_case("Push no audio", "pcm", lambda sid: [opened(sid), chunk("frames", f), end(1)]),
            push_case("Push chunk.name unknown", "chunk.name",
                      lambda sid: [opened(sid), chunk("latents", f), end(1)]),
            push_case("Push chunk.name empty", "chunk.name",
                      lambda sid: [opened(sid), chunk("", f), end(1)]),
            push_case("Push chunk.dtype unknown", "chunk.dtype",
                      lambda sid: [opened(sid), chunk("frames", f, dtype="uint9"), end(1)]),
            push_case("Push chunk.shape negative", "chunk.shape",
                      lambda sid: [opened(sid), chunk("frames", f, shape=[-2, H, W, 3]), end(1)]),
            push_case("Push chunk.total_bytes wrong", "chunk.total_bytes",
                      lambda sid: [opened(sid), chunk("frames", f, total_bytes=7), end(1)]),
            push_case("Push chunk.total_bytes huge", "chunk.total_bytes",
                      lambda sid: [opened(sid), chunk("frames", f, shape=[2**20, H, W, 3],
                                                      total_bytes=2**20 * H * W * 3), end(1)]),
            push_case("Push chunk.offset nonzero first", "chunk.offset",
                      lambda sid: [opened(sid), chunk("frames", f, offset=8), end(1)]),
            push_case("Push chunk.data short", "chunk.data",
                      lambda sid: [opened(sid), chunk("frames", f, data=b"\0" * 10), end(1)]),
            push_case("Push chunk.data long", "chunk.data",
                      lambda sid: [opened(sid), chunk("frames", f, data=f.tobytes() + b"\0"), end(1)]),
            push_case("Push chunk.meta_json not JSON", "chunk.meta_json",
                      lambda sid: [opened(sid), chunk("frames", f, meta_json="{"), end(1)]),
            push_case("Push chunk.meta_json not an object", "chunk.meta_json",
                      lambda sid: [opened(sid), chunk("frames", f, meta_json="[1]"), end(1)]),
            push_case("Push chunk.transport_metadata out of band", "chunk.transport_metadata",
                      lambda sid: [opened(sid), chunk("frames", f, data=b"", transport_metadata=b"x"), end(1)]),
            push_case("Push chunk.name changes inside a tensor", "chunk.name",
                      lambda sid: [opened(sid), chunk("frames", f, last=False, data=f.tobytes()[:100]),
                                   chunk("pcm", None, offset=100, data=f.tobytes()[100:]), end(1)]),
            push_case("Push frames float32", "frames",
                      lambda sid: [opened(sid), chunk("frames", frames(dtype=np.float32)), end(1)]),
            push_case("Push frames RGBA", "frames",
                      lambda sid: [opened(sid), chunk("frames", frames(c=4)), end(1)]),
            push_case("Push frames of another size", "frames",
                      lambda sid: [opened(sid), chunk("frames", frames(h=32)), end(1)]),
            push_case("Push frames n=0", "frames",
                      lambda sid: [opened(sid), chunk("frames", frames(n=0)), end(1)]),
            push_case("Push frames rank 3", "frames",
                      lambda sid: [opened(sid), chunk("frames", frames()[0]), end(1)]),
            push_case("Push frames control item (no dtype)", "chunk.dtype",
                      lambda sid: [opened(sid), chunk("frames"), end(1)]),
            push_case("Push pcm mono into stereo", "pcm",
                      lambda sid: [opened(sid), chunk("frames", f), chunk("pcm", pcm(channels=1)), end(2)]),
            push_case("Push pcm int16", "pcm",
                      lambda sid: [opened(sid), chunk("frames", f), chunk("pcm", pcm(dtype=np.int16)), end(2)]),
            push_case("Push pcm NaN", "pcm",
                      lambda sid: [opened(sid), chunk("frames", f), chunk("pcm", pcm(value=np.nan)), end(2)]),
            push_case("Push pcm rank 1", "pcm",
                      lambda sid: [opened(sid), chunk("frames", f), chunk("pcm", pcm()[0]), end(2)]),
            push_case("Push yuv without n", "yuv",
                      lambda sid: [opened(sid), chunk("yuv", np.zeros(W * H * 3 // 2, np.uint8)), end(1)]),
            push_case("Push yuv wrong size", "yuv",
                      lambda sid: [opened(sid), chunk("yuv", np.zeros(100, np.uint8), meta_json='{"n": 1}'),
                                   end(1)]),
            push_case("Push yuv n not an integer", "yuv",
                      lambda sid: [opened(sid), chunk("yuv", np.zeros(W * H * 3 // 2, np.uint8),
                                                      meta_json='{"n": "one"}'), end(1)]),
            push_case("Push yuv float32", "yuv",
                      lambda sid: [opened(sid), chunk("yuv", np.zeros(W * H * 3 // 2, np.float32),
                                                      meta_json='{"n": 1}'), end(1)]),
            push_case("Push v before y", "chunk.name",
                      lambda sid: [opened(sid), chunk("v", np.zeros((1, H // 2, W // 2), np.uint8)), end(1)]),
            push_case("Push y of another size", "y",
                      lambda sid: [opened(sid), chunk("y", np.zeros((1, 8, 8), np.uint8)),
                                   chunk("u", np.zeros((1, H // 2, W // 2), np.uint8)),
                                   chunk("v", np.zeros((1, H // 2, W // 2), np.uint8)), end(3)])]

    # Control (the NIXL control pipe): the first message names the session and the transport
    def control(msgs):
        return lambda stub, sid: list(stub.Control(iter(msgs(sid)), timeout=10))

    out += [Case("Control empty stream", "session_id", control(lambda sid: [])),
            Case("Control no session_id", "session_id", control(lambda sid: [muxer_pb2.ControlMessage()])),
            Case("Control transport=grpc", "transport",
                 control(lambda sid: [muxer_pb2.ControlMessage(session_id=sid, transport="grpc")])),
            Case("Control unknown session", None,
                 control(lambda sid: [muxer_pb2.ControlMessage(session_id="nope", transport="nixl")]), NOT_FOUND),
            Case("Control data not a control message", "data", control_garbage)]
    return out


def test_every_bad_direct_muxer_call_names_its_field(muxer):
    census = cases()
    answers, wrong = {}, []
    with grpc.insecure_channel(muxer.address) as ch:
        stub = muxer_pb2_grpc.MuxerStub(ch)
        stub._channel = ch
        for case in census:
            sid = stub.OpenSession(muxer_pb2.OpenSessionRequest(**GOOD_OPEN), timeout=10).session_id
            try:
                case.call(stub, sid)
                got = ("OK", None, "")
            except grpc.RpcError as err:
                got = (err.code().name, dict(err.trailing_metadata() or ()).get("h3serve-field"), err.details())
            finally:
                stub.Abort(muxer_pb2.AbortRequest(session_id=sid, reason="census"), timeout=10)
            answers[got[0]] = answers.get(got[0], 0) + 1
            if got[0] != case.code.name or got[1] != case.field:
                wrong.append(f"{case.name}: {got} (want {case.code.name}, field {case.field})")
        # still serving: a good session end to end
        sid = stub.OpenSession(muxer_pb2.OpenSessionRequest(**GOOD_OPEN, expected_frames=2), timeout=10).session_id
        result = stub.Push(iter([opened(sid), chunk("frames", frames()), chunk("pcm", pcm()), end(2)]), timeout=30)
        mp4 = b"".join(c.data for c in stub.Fetch(muxer_pb2.FetchRequest(session_id=sid), timeout=30))
        assert result.frames == 2 and len(mp4) == result.mp4_bytes > 0
        # a session whose stream was refused: its Fetch names the producer (the VAE), not the caller's input
        sid = stub.OpenSession(muxer_pb2.OpenSessionRequest(**GOOD_OPEN), timeout=10).session_id
        with pytest.raises(grpc.RpcError) as refused:
            stub.Push(iter([opened(sid), chunk("frames", frames(c=4)), end(1)]), timeout=30)
        with pytest.raises(grpc.RpcError) as fetched:
            list(stub.Fetch(muxer_pb2.FetchRequest(session_id=sid), timeout=10))
        assert refused.value.code() == INVALID
        # and the VAE that sent it reports a stage failure naming the muxer, not the end caller's bad input (400)
        err = peer_error(refused.value, "muxer")
        assert isinstance(err, StageFailed) and err.stage == "muxer" and "frames" in str(err)
        assert dict(fetched.value.trailing_metadata())["h3serve-stage"] == "vae", fetched.value.details()
    print("FIGURES", json.dumps({"muxer_census_calls": len(census), "wrong_answers": len(wrong),
                                 "answers": dict(sorted(answers.items()))}))
    assert not wrong, "\n".join(wrong)
