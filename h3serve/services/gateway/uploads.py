"""Media a caller sends (multipart files, base64 data URLs, gRPC bytes fields): read into `Upload`s, then decoded
here, at the front door, before the request is admitted, so that a file that cannot be decoded or is out of bounds
is a 4xx / INVALID_ARGUMENT naming the caller's field, never a stage failure.

Bounded by what is decoded, not by what a header claims: audio is decoded up to MAX_AUDIO_SECONDS and no further,
images are decoded whole and verified (h3serve.media.image). The decoding runs on `DecodePool`, threads of its
own with a per-caller share, never the event loop's default executor.

What leaves here for the stages (`Conditions`): the kinds in the order the model reads them and one tensor per kind,
an image as (H, W, 3) uint8 RGB (the decoded file; each stage applies the same resize, models/conditions.py), an
audio reference as (2, N) float32 PCM at 32 kHz cut to the request's duration (as the embedded pipeline reads it), a
video reference as its soundtrack (kind "soundtrack", PCM as an audio reference's) when it has one, then its frames
(kind "video", uint8 (F, H, W, 3) normalized once here: 24 fps, cut to the request's frames, on its own canvas).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import concurrent.futures
import ctypes
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from h3serve.config.geometry import SAMPLE_RATE
from h3serve.config.request import MAX_AUDIO_SECONDS, MAX_MEDIA_BYTES, GenerationRequest, Upload, media_source
from h3serve.errors import Draining, H3Error, QueueFull, RequestError
from h3serve.media.audio import AudioTooLong, audio_seconds, read_audio_reference
from h3serve.media.image import CorruptImage, decode_rgb
from h3serve.media.video import VideoOutOfBounds, has_audio, read_video_reference

DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                      re.I)
MIME_EXTENSION = {"image/png": ".png", "image/jpeg": ".jpg", "image/jpg": ".jpg", "image/webp": ".webp",
                  "image/bmp": ".bmp", "image/gif": ".gif", "audio/wav": ".wav", "audio/x-wav": ".wav",
                  "audio/wave": ".wav", "audio/flac": ".flac", "audio/mpeg": ".mp3", "audio/mp4": ".m4a",
                  "audio/ogg": ".ogg", "video/mp4": ".mp4", "video/quicktime": ".mov", "video/webm": ".webm"}
LARGEST = max(MAX_MEDIA_BYTES.values())


def from_data_url(field: str, value: Any) -> Upload:
    """`data:<mime>;base64,<bytes>` (or wrapped as clients wrap it: {"image_url" | "audio_url" | "video_url" | "url":
    ...}, vLLM-Omni's and OpenAI's reference objects) -> Upload. Remote URLs are refused: the server fetches
    nothing; so are file ids (no file store)."""
    if isinstance(value, dict):
        if "file_id" in value:
            raise RequestError(field, _short(value), "a data URL or a file upload: file ids are not served (this "
                                                     "server keeps no file store)")
        inner = next((value[k] for k in ("image_url", "audio_url", "video_url", "url", "data") if k in value), None)
        if isinstance(inner, dict):
            inner = inner.get("url")
        value = inner
    allowed = "a data URL (data:<mime>;base64,<file bytes>) or a file upload (multipart); the server fetches no URL"
    if not isinstance(value, str):
        raise RequestError(field, _short(value), allowed)
    m = DATA_URL.match(value[:200])
    if m is None or not m.group("b64"):
        raise RequestError(field, _short(value), allowed)
    payload = value[m.end():]
    if len(payload) > LARGEST * 4 // 3 + 8:
        raise RequestError(field, f"{len(payload)} base64 characters", f"a file of at most {LARGEST:,} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(field, _short(value), "valid base64 after 'base64,'") from None
    mime = (m.group("mime") or "").lower()
    return Upload(data, field, "upload" + MIME_EXTENSION.get(mime, ""))


def _short(value: Any) -> Any:
    text = repr(value)
    return value if len(text) <= 60 else text[:60] + "..."


@dataclass(frozen=True)
class Conditions:
    """A request's decoded conditions: kinds in model order and one tensor per kind (see the module doc)."""

    kinds: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def _name(source: Any, default: str) -> str:
    return source.field if isinstance(source, Upload) else default


