"""Issue 21, items 4 and 5: caps enforced on what is decoded and received, not on what a header claims, and one
caller's uploads unable to stall another's API calls.

Every crafted input is made here: a FLAC whose STREAMINFO claims 5 s and that holds 2,400 s, PNGs with a bad CRC or
too few scanlines, JPEGs cut short with an end marker appended or with random bytes for scan data, multipart bodies
past their bounds (chunked, with a Content-Length that lies), connections that trickle their headers or stop in
their body, JPEGs with hundreds of thousands of empty APP2 segments. The gateway
runs in this process (no stages: `validate_only` requests and listing need none) behind the production uvicorn
configuration (`frontdoor.uvicorn_config`), on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import uvicorn
from PIL import Image

from h3serve.config.request import MAX_MEDIA_BYTES, Upload
from h3serve.config.stage import StageConfig
from h3serve.errors import QueueFull, RequestError
from h3serve.errortable import classify
from h3serve.media.image import ADAM7
from h3serve.services.gateway import http as gateway_http
from h3serve.services.gateway.auth import Authenticator
from h3serve.services.gateway.frontdoor import uvicorn_config
from h3serve.services.gateway.gateway import Gateway
from h3serve.services.gateway.uploads import DECODE_WAITING_PER_CALLER, DecodePool, _image

REPO = Path(__file__).resolve().parents[2]
KEYS = {"alice": "alice-key", "bob": "bob-key"}
ALICE = {"Authorization": "Bearer alice-key"}
BOB = {"Authorization": "Bearer bob-key"}
FL2VA = {"prompt": "a kite", "seconds": "5", "size": "320x256", "extra_params[task]": "fl2va"}


# -- the front door in this process ---------------------------------------------------------------------------

def start_front(tmp_path, **limits):
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{n} sha256:{hashlib.sha256(k.encode()).hexdigest()}\n" for n, k in KEYS.items()))
    stages = {s: "127.0.0.1:9" for s in ("encoder", "dit", "vae", "muxer")}   # never dialled: no job is run
    config = StageConfig.from_knobs(jobs_dir=str(tmp_path / "jobs"), http_port=0, tasks="t2va,fl2va,ref2va", **stages,
                         **limits)
    gateway = Gateway(config)   # not started: validation, decoding, the store and listing only
    server = uvicorn.Server(uvicorn_config(gateway_http.create_app(gateway, Authenticator(str(keys))), config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < end, "the HTTP server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop():
        server.should_exit = True
        thread.join(10)
        gateway.close()

    return SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, gateway=gateway, config=config, stop=stop)


@pytest.fixture
def front(tmp_path):
    f = start_front(tmp_path, http_header_timeout_s=1.0, http_body_timeout_s=1.0, http_max_connections=16)
    yield f
    f.stop()


def answer(sock: socket.socket, timeout: float = 30.0) -> tuple[int, dict, bytes]:
    """Status, headers and body of the response on `sock` (read until it is whole or the peer closes)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    headers = {k.lower(): v for k, v in headers.items()}
    length = int(headers.get("content-length", -1))
    while length < 0 or len(body) < length:
        try:
            part = sock.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not part:
            break
        body += part
    return int(lines[0].split()[1]), headers, body


