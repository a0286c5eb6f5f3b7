"""Issue 21, item 6: the gateway's memory grew over the upload tests and stayed. A real gateway process is sent large
uploads, served and refused, from four threads of two callers (bench/upload_memory.py), and its resident memory,
read from /proc, must come back to what it was before them.

Two causes: glibc's moving mmap threshold left what the decode threads and the event loop had freed resident in
their heaps (uploads.unmap_large_buffers; about 250 MB of this run), and an idle decode thread kept its last
request's uploads and decoded tensors referenced (DecodePool._work; 48 MiB for a 4096x4096 image per thread).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GROWTH_MB = 40   # what may stay: allocator bookkeeping, Python's own caches


def test_the_gateway_gives_back_what_large_uploads_used():
    out = subprocess.run([sys.executable, str(REPO / "bench" / "upload_memory.py"), "--rounds", "2"],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    print("FIGURES", figures)
    assert not figures["wrong_answers"], figures
    rss = figures["rss_mb"]
    assert rss["peak"] - rss["before"] > 200, figures   # the uploads did take memory while they were decoded
    assert figures["growth_after_mb"] < GROWTH_MB, figures
