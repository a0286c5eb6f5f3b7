"""Layerwise offload: the streamed block stack gives the resident path's outputs bit for bit (one rank, and two
gloo ranks in both modes), and the plan's arithmetic holds for any rank count."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from h3serve.models.dit.layout import build_t2va_layout, row_timesteps
from h3serve.models.dit.model import H3DiT, H3DiTConfig
from h3serve.models.offload import OffloadPlan, attach_offload

TINY = dict(num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=6, num_refiner_layers=1,
            ffn_dim=64, text_dim=24, freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2)


def tiny_model(seed: int = 0) -> H3DiT:
    torch.manual_seed(seed)
    model = H3DiT(H3DiTConfig(**TINY)).eval().requires_grad_(False)
    with torch.no_grad():  # the default init leaves the AdaLN projections near zero: make every block matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def inputs(seed: int = 1, t: tuple[float, float] = (0.7, 0.4)):
    layout = build_t2va_layout(5, 2, 4, 6, 3)
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(1, layout.num_video_rows, 96, generator=g)
    audio = torch.randn(1, layout.num_audio_rows, 32, generator=g)
    text = torch.randn(1, 5, TINY["text_dim"], generator=g)
    timesteps, ti = row_timesteps(layout, *t)
    return video, audio, text, timesteps, ti, layout


@torch.no_grad()
@pytest.mark.parametrize("r", [6, 5, 3, 2])
def test_offload_matches_resident_bitwise(r):
    ref = tiny_model()
    want = [ref(*inputs(t=t)) for t in ((0.7, 0.4), (0.3, 0.2))]
    model = tiny_model()
    off = attach_offload(model, r, "cpu")
    for _ in range(2):  # twice: the slots are reused across forwards (and the prefetch of the next forward)
        for w, t in zip(want, ((0.7, 0.4), (0.3, 0.2))):
            got = model(*inputs(t=t))
            assert torch.equal(got[0], w[0]) and torch.equal(got[1], w[1])
    streamed = 6 - max(0, r - 2) if r < 6 else 0
    # every streamed block is copied at least once; a slot still holding its block is not copied again
    assert streamed <= off.copies <= 4 * streamed + 1
    # a partial range (what step reuse runs) streams only its blocks
    x, ctx, _ = model.embed(*inputs())
    y_ref, _, _ = ref.embed(*inputs())
    assert torch.equal(model.run_blocks(x.clone(), ctx, 1, 4), ref.run_blocks(y_ref.clone(), ctx, 1, 4))


@torch.no_grad()
def test_resize_moves_the_window_both_ways():
    ref = tiny_model()
    want = ref(*inputs())
    model = tiny_model()
    off = attach_offload(model, 2, "cpu")
    for r in (6, 4, 2, 5):
        off.resize(r)
        got = model(*inputs())
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), r
    off = attach_offload(tiny_model(), 4, "cpu")
    with pytest.raises(ValueError, match="smallest r"):
        off.resize(2)


def test_offload_plan_arithmetic():
    p = OffloadPlan(50, 2, "allgather", world=8)
    assert list(p.resident) == [] and len(p.streamed) == 50
    assert p.shard_bytes(1000) == 256 and p.host_bytes_per_rank(1000) == 50 * 256
    assert p.device_block_bytes(1000) == 2 * 8 * 256
    q = OffloadPlan(50, 20, "local", world=3)
    assert list(q.resident) == list(range(18)) and q.shard_bytes(1000) == 1000
    assert q.device_block_bytes(1000) == 18 * 1000 + 2 * 1000
    assert not OffloadPlan(50, 50).streaming and list(OffloadPlan(50, 50).resident) == list(range(50))
    for bad in (1, 51):
        with pytest.raises(ValueError, match="between 2"):
            OffloadPlan(50, bad)
    with pytest.raises(ValueError, match="must be one of local, allgather"):
        OffloadPlan(50, 4, "gather")


def _rank(rank: int, world: int, store: str, mode: str, r: int, q) -> None:
    torch.set_num_threads(1)
    # a file rendezvous: no port to race for with other processes on the machine
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        with torch.no_grad():
            model = tiny_model()
            off = attach_offload(model, r, "cpu", mode=mode, group=dist.group.WORLD)
            outs = [model(*inputs(t=t)) for t in ((0.7, 0.4), (0.3, 0.2), (0.7, 0.4))]
        # numpy arrays travel by value: a torch tensor would travel as a file descriptor this process must outlive
        q.put((rank, [tuple(t.numpy() for t in o) for o in outs], off.report()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["allgather", "local"])
def test_two_gloo_ranks_match_resident(mode, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as the ranks run: another thread count sums in another order (not bitwise)
    try:
        with torch.no_grad():
            ref = tiny_model()
            want = [ref(*inputs(t=t)) for t in ((0.7, 0.4), (0.3, 0.2), (0.7, 0.4))]
    finally:
        torch.set_num_threads(threads)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = str(tmp_path / "rendezvous")
    procs = [ctx.Process(target=_rank, args=(k, 2, store, mode, 3, q)) for k in range(2)]
    for p in procs:
        p.start()
    got = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, outs, report in got:
        for (v, a), (wv, wa) in zip(outs, want):
            assert torch.equal(torch.from_numpy(v), wv) and torch.equal(torch.from_numpy(a), wa), (rank, mode)
        block = report["block_bytes"]
        assert report["host_bytes_per_rank"] == 5 * (block if mode == "local" else -(-block // 512) * 256)


def test_engine_applies_the_levers_and_offload_changes_nothing(tiny_checkpoint):
    """The serve path: DiTEngine.apply_offload on a loaded engine; DiTEngine.load with FP8 from a checkpoint."""
    from h3serve.config.levers import Levers
    from h3serve.models.dit.engine import DiTEngine, DiTRequest

    def request(text_dim):
        g = torch.Generator().manual_seed(3)
        return DiTRequest(text_states=torch.randn(1, 5, text_dim, generator=g), text_tags=torch.ones(5, dtype=torch.long),
                          latent_frames=2, latent_h=4, latent_w=6, audio_latents=3, seed=5, steps=6)

    cpu = torch.device("cpu")
    want = DiTEngine({"transformer": tiny_model()}, device=cpu, profile="base").generate(request(TINY["text_dim"]))
    engine = DiTEngine({"transformer": tiny_model()}, device=cpu, profile="base")
    engine.apply_offload(Levers(resident_blocks=3))
    runner = engine.models["transformer"].block_runner
    assert runner.report()["streamed_blocks"] == 5
    got = engine.generate(request(TINY["text_dim"]))
    assert torch.equal(got.video, want.video) and torch.equal(got.audio, want.audio) and runner.copies >= 5

    plain = DiTEngine.load(tiny_checkpoint)
    text_dim = plain.models["transformer"].config.text_dim
    ref = plain.generate(request(text_dim))
    fp8 = DiTEngine.load(tiny_checkpoint, levers=Levers(fp8=True))
    assert sum(type(m).__name__ == "FP8Linear" for m in fp8.models["transformer"].modules()) == 6 * 2
    got = fp8.generate(request(text_dim))
    rel = float((got.video - ref.video).norm() / ref.video.norm())
    assert 0 < rel < 0.05