def closed(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer closes `sock` within `timeout` seconds (whatever it answers first)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


# -- item 4: audio decoded up to the cap and no further ----------------------------------------------------------

LYING_FLAC = r'''
import io, json, resource, sys, time
import av, numpy as np
sys.path.insert(0, sys.argv[1])
from h3serve.config.request import Upload
from h3serve.errors import RequestError
from h3serve.services.gateway.uploads import _audio

def flac(seconds, claim, rate=32000):
    """Silence, `seconds` of it, in a FLAC whose STREAMINFO says it holds `claim` seconds."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="flac") as out:
        s = out.add_stream("flac", rate=rate, layout="mono")
        block = np.zeros((1, rate * 10), dtype=np.int16)
        for i in range(int(seconds // 10)):
            f = av.AudioFrame.from_ndarray(block, format="s16", layout="mono")
            f.sample_rate, f.pts = rate, i * rate * 10
            for p in s.encode(f):
                out.mux(p)
        for p in s.encode(None):
            out.mux(p)
    data = bytearray(buf.getvalue())
    total = int(claim * rate)    # STREAMINFO's total samples: 36 bits from its byte 13's low nibble
    data[8 + 13] = (data[8 + 13] & 0xF0) | ((total >> 32) & 0x0F)
    data[8 + 14:8 + 18] = (total & 0xFFFFFFFF).to_bytes(4, "big")
    return bytes(data)

data = flac(2400, 5.0)
with av.open(io.BytesIO(data)) as c:
    claimed = float(c.streams.audio[0].duration * c.streams.audio[0].time_base)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
try:
    pcm = _audio(Upload(data, "audio_reference", "long.flac"), "audio_reference", 32000 * 5)
    out = {"accepted": list(pcm.shape)}
except RequestError as exc:
    out = {"field": exc.field, "message": str(exc)}
out.update(bytes=len(data), claimed=claimed, seconds=time.perf_counter() - t0,
           peak_growth_mb=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
print(json.dumps(out))
'''


def test_audio_that_outlasts_its_header_is_refused_after_decoding_the_cap(tmp_path):
    """A FLAC claiming 5 s that holds 2,400 s: refused naming the field once 60 s were decoded, with bounded memory
    (before: accepted, the whole 2,400 s decoded; 939 MB more peak memory in the issue)."""
    script = tmp_path / "lying_flac.py"
    script.write_text(LYING_FLAC)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(script), str(REPO)], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print("FIGURES", out)
    assert out["claimed"] == pytest.approx(5.0)
    assert out.get("field") == "audio_reference", out
    assert "more than 60 s decoded (its header says 5.0 s)" in out["message"]
    assert "audio of at most 60 seconds" in out["message"]
    assert out["peak_growth_mb"] < 150, out


# -- item 4: images that are not whole ---------------------------------------------------------------------------

def png(arr: np.ndarray, *, interlace: int = 0, rows: bytes | None = None, bad_crc: bytes = b"",
        cut: int = 0) -> bytes:
    """A PNG written here (8-bit, filter 0), so that it can be damaged on purpose: `rows` replaces the inflated
    scanlines, `bad_crc` names a chunk whose CRC is wrong, `cut` bytes are cut off the end of the compressed
    stream (the chunk itself whole, its CRC right)."""
    h, w, c = arr.shape

    def lines(a):
        return b"".join(b"\0" + r.tobytes() for r in a)

    if rows is None:
        rows = (b"".join(lines(arr[y0::dy, x0::dx]) for x0, y0, dx, dy in ADAM7 if arr[y0::dy, x0::dx].size)
                if interlace else lines(arr))

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) ^ (1 if kind == bad_crc else 0)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    colour = {1: 0, 3: 2, 4: 6}[c]
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, colour, 0, 0, interlace))
            + chunk(b"IDAT", zlib.compress(rows)[:-cut or None]) + chunk(b"IEND", b""))


PIXELS = (np.arange(40 * 48 * 3) % 251).astype(np.uint8).reshape(40, 48, 3)
SCANLINES = b"".join(b"\0" + r.tobytes() for r in PIXELS)