def _image(source: Any, field: str) -> torch.Tensor:
    """An image decoded whole and verified (h3serve.media.image: CRCs, a PNG's scanlines, every pixel)."""
    try:
        arr = decode_rgb(media_source(source))
    except CorruptImage as exc:
        raise RequestError(field, repr(source) if isinstance(source, Upload) else source,
                           f"an intact image file ({exc})") from None
    except Exception:  # noqa: BLE001 - a truncated or corrupt file fails in the decode, after its header was read
        raise RequestError(field, repr(source) if isinstance(source, Upload) else source,
                           "a readable, intact image file (PNG, JPEG, WebP, ...)") from None
    return torch.from_numpy(arr.copy())


def _audio(source: Any, field: str, max_samples: int) -> torch.Tensor:
    """An audio reference decoded up to the cap and no further: a header claiming more than MAX_AUDIO_SECONDS is
    refused before decoding; a header that claims less (or nothing) is not trusted: decoding stops, and the file
    is refused, as soon as more than MAX_AUDIO_SECONDS were decoded. Only `max_samples` are kept."""
    shown = repr(source) if isinstance(source, Upload) else source
    allowed = f"audio of at most {MAX_AUDIO_SECONDS:g} seconds"
    try:
        seconds = audio_seconds(media_source(source))
        if seconds is not None and seconds > MAX_AUDIO_SECONDS:
            raise RequestError(field, f"{seconds:.1f} s", allowed)
        pcm = read_audio_reference(media_source(source), max_samples, SAMPLE_RATE, max_seconds=MAX_AUDIO_SECONDS)
    except RequestError:
        raise
    except AudioTooLong as exc:
        claim = "" if exc.header_seconds is None else f" (its header says {exc.header_seconds:.1f} s)"
        raise RequestError(field, f"more than {MAX_AUDIO_SECONDS:g} s decoded{claim}", allowed) from None
    except Exception as exc:  # noqa: BLE001 - a malformed file fails anywhere in the demuxer or decoder
        reason = str(exc).removeprefix("references: ") if isinstance(exc, H3Error) else \
            f"the decoder failed: {type(exc).__name__}"
        raise RequestError(field, shown, f"a readable audio file at {SAMPLE_RATE} Hz, mono or stereo ({reason})") \
            from None
    if not bool(torch.isfinite(pcm).all()):   # float WAVs can carry NaN / Inf
        raise RequestError(field, shown, "audio with finite samples (this one has NaN or Inf)")
    return pcm


def _has_audio(source: Any, field: str) -> bool:
    try:
        return has_audio(media_source(source))
    except H3Error as exc:
        raise RequestError(field, repr(source) if isinstance(source, Upload) else source,
                           f"a readable video file (MP4, MOV, WebM, MKV; {exc})") from None


def _video(source: Any, field: str, num_frames: int, fps: float | None) -> torch.Tensor:
    """A video reference decoded and normalized, within the bounds of h3serve.media.video (checked on the header
    before decoding, and on what is decoded)."""
    shown = repr(source) if isinstance(source, Upload) else source
    try:
        frames = read_video_reference(media_source(source), num_frames, fps=fps)
    except VideoOutOfBounds as exc:
        raise RequestError(field, f"{shown}: {exc.what} {exc.value}", exc.allowed) from None
    except H3Error as exc:
        raise RequestError(field, shown, f"a readable video file (MP4, MOV, WebM, MKV; {exc})") from None
    except Exception as exc:  # noqa: BLE001 - a malformed file fails anywhere in the demuxer or decoder
        raise RequestError(field, shown, f"a readable video file (the decoder failed: {type(exc).__name__})") \
            from None
    return torch.from_numpy(frames)


def decode_conditions(req: GenerationRequest) -> Conditions | None:
    """The request's keyframes / references decoded and bounded (None for t2va). Raises RequestError naming the
    field of the first bad file."""
    kinds, tensors = [], []
    if req.task == "fl2va":
        for kind, source in (("first", req.first_image), ("last", req.last_image)):
            if source is not None:
                kinds.append(kind)
                tensors.append(_image(source, _name(source, f"{kind}_image")))
    elif req.task == "ref2va":
        max_samples = int(req.num_frames / req.fps * SAMPLE_RATE)   # as the reference truncates
        for i, spec in enumerate(req.references):
            field = _name(spec.path, f"references[{i}]")
            if spec.kind == "video":
                if _has_audio(spec.path, field):
                    kinds.append("soundtrack")
                    tensors.append(_audio(spec.path, field, max_samples))
                kinds.append("video")
                tensors.append(_video(spec.path, field, req.num_frames, spec.fps))
                continue
            kinds.append(spec.kind)
            tensors.append(_image(spec.path, field) if spec.kind == "image"
                           else _audio(spec.path, field, max_samples))
    else:
        return None
    return Conditions(tuple(kinds), tuple(tensors))


