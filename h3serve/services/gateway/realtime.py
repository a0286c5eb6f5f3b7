"""`WS /v1/realtime/video`: vLLM-Omni's streaming-video WebSocket, a second face of the live fMP4 that
`GET /v1/videos/{id}/content?stream=true` serves.

    client: {"type": "session.start", "prompt": ..., <the videos API's fields>, "format": "m4s"}
    server: {"type": "video.start", "request_id", "format": "m4s", "config": {...}}
            then per chunk {"type": "video.chunk_metadata", ...} + one binary frame of fMP4 bytes
            then {"type": "session.done", "request_id", "chunks", "stopped"}   (or {"type": "error", "message"})
    client, any time: {"type": "session.stop"} (cancels the job), {"type": "session.ping"} (-> session.pong)

The session is an HTTP job like any other (`POST /v1/videos`'s fields, validated the same way, its MP4 kept and
downloadable by its id), so a client that drops the socket can still fetch the video; leaving the socket before
the job ends cancels it, as leaving `/v1/videos/sync` does. H3 generates one clip per request: mid-session prompt
or camera updates (`session.interaction`) are answered with an error and the session goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable, Iterator

from starlette.websockets import WebSocket, WebSocketDisconnect

from h3serve.errors import H3Error
from h3serve.errortable import classify, error_object

from .gateway import Gateway
from .jobs import Job
from .orchestrate import live_content

log = logging.getLogger("h3serve.gateway")

FORMATS = ("m4s",)          # fragmented MP4, as vLLM-Omni's default
START_TIMEOUT_S = 30.0      # the first message must come this soon
CHUNK = 1 << 20             # a finished MP4 is sent in frames of this size
CONFIG_FIELDS = ("model", "width", "height", "fps", "num_frames", "seed", "num_inference_steps", "task")


async def serve_session(ws: WebSocket, gateway: Gateway, make_job: Callable[[dict], Job],
                        describe: Callable[[Job], dict]) -> None:
    """One session: its start message into a job, the job's live fMP4 out as binary frames."""
    await ws.accept()
    job: Job | None = None
    try:
        start = await asyncio.wait_for(ws.receive_text(), START_TIMEOUT_S)
        msg = _message(start)
        if msg.get("type") != "session.start":
            raise _Refused(f"the first message is session.start, got {str(msg.get('type'))[:40]!r}")
        fmt = msg.get("format", "m4s")
        if fmt not in FORMATS:
            raise _Refused(f"format={str(fmt)[:20]!r} is not served: {' | '.join(FORMATS)}", "format")
        body = {k: v for k, v in msg.items() if k not in ("type", "format")}
        job = await asyncio.to_thread(make_job, body)
        await asyncio.to_thread(gateway.submit, job)
        obj = describe(job)
        await ws.send_json({"type": "video.start", "request_id": job.id, "format": fmt,
                            "config": {k: obj.get(k) for k in CONFIG_FIELDS}})
        stopped = asyncio.Event()
        control = asyncio.create_task(_control(ws, gateway, job, stopped))
        try:
            chunks = await _stream(ws, gateway, job)
        finally:
            control.cancel()
        await asyncio.to_thread(job.done.wait)
        if job.status == "failed" and not stopped.is_set():
            await _send_error(ws, job.error.message, error_object(job.error), job.id)
        else:
            await ws.send_json({"type": "session.done", "request_id": job.id, "chunks": chunks,
                                "stopped": stopped.is_set()})
        await ws.close()
    except WebSocketDisconnect:
        if job is not None and not job.finished:
            await asyncio.to_thread(gateway.jobs.cancel, job.id, "the WebSocket client disconnected")
    except (H3Error, _Refused, asyncio.TimeoutError) as exc:
        if isinstance(exc, asyncio.TimeoutError):
            exc = _Refused(f"no session.start within {START_TIMEOUT_S:g}s")
        err = error_object(classify(exc)) if isinstance(exc, H3Error) else {"param": exc.param}
        await _send_error(ws, str(exc), err, job.id if job is not None else None)
        await ws.close()


class _Refused(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _message(text: str) -> dict[str, Any]:
    try:
        msg = json.loads(text)
    except ValueError:
        raise _Refused("a JSON object message") from None
    if not isinstance(msg, dict):
        raise _Refused("a JSON object message")
    return msg


async def _send_error(ws: WebSocket, message: str, err: dict, request_id: str | None) -> None:
    await ws.send_json({"type": "error", "message": message, "request_id": request_id,
                        "code": err.get("code"), "param": err.get("param")})


async def _stream(ws: WebSocket, gateway: Gateway, job: Job) -> int:
    """The job's fMP4 as binary frames, each after its chunk metadata; the finished MP4 as one frame when the job
    ended before its live stream could be read. -> the frames sent."""
    it = await asyncio.to_thread(live_content, job)
    if it is None:
        await asyncio.to_thread(job.done.wait)
        it = iter(()) if job.status != "completed" else _finished(gateway, job)
    sent = 0
    while (chunk := await asyncio.to_thread(next, it, None)) is not None:
        await ws.send_json({"type": "video.chunk_metadata", "request_id": job.id, "kind": "media",
                            "transport_chunk_index": sent, "generation_chunk_index": sent, "num_frames": None,
                            "byte_length": len(chunk), "started_event_ids": [], "active_event_ids": [],
                            "completed_event_ids": []})
        await ws.send_bytes(chunk)
        sent += 1
    return sent


def _finished(gateway: Gateway, job: Job) -> Iterator[bytes]:
    """A completed job's MP4 from the job store, in chunks."""
    mp4 = gateway.jobs.mp4(job)
    if mp4 is None:
        return
    if mp4.path is None:
        yield from mp4.chunks
        return
    with open(mp4.path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


async def _control(ws: WebSocket, gateway: Gateway, job: Job, stopped: asyncio.Event) -> None:
    """The client's messages while the job runs: stop, ping; a prompt update is refused (one clip a request)."""
    try:
        while True:
            try:
                msg = _message(await ws.receive_text())
            except _Refused as exc:
                await _send_error(ws, str(exc), {}, job.id)
                continue
            kind = msg.get("type")
            if kind == "session.stop":
                stopped.set()
                await asyncio.to_thread(gateway.jobs.cancel, job.id, "stopped by the client (session.stop)")
            elif kind == "session.ping":
                await ws.send_json({"type": "session.pong"})
            else:
                why = ("H3 generates one clip per request: no prompt or camera updates mid-session"
                       if kind == "session.interaction" else f"unknown message type {str(kind)[:40]!r}")
                await _send_error(ws, why, {"param": "type"}, job.id)
    except WebSocketDisconnect:
        if not job.finished:
            await asyncio.to_thread(gateway.jobs.cancel, job.id, "the WebSocket client disconnected")