@pytest.mark.parametrize("name,data,why", [
    ("a bad CRC on IDAT", png(PIXELS, bad_crc=b"IDAT"), "checksum"),
    ("a bad CRC on IEND", png(PIXELS, bad_crc=b"IEND"), "CRC"),
    ("half the scanlines", png(PIXELS, rows=SCANLINES[: len(SCANLINES) // 2]), "truncated"),
    ("one scanline short", png(PIXELS, rows=SCANLINES[: -(1 + 48 * 3)]), "truncated"),
    ("the IDAT stream cut short", png(PIXELS, cut=60), "truncated"),
    ("the IDAT chunk cut short", png(PIXELS)[:-60] + png(PIXELS)[-12:], "truncated"),
    ("scanlines past the header's", png(PIXELS, rows=SCANLINES + b"\0" * 145), "more than"),
])
def test_corrupt_pngs_are_refused_naming_the_field(name, data, why):
    with pytest.raises(RequestError) as info:
        _image(Upload(data, "input_reference", "x.png"), "input_reference")
    c = classify(info.value)
    assert c.field == "input_reference" and c.kind.http == 400, name
    assert "intact image" in c.message, c.message
    assert why.lower() in c.message.lower(), (name, c.message)


@pytest.mark.parametrize("interlace", [0, 1])
@pytest.mark.parametrize("shape", [(40, 48, 3), (17, 23, 4), (16, 31, 1)])
def test_whole_pngs_decode_as_pillow_reads_them(shape, interlace):
    arr = (np.arange(np.prod(shape)) % 251).astype(np.uint8).reshape(shape)
    data = png(arr, interlace=interlace)
    ours = _image(Upload(data, "input_reference", "x.png"), "input_reference").numpy()
    assert (ours == np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))).all()


def test_a_corrupt_png_upload_is_400_naming_the_field(front):
    r = httpx.post(f"{front.url}/v1/videos?validate_only=true", headers=ALICE, data=FL2VA,
                   files={"input_reference": ("k.png", png(PIXELS, bad_crc=b"IDAT"), "image/png")}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference", r.text
    r = httpx.post(f"{front.url}/v1/videos?validate_only=true", headers=ALICE, data=FL2VA,
                   files={"input_reference": ("k.png", png(np.zeros((256, 320, 3), np.uint8)), "image/png")},
                   timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "validated", r.text


def jpeg(mode: str = "RGB", size: tuple[int, int] = (320, 256), **save) -> bytes:
    """A JPEG of a gradient with noise (every block has AC data), saved with Pillow's options `save`."""
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    arr = np.stack([(x * 3) % 256, (y * 2) % 256, (x + y) % 256], -1)
    arr = np.clip(arr + np.random.default_rng(21).integers(-30, 30, arr.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).convert(mode).save(buf, "JPEG", **save)
    return buf.getvalue()


def flat_jpeg(level: int) -> bytes:
    """A JPEG of one gray level: every block the same, no AC data (what a filled-in scan decodes to at 128)."""
    buf = io.BytesIO()
    Image.new("RGB", (320, 256), (level,) * 3).save(buf, "JPEG", quality=100)
    return buf.getvalue()


def last_scan(data: bytes) -> tuple[int, int]:
    """Where the data of a JPEG's last scan starts (after its SOS header) and ends (the EOI at the file's end)."""
    sos = data.rfind(b"\xff\xda")
    assert data.endswith(b"\xff\xd9") and sos > 0
    return sos + 4 + ((data[sos + 2] << 8) | data[sos + 3]) - 2, len(data) - 2


def cut_short(data: bytes, keep: float) -> bytes:
    """The file cut inside its last scan, `keep` of that scan's data kept, and an end marker appended."""
    start, end = last_scan(data)
    head = data[:start + int((end - start) * keep)].rstrip(b"\xff")   # no half of a stuffed FF
    return head + b"\xff\xd9"


def garbage_scan(data: bytes, *, markers: bool) -> bytes:
    """The file with its last scan's data replaced by random bytes of the same length: stuffed (no marker in it)
    or raw (any 0xFF pair a marker, as in a file overwritten with noise)."""
    start, end = last_scan(data)
    noise = np.random.default_rng(7).integers(0, 256, end - start, dtype=np.uint8).tobytes()
    if not markers:
        noise = noise.replace(b"\xff", b"\xff\x00")[:end - start].rstrip(b"\xff")
    return data[:start] + noise + b"\xff\xd9"


def restart_interval_cut(data: bytes, interval: int) -> bytes:
    """A JPEG with restart markers whose `interval`-th restart interval loses its second half; the rest intact."""
    rst = [i for i in range(len(data) - 1) if data[i] == 0xFF and 0xD0 <= data[i + 1] <= 0xD7]
    start, end = rst[interval - 1] + 2, rst[interval]
    return data[:start + (end - start) // 2].rstrip(b"\xff") + data[end:]


def refused(data: bytes) -> str:
    with pytest.raises(RequestError) as info:
        _image(Upload(data, "input_reference", "x.jpg"), "input_reference")
    c = classify(info.value)
    assert c.field == "input_reference" and c.kind.http == 400, c
    assert "intact image" in c.message, c.message
    return c.message


@pytest.mark.parametrize("keep", [0.5, 0.99])
@pytest.mark.parametrize("kind", ["baseline", "progressive", "grayscale", "CMYK", "restart markers"])
def test_a_jpeg_cut_short_with_an_end_marker_is_refused_naming_the_field(kind, keep):
    data = {"baseline": jpeg(), "progressive": jpeg(progressive=True), "grayscale": jpeg("L"),
            "CMYK": jpeg("CMYK"), "restart markers": jpeg(restart_marker_rows=1)}[kind]
    crafted = cut_short(data, keep)
    with Image.open(io.BytesIO(crafted)) as image:
        image.load()   # what the check is for: Pillow itself decodes it, the rest mid-gray, and says nothing
    assert "ends before its last block" in refused(crafted)


def test_a_jpeg_missing_half_of_one_restart_interval_is_refused():
    data = jpeg(restart_marker_rows=1)
    assert "ends before its last block" in refused(restart_interval_cut(data, 5))


def test_a_jpeg_whose_scan_data_is_random_bytes_is_refused():
    stuffed = garbage_scan(jpeg(), markers=False)
    with Image.open(io.BytesIO(stuffed)) as image:
        image.load()   # it decodes: to noise, with most of the bytes left over
    assert "is not image data" in refused(stuffed)
    for data in (jpeg(), jpeg(progressive=True), jpeg(restart_marker_rows=1)):
        refused(garbage_scan(data, markers=True))   # Pillow's own error, or the scan ends at the first marker


def test_a_jpeg_with_more_restart_intervals_than_blocks_of_the_largest_image_is_refused():
    # 2048x2048, progressive (10 scans), a restart marker after every block: 360,448 intervals (4 x 1024x1024's),
    # each of which the check would step through in Python
    data = jpeg(size=(2048, 2048), progressive=True, restart_marker_blocks=1)
    assert "more than 262,144 scans and restart intervals" in refused(data)
    whole = jpeg(size=(1024, 1024), progressive=True, restart_marker_blocks=1)   # 90,112 of them
    _image(Upload(whole, "input_reference", "x.jpg"), "input_reference")


@pytest.mark.parametrize("name,data", [
    ("baseline", jpeg()), ("progressive", jpeg(progressive=True)), ("grayscale", jpeg("L")),
    ("CMYK", jpeg("CMYK")), ("4:4:4, quality 100", jpeg(quality=100, subsampling=0)), ("quality 1", jpeg(quality=1)),
    ("odd size", jpeg(size=(17, 33))), ("optimized tables", jpeg(optimize=True)),
    ("restart markers", jpeg(restart_marker_blocks=7)), ("flat mid-gray", flat_jpeg(128)), ("black", flat_jpeg(0)),
    ("padding before the end marker", jpeg()[:-2] + b"\0" * 63 + b"\xff\xd9"),
    ("data after the end marker", jpeg() + b"trailer" * 100),
])
def test_whole_jpegs_decode_as_pillow_reads_them(name, data):
    ours = _image(Upload(data, "input_reference", "x.jpg"), "input_reference").numpy()
    assert (ours == np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))).all(), name


def test_a_cut_short_jpeg_upload_is_400_naming_the_field(front):
    r = httpx.post(f"{front.url}/v1/videos?validate_only=true", headers=ALICE, data=FL2VA,
                   files={"input_reference": ("k.jpg", cut_short(jpeg(), 0.5), "image/jpeg")}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference", r.text
    assert "ends before its last block" in r.json()["error"]["message"]
    r = httpx.post(f"{front.url}/v1/videos?validate_only=true", headers=ALICE, data=FL2VA,
                   files={"input_reference": ("k.jpg", jpeg(), "image/jpeg")}, timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "validated", r.text


# -- item 4: bodies bounded by the bytes received ----------------------------------------------------------------

BOUNDARY = "h3capsboundary"


def part_head(name: str, filename: str | None = None) -> bytes:
    disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--{BOUNDARY}\r\nContent-Disposition: {disp}\r\n\r\n".encode()


def stream_body(front, parts, *, chunked: bool, content_length: int | None, total_hint: int = 0):
    """POST a multipart body part by part over a raw socket (chunked or not), stop once the server answered.
    `parts`: an iterator of bytes. Returns (status, error object, bytes sent)."""
    head = [f"POST /v1/videos?validate_only=true HTTP/1.1", f"Host: 127.0.0.1:{front.port}",
            "Authorization: Bearer alice-key", f"Content-Type: multipart/form-data; boundary={BOUNDARY}"]
    if content_length is not None:
        head.append(f"Content-Length: {content_length}")
    if chunked:
        head.append("Transfer-Encoding: chunked")
    sock = socket.create_connection(("127.0.0.1", front.port), timeout=30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    sent = 0
    try:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        sock.setblocking(True)
        for piece in parts:
            frame = (f"{len(piece):x}\r\n".encode() + piece + b"\r\n") if chunked else piece
            try:
                sock.settimeout(0.0)
                try:
                    if sock.recv(1, socket.MSG_PEEK):
                        break     # the server answered: stop sending
                except BlockingIOError:
                    pass
                sock.settimeout(30)
                sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
        else:
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        status, _, body = answer(sock)
        return status, json.loads(body or b"{}").get("error", {}), sent
    finally:
        sock.close()


def file_part(name: str, size: int, filename: str = "big.png", chunk: int = 1 << 20):
    yield part_head(name, filename)
    left = size
    while left > 0:
        yield b"\0" * min(chunk, left)
        left -= chunk
    yield b"\r\n"


def test_the_multipart_bound_is_the_documented_one():
    """The most 12 references can weigh (3 videos of 100 MiB and 9 images of 20 MiB: docs/reliability.md) + 1 MiB."""
    assert gateway_http.MAX_BODY_BYTES == (480 << 20) + (1 << 20) == \
        3 * MAX_MEDIA_BYTES["video"] + 9 * MAX_MEDIA_BYTES["image"] + (1 << 20)


@pytest.mark.parametrize("chunked", [False, True])
def test_an_image_part_is_refused_at_its_own_limit_as_it_streams(front, chunked):
    """A 60 MiB image_reference: refused naming the field after about 20 MiB (before: every part was read up to
    the 100 MiB video limit first)."""
    size = 60 << 20
    status, err, sent = stream_body(front, file_part("image_reference", size), chunked=chunked,
                                    content_length=None if chunked else size + 1000)
    print("FIGURES", {"chunked": chunked, "sent_mib": round(sent / 2**20, 1)})
    assert status == 400 and err["param"] == "image_reference", (status, err)
    assert f"at most {MAX_MEDIA_BYTES['image']:,} bytes" in err["message"]
    assert sent < (20 << 20) + (12 << 20), sent   # the cap plus what the sockets' buffers held


def test_a_file_where_none_goes_is_refused_at_its_header(front):
    status, err, sent = stream_body(front, file_part("prompt", 40 << 20), chunked=True, content_length=None)
    assert status == 400 and err["param"] == "prompt" and "files go in" in err["message"], (status, err)
    assert sent < 12 << 20, sent


def test_a_video_part_is_refused_at_its_own_limit_as_it_streams(front):
    size = MAX_MEDIA_BYTES["video"] + (8 << 20)
    status, err, sent = stream_body(front, file_part("video_reference", size, "big.mp4"), chunked=True,
                                    content_length=None)
    assert status == 400 and err["param"] == "video_reference", (status, err)
    assert f"at most {MAX_MEDIA_BYTES['video']:,} bytes" in err["message"]
    assert sent < MAX_MEDIA_BYTES["video"] + (12 << 20), sent


def test_a_chunked_body_with_a_small_content_length_is_counted_on_the_bytes_received(front, monkeypatch):
    """Transfer-Encoding: chunked with `Content-Length: 100` (the server ignores the length, as HTTP says): the
    bound holds on what arrives (before: 1,400 MiB spooled). The bound is lowered here to keep the test small;
    the fields are each within their own 1 MiB."""
    monkeypatch.setattr(gateway_http, "MAX_BODY_BYTES", 4 << 20)

    def fields():
        for i in range(64):   # 64 fields of 512 KiB: 32 MiB in all
            yield part_head(f"extra_params[f{i}]") + b"x" * (512 << 10) + b"\r\n"

    status, err, sent = stream_body(front, fields(), chunked=True, content_length=100)
    print("FIGURES", {"sent_mib": round(sent / 2**20, 1)})
    assert status == 413, (status, err)
    assert "more than 4,194,304 bytes received" in err["message"]
    assert sent < (4 << 20) + (12 << 20), sent


def test_a_chunked_multipart_without_a_length_is_served(front):
    body = b"".join([part_head("prompt") + b"a kite\r\n", part_head("size") + b"320x256\r\n",
                     f"--{BOUNDARY}--\r\n".encode()])
    status, err, _ = stream_body(front, iter([body]), chunked=True, content_length=None)
    assert status == 200, (status, err)


def test_a_thirteenth_file_is_refused_naming_its_field(front):
    parts = (p for i in range(13) for p in file_part("image_reference", 1000, f"{i}.png"))
    status, err, _ = stream_body(front, parts, chunked=True, content_length=None)
    assert status == 400 and err["param"] == "image_reference" and "at most 12 files" in err["message"], err


# -- item 5: header and body read timeouts, a connection limit ---------------------------------------------------

def test_headers_that_trickle_get_408_and_the_connection_closed(front):
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
        t0 = time.monotonic()
        for byte in b"GET /v1/videos HTTP/1.1\r\nHost: x\r\n":
            try:
                sock.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.1)
            if time.monotonic() - t0 > 3:
                break
        status, _, body = answer(sock, timeout=5)
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert time.monotonic() - t0 < 3.5
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:   # says nothing at all
        assert closed(sock, 5.0)


def test_a_body_that_stops_gets_its_connection_closed(front):
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice-key\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        t0 = time.monotonic()
        assert closed(sock, 6.0)
        assert time.monotonic() - t0 < 5.0


def test_connections_past_the_limit_get_503_with_the_error_object(front):
    held = [socket.create_connection(("127.0.0.1", front.port), timeout=10) for _ in range(16)]
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", front.port), timeout=10) as extra:
            status, headers, body = answer(extra, timeout=5)
        assert status == 503 and headers.get("retry-after") == "1", (status, headers)
        err = json.loads(body)["error"]
        assert err["retryable"] and "--http-max-connections" in err["message"]
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert httpx.get(f"{front.url}/v1/videos", headers=ALICE, timeout=10).status_code == 200


# -- item 5: one caller's uploads do not stall another's API calls -----------------------------------------------

def crafted_jpeg(segments: int) -> bytes:
    """A valid 320x256 JPEG with `segments` empty APP2 segments after its SOI (issue 21: 873,813 of them)."""
    buf = io.BytesIO()
    Image.fromarray(np.zeros((256, 320, 3), np.uint8)).save(buf, "JPEG")
    j = buf.getvalue()
    return j[:2] + b"\xff\xe2\x00\x04\x00\x00" * segments + j[2:]


def test_crafted_jpeg_segments_are_refused_before_pillow_parses_them(front):
    t0 = time.monotonic()
    r = httpx.post(f"{front.url}/v1/videos?validate_only=true", headers=BOB, data=FL2VA,
                   files={"input_reference": ("k.jpg", crafted_jpeg(873_813), "image/jpeg")}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference", r.text
    assert "at most 1,000 segments" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 5
    ok = httpx.post(f"{front.url}/v1/videos?validate_only=true", headers=BOB, data=FL2VA,
                    files={"input_reference": ("k.jpg", crafted_jpeg(100), "image/jpeg")}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_the_decode_pool_gives_each_caller_its_share():
    """Bob's uploads hold at most `per_caller` of the pool's threads, Alice's upload starts while all of Bob's
    are stuck, and Bob's requests past DECODE_WAITING_PER_CALLER waiting are refused at once: 429, retryable."""
    pool = DecodePool(workers=2, per_caller=1)
    release, started = threading.Event(), []

    def stuck(who):
        def fn():
            started.append(who)
            release.wait(30)
            return who
        return fn

    try:
        bobs = [pool.submit(("key", "bob"), stuck("bob"))]
        end = time.monotonic() + 10
        while not started:   # Bob's first is running: the rest wait
            assert time.monotonic() < end
            time.sleep(0.01)
        bobs += [pool.submit(("key", "bob"), stuck("bob")) for _ in range(DECODE_WAITING_PER_CALLER)]
        with pytest.raises(QueueFull) as info:
            pool.submit(("key", "bob"), stuck("bob"))
        c = classify(info.value)
        assert c.kind.http == 429 and c.kind.retryable, c
        alice = pool.submit(("key", "alice"), lambda: "alice")
        assert alice.result(10) == "alice"   # Bob's first still holds its thread, the other is Alice's
        assert started == ["bob"]            # Bob's share: one thread, however many he queued
        release.set()
        assert [f.result(10) for f in bobs] == ["bob"] * len(bobs)
    finally:
        release.set()
        pool.close()


FLOOD = r'''
import io, sys, threading, time
import httpx, numpy as np
from PIL import Image
url, seconds, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
buf = io.BytesIO(); Image.fromarray(np.zeros((256, 320, 3), np.uint8)).save(buf, "JPEG"); j = buf.getvalue()
crafted = j[:2] + b"\xff\xe2\x00\x04\x00\x00" * 873_813 + j[2:]   # 873,813 empty APP2 segments
buf = io.BytesIO()
Image.fromarray(np.random.default_rng(0).integers(0, 256, (2048, 2048, 3), dtype=np.uint8)).save(
    buf, "PNG", compress_level=1)
payloads = [("k.jpg", crafted, "image/jpeg"), ("k.png", buf.getvalue(), "image/png")]
fields = {"prompt": "a kite", "seconds": "5", "size": "320x256", "extra_params[task]": "fl2va"}
answers, end = [], time.monotonic() + seconds
print("ready", flush=True)

def flood(n):
    with httpx.Client(timeout=120) as c:
        while time.monotonic() < end:
            try:
                r = c.post(f"{url}/v1/videos?validate_only=true", headers={"Authorization": "Bearer bob-key"},
                           data=fields, files={"input_reference": payloads[0 if n % 3 else 1]})
                answers.append(r.status_code)
                if r.status_code == 429:
                    time.sleep(0.05)
            except httpx.HTTPError:
                answers.append(0)

threads = [threading.Thread(target=flood, args=(n,)) for n in range(12)]
for t in threads: t.start()
for t in threads: t.join()
open(out, "w").write(" ".join(map(str, answers)))
'''


def test_one_callers_upload_flood_leaves_another_callers_listing_fast(front, tmp_path):
    """Bob floods the gateway from another process with uploads, 12 at a time (8 crafted JPEGs of 873,813 empty
    APP2 segments, 4 whole 2048x2048 PNGs of noise) while Alice lists her 50 jobs and sends one small upload: Alice's
    GET /v1/videos p99 stays within 1 s (issue 21: 18.2 s), and her upload is decoded in its turn, not behind
    Bob's queue."""
    job = front.gateway.new_job({"prompt": "p", "seconds": 5, "size": "320x256"}, kind="http", owner="alice")
    for i in range(50):   # Alice's jobs, as the store holds them
        front.gateway.jobs.store.put_record({**job.record(), "id": f"video_{i:032x}", "status": "completed",
                                             "progress": 100.0, "created_at": time.time() - 100 + i,
                                             "completed_at": time.time()})
    assert len(httpx.get(f"{front.url}/v1/videos?limit=100", headers=ALICE, timeout=30).json()["data"]) == 50
    script, out = tmp_path / "flood.py", tmp_path / "flood.out"
    script.write_text(FLOOD)
    seconds = 20.0
    proc = subprocess.Popen([sys.executable, str(script), front.url, str(seconds), str(out)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(3.0)   # the flood under way
        latencies, upload_s = [], None
        with httpx.Client(timeout=60) as c:
            end = time.monotonic() + seconds - 6
            while time.monotonic() < end:
                t0 = time.monotonic()
                assert c.get(f"{front.url}/v1/videos", headers=ALICE).status_code == 200
                latencies.append(time.monotonic() - t0)
                if upload_s is None and len(latencies) == 5:
                    t0 = time.monotonic()
                    r = c.post(f"{front.url}/v1/videos?validate_only=true", headers=ALICE, data=FL2VA,
                               files={"input_reference": ("k.png", png(np.zeros((256, 320, 3), np.uint8)),
                                                          "image/png")})
                    upload_s = time.monotonic() - t0
                    assert r.status_code == 200, r.text
                time.sleep(0.05)
        assert proc.wait(180) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    answers = [int(a) for a in out.read_text().split()]
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    print("FIGURES", {"gets": len(latencies), "p50_s": round(latencies[len(latencies) // 2], 3),
                      "p99_s": round(p99, 3), "max_s": round(latencies[-1], 3),
                      "alice_upload_s": upload_s and round(upload_s, 3),
                      "bob_answers": {s: answers.count(s) for s in sorted(set(answers))}})
    assert 200 in answers   # Bob's whole PNGs were decoded meanwhile
    assert p99 <= 1.0, latencies[-10:]
    assert upload_s is not None and upload_s <= 5.0


# -- item 5: listing paged from the index ------------------------------------------------------------------------

def test_listing_reads_only_the_page_from_the_index(front, monkeypatch):
    """300 jobs of Alice's and 20 of Bob's in the store: a page of 20 reads about 20 records, not every one
    (before: every record on every call; 0.24 s at 1,000 jobs), and paging with `after` walks all of Alice's,
    in order, in both orders. A store written before the index is indexed on first use."""
    store = front.gateway.jobs.store
    job = front.gateway.new_job({"prompt": "p", "seconds": 5, "size": "320x256"}, kind="http", owner="alice")
    t = time.time() - 1000
    ids = {"alice": [], "bob": []}
    for i in range(320):
        owner = "alice" if i % 16 else "bob"
        rec = {**job.record(), "id": f"video_{i:032x}", "owner": owner, "status": "completed",
               "progress": 100.0, "created_at": t + i, "completed_at": t + i}
        store.put_record(rec)
        ids[owner].append(rec["id"])
    reads = []
    real_read = store._read
    monkeypatch.setattr(store, "_read", lambda path: (reads.append(path), real_read(path))[1])
    with httpx.Client(base_url=front.url, headers=ALICE, timeout=30) as c:
        t0 = time.perf_counter()
        r = c.get("/v1/videos", params={"limit": 20})
        first_s = time.perf_counter() - t0
        body = r.json()
        assert r.status_code == 200 and body["has_more"] and len(body["data"]) == 20
        assert [v["id"] for v in body["data"]] == ids["alice"][::-1][:20]
        assert len(reads) <= 22, len(reads)
        for order, want in (("desc", ids["alice"][::-1]), ("asc", ids["alice"])):
            seen, after = [], None
            while True:
                reads.clear()
                params = {"limit": 100, "order": order, **({"after": after} if after else {})}
                body = c.get("/v1/videos", params=params).json()
                assert len(reads) <= 102, len(reads)
                seen += [v["id"] for v in body["data"]]
                if not body["has_more"]:
                    break
                after = body["last_id"]
            assert seen == want, order
        # another caller's id is no cursor: an empty page, as for an id past the end (nothing of bob's is revealed)
        r = c.get("/v1/videos", params={"after": ids["bob"][0]})
        assert r.status_code == 200 and (r.json()["data"], r.json()["has_more"]) == ([], False), r.text
    print("FIGURES", {"jobs": 320, "first_page_s": round(first_s, 4), "records_read": 20})

    # a store of records with no index (written before it existed): indexed once, then listed the same way
    import shutil

    shutil.rmtree(os.path.join(store.root, "index"))
    store._indexed.clear()
    front.gateway.jobs._index_ready = False
    r = httpx.get(f"{front.url}/v1/videos", params={"limit": 5}, headers=BOB, timeout=30)
    assert [v["id"] for v in r.json()["data"]] == ids["bob"][::-1][:5]