# -- where uploads are decoded ---------------------------------------------------------------------------------

# glibc serves an allocation of at least its mmap threshold from a mapping of its own, unmapped when freed, and
# raises that threshold to the size of each such block freed (up to 32 MiB). After the first large upload, the next
# upload bodies and decoded images came from the heaps of the threads that allocated them and stayed resident once
# freed (bench/upload_memory.py; docs/reliability.md). A threshold set with mallopt does not move.
MMAP_THRESHOLD = 1 << 20
M_MMAP_THRESHOLD = -3


def unmap_large_buffers() -> bool:
    """Fix the C library's mmap threshold at MMAP_THRESHOLD for this process, so that freed upload buffers return to
    the system. False where the C library has no mallopt (not glibc) or refuses."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1


DECODE_WAITING_PER_CALLER = 8   # a caller's requests waiting for the pool beyond its share; more: QueueFull (429)


def decode_caller(owner: str | None, address: str | None) -> tuple[str, str]:
    """Whose share of the decode pool a request takes: its API key's name, else (no keys) its client's address
    (a gRPC peer's `ipv4:HOST:PORT` without the port)."""
    if owner is not None:
        return ("key", owner)
    address = address or ""
    if address.startswith(("ipv4:", "ipv6:")):
        address = address.split(":", 1)[1].rsplit(":", 1)[0]
    return ("address", address)


class DecodePool:
    """Upload decoding (validation of a request that carries media: image headers, whole images, audio) on threads
    of its own, never the event loop's default executor that the API's store calls use, so a flood of uploads
    cannot hold up anyone's `GET /v1/videos`.

    At most `workers` decode at once, and at most `per_caller` of them for one caller (the API key's name, else the
    client's address); the next task is taken round-robin over the callers with one waiting, so a caller's turn
    comes however many requests another has queued. A caller with DECODE_WAITING_PER_CALLER requests waiting is
    refused the next at once (QueueFull: 429, retryable)."""

    def __init__(self, workers: int, per_caller: int):
        self.workers = max(1, int(workers))
        self.per_caller = max(1, min(int(per_caller), self.workers))
        self._cond = threading.Condition()
        self._pending: collections.OrderedDict[Any, collections.deque] = collections.OrderedDict()
        self._running: collections.Counter = collections.Counter()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"h3serve-decode-{i}", daemon=True)
                         for i in range(self.workers)]
        for t in self._threads:
            t.start()

    def submit(self, caller: Any, fn: Callable[[], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise Draining("the server is shutting down and admits no new requests; retry elsewhere")
            queue = self._pending.setdefault(caller, collections.deque())
            if len(queue) >= DECODE_WAITING_PER_CALLER:
                raise QueueFull(f"{len(queue)} of this caller's requests with uploads wait to be decoded (each caller "
                                f"decodes {self.per_caller} at a time); retry later")
            queue.append((fut, fn))
            self._cond.notify()
        return fut

    def run(self, caller: Any, fn: Callable[[], Any]) -> Any:
        """fn() on the pool, waited for (a gRPC handler's thread)."""
        return self.submit(caller, fn).result()

    async def arun(self, caller: Any, fn: Callable[[], Any]) -> Any:
        """fn() on the pool, awaited (the HTTP API's event loop)."""
        return await asyncio.wrap_future(self.submit(caller, fn))

    def _next(self):
        for caller, queue in self._pending.items():
            if self._running[caller] < self.per_caller:
                item = queue.popleft()
                del self._pending[caller]
                if queue:   # its next request waits behind every other caller's
                    self._pending[caller] = queue
                return caller, item
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (taken := self._next()) is None:
                    self._cond.wait()
                if self._closed:
                    return
                caller, (fut, fn) = taken
                self._running[caller] += 1
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 - the caller's future carries it
                        fut.set_exception(exc)
            finally:
                with self._cond:
                    self._running[caller] -= 1
                    if not self._running[caller]:
                        del self._running[caller]
                    self._cond.notify_all()
                # while it waits for the next task, the thread holds nothing of this one: the request's uploads
                # and decoded tensors (the future's result) go with the request
                del taken, fut, fn

    def close(self) -> None:
        with self._cond:
            self._closed = True
            pending = [item for q in self._pending.values() for item in q]
            self._pending.clear()
            self._cond.notify_all()
        for fut, _ in pending:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(Draining("the server shut down before the request was decoded; retry elsewhere"))
