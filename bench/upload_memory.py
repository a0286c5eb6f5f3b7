"""The gateway's memory over a series of large uploads: a real gateway process (`h3serve serve --stages gateway`,
no stages: `validate_only` requests need none) on 127.0.0.1, its resident memory read from /proc before the
uploads, at their peak and after them. Prints one JSON object (MB = 10^6 bytes).

    python bench/upload_memory.py [--rounds 6] [--threads 4] [--settle-s 3]

Each round sends, from `--threads` threads of two callers at once: a 4096x4096 JPEG and a 2048x2048 PNG of
noise (12.2 and 11.1 MB, served), the same JPEG cut short with an end marker appended and with random bytes for
its scan data, the PNG with a bad CRC (refused 400), a 10 s WAV (served) and a 61 s WAV (refused). "before" is
read after one small upload of each kind (what a first decode loads), "after" `--settle-s` seconds after the last
answer.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import wave
import zlib
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
KEYS = {"alice": "alice-key", "bob": "bob-key"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (the peak so far) of a process, MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024 / 1e6
    return out


def noise(side: int) -> np.ndarray:
    rng = np.random.default_rng(side)
    y, x = np.mgrid[0:side, 0:side]
    arr = np.stack([(x // 16) % 256, (y // 16) % 256, ((x + y) // 32) % 256], -1)
    return np.clip(arr + rng.integers(-40, 40, arr.shape), 0, 255).astype(np.uint8)


def encoded(arr: np.ndarray, fmt: str, **save) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **save)
    return buf.getvalue()


def wav(seconds: float) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(32000)
        w.writeframes((np.random.default_rng(1).integers(-3000, 3000, (int(seconds * 32000), 2))
                       .astype("<i2").tobytes()))
    return buf.getvalue()


def payloads(small: bool = False) -> list[tuple[str, str, bytes, str, int]]:
    """(what, field, bytes, content type, the status expected); `small`: the same kinds at 256x256 and 5 s."""
    big_jpeg = encoded(noise(256 if small else 4096), "JPEG", quality=95)
    big_png = encoded(noise(256 if small else 2048), "PNG", compress_level=1)
    sos = big_jpeg.rfind(b"\xff\xda")
    start = sos + 2 + ((big_jpeg[sos + 2] << 8) | big_jpeg[sos + 3])
    end = len(big_jpeg) - 2
    cut = big_jpeg[:start + (end - start) // 2].rstrip(b"\xff") + b"\xff\xd9"
    rand = np.random.default_rng(7).integers(0, 256, end - start, dtype=np.uint8).tobytes()
    rand = rand.replace(b"\xff", b"\xff\x00")[:end - start].rstrip(b"\xff")
    garbage = big_jpeg[:start] + rand + b"\xff\xd9"
    idat = big_png.index(b"IDAT")
    bad_crc = big_png[:idat + 4] + bytes([big_png[idat + 4] ^ 1]) + big_png[idat + 5:]
    assert zlib.crc32(bad_crc) != zlib.crc32(big_png)
    return [("jpeg 4096x4096", "first_image", big_jpeg, "image/jpeg", 200),
            ("png 2048x2048", "first_image", big_png, "image/png", 200),
            ("jpeg cut short", "first_image", cut, "image/jpeg", 400),
            ("jpeg random scan data", "first_image", garbage, "image/jpeg", 400),
            ("png bad crc", "first_image", bad_crc, "image/png", 400),
            ("wav 10 s", "audio_reference", wav(5 if small else 10), "audio/wav", 200),
            ("wav 61 s", "audio_reference", wav(61), "audio/wav", 400)]


def form(field: str) -> dict[str, str]:
    if field == "audio_reference":   # audio goes beside an image reference
        return {"prompt": "a kite", "seconds": "5", "size": "320x256", "extra_params[task]": "ref2va"}
    return {"prompt": "a kite", "seconds": "5", "size": "320x256", "extra_params[task]": "fl2va"}


def post(url: str, key: str, field: str, data: bytes, ctype: str) -> int:
    files = [(field, ("upload" + {"image/jpeg": ".jpg", "image/png": ".png"}.get(ctype, ".wav"), data, ctype))]
    if field == "audio_reference":
        files.append(("image_reference", ("r.png", encoded(noise(256), "PNG"), "image/png")))
    r = httpx.post(f"{url}/v1/videos?validate_only=true", headers={"Authorization": f"Bearer {key}"},
                   data=form(field), files=files, timeout=300)
    return r.status_code


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--settle-s", type=float, default=3.0)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="h3serve-upload-memory-"))
    keys = work / "keys"
    keys.write_text("".join(f"{n} sha256:{hashlib.sha256(k.encode()).hexdigest()}\n" for n, k in KEYS.items()))
    http_port = free_port()
    argv = [sys.executable, "-m", "h3serve.cli", "serve", "--stages", "gateway", "--host", "127.0.0.1",
            "--port", str(free_port()), "--http-port", str(http_port), "--api-keys-file", str(keys),
            "--jobs-dir", str(work / "jobs"), "--tasks", "t2va,fl2va,ref2va",
            *[a for s in ("encoder", "dit", "vae", "muxer") for a in (f"--{s}", "127.0.0.1:9")]]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{http_port}"
    try:
        end = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < end, "the gateway did not start"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        work_items = payloads()
        idle = rss_mb(proc.pid)["VmRSS"]
        for what, field, data, ctype, expected in payloads(small=True):   # what a first decode of each kind loads
            assert post(url, KEYS["alice"], field, data, ctype) == expected, what
        time.sleep(args.settle_s)
        before = rss_mb(proc.pid)["VmRSS"]

        samples, wrong, done = [], [], threading.Event()

        def sample():
            while not done.is_set():
                samples.append(rss_mb(proc.pid)["VmRSS"])
                time.sleep(0.05)

        def send(worker: int):
            key = KEYS["alice" if worker % 2 == 0 else "bob"]
            for r in range(args.rounds):
                for i in range(len(work_items)):
                    what, field, data, ctype, expected = work_items[(i + worker) % len(work_items)]
                    status = post(url, key, field, data, ctype)
                    if status != expected:
                        wrong.append((what, status))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        senders = [threading.Thread(target=send, args=(w,)) for w in range(args.threads)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        seconds = time.monotonic() - t0
        time.sleep(args.settle_s)
        done.set()
        sampler.join()
        status = rss_mb(proc.pid)
        print(json.dumps({
            "uploads": args.rounds * args.threads * len(work_items), "threads": args.threads,
            "seconds": round(seconds, 1), "wrong_answers": wrong,
            "rss_mb": {"idle": round(idle), "before": round(before), "peak": round(max(samples + [status["VmHWM"]])),
                       "after": round(status["VmRSS"])},
            "growth_after_mb": round(status["VmRSS"] - before),
        }))
        return 0 if not wrong else 1
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
