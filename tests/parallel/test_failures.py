"""A rank that dies mid-request, and the pure parts of the plans (degrees, row shards, tile assignment).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from h3serve.distributed.proxies import VideoVAEProxy
from h3serve.config.parallel import DegreeError, ParallelDegrees
from h3serve.distributed.world import launch
from h3serve.errors import RankFailed
from h3serve.models.dit.layout import row_shards
from h3serve.models.vae.parallel import assign_tiles
from h3serve.models.vae.tiling import plan_tiles
from h3serve.testing.rankcases import GEOMETRIES

from .workers import build_fails_on_rank_1, build_suite, dit_inputs, dit_request


def test_a_dead_rank_fails_the_request_with_a_clear_error(tiny_checkpoint):
    h = launch(2, build_suite, (str(tiny_checkpoint), [(2, 1)]), timeout_s=30)
    try:
        victim = h.processes[0]

        def kill(i, n):
            if i == 2:
                os.kill(victim.pid, signal.SIGKILL)

        t0 = time.monotonic()
        with pytest.raises(RankFailed, match=r"rank 1 of 2 .*unhealthy") as info:
            h.call("generate", ((2, 1), dit_request(steps=20)), on_step=kill)
        elapsed = time.monotonic() - t0
        assert elapsed < 15, f"took {elapsed:.1f} s to notice"
        assert not h.healthy and "rank 1" in h.failure
        with pytest.raises(RankFailed, match="unhealthy"):
            h.call("generate", ((2, 1), dit_request()))
        print(f"dead rank reported in {elapsed:.2f} s: {info.value}")
    finally:
        h.close()


def test_a_rank_that_fails_at_start_up_ends_the_start_with_its_error():
    # the rank's own error ends the start (it comes back through a pipe: the rank may die before it joins)
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 of 2 exited \(exit code -?\d+\): RuntimeError: CUDA error: invalid "
                                         r"device ordinal"):
        launch(2, build_fails_on_rank_1, timeout_s=120)
    elapsed = time.monotonic() - t0
    assert elapsed < 30, f"took {elapsed:.1f} s"
    print(f"rank start-up failure reported in {elapsed:.2f} s")


# -- pure parts -------------------------------------------------------------------------------------------------------

def test_degrees_are_validated_with_a_message_that_says_what_to_change():
    assert ParallelDegrees(encoder_tp=8, ulysses=8, ring=1, vae_pp=8).validate().world_size == 8
    assert ParallelDegrees(ulysses=8, ring=2, vae_pp=16).validate().world_size == 16
    with pytest.raises(DegreeError, match=r"ulysses=3 must divide the DiT.s 56 .*ring"):
        ParallelDegrees(ulysses=3).validate()
    with pytest.raises(DegreeError, match=r"encoder_tp=3 cannot split .*: use 1, 2, 4, 8, 16, 32 or 64"):
        ParallelDegrees(encoder_tp=3).validate()
    with pytest.raises(DegreeError, match=r"vae_pp=2 must be 1 or the whole DiT group \(ulysses x ring = 4\)"):
        ParallelDegrees(ulysses=4, vae_pp=2).validate()
    with pytest.raises(DegreeError, match=r"WORLD_SIZE=4 .* need .* = 2 ranks"):
        ParallelDegrees(ulysses=2).validate(world_size=4)
    with pytest.raises(DegreeError, match="positive integer"):
        ParallelDegrees(ring=0).validate()


def test_row_shards_and_tile_assignment_are_pure_and_cover_everything():
    layout = dit_inputs(*GEOMETRIES["S25"][0])[-1]
    shards = row_shards(layout, 4)
    assert [(s.start, s.stop) for s in shards] == [(0, 7), (7, 14), (14, 21), (21, 25)]
    for kind, total in (("text", 7), ("video", 12), ("audio", 6)):
        spans = [getattr(s, kind) for s in shards]
        assert spans[0][0] == 0 and spans[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    tiles = plan_tiles(768, 1344)
    owned = assign_tiles(tiles, 8)
    assert sorted(k for ks in owned for k in ks) == list(range(len(tiles)))
    assert max(map(len, owned)) - min(map(len, owned)) <= 1


def test_a_decode_stopped_early_still_runs_out_on_rank_0():
    """The other ranks decode their tiles of every window: rank 0 must take part in all of them."""
    produced = []

    class Stage:
        handlers = {VideoVAEProxy.PART: lambda payload, local: None}

        def call(self, op, payload):
            assert op == VideoVAEProxy.DECODE
            for i in range(4):
                produced.append(i)
                yield i

    clips = VideoVAEProxy(Stage()).iter_decode(None)
    assert next(clips) == 0 and produced == [0]
    clips.close()
    assert produced == [0, 1, 2, 3]
