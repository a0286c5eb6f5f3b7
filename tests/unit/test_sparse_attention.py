"""Block-sparse attention (`--sparse-attention`): the router's rules against a brute-force reading of them, the
CPU kernel against fp32 attention written out with the same block mask, and the lever through the DiT engine
(dense steps bitwise dense, then lossy; with step reuse; refused for FastH3 with the one lever message)."""

from __future__ import annotations

import math

import pytest
import torch

from h3serve.config.levers import CLI_NAMES, LEVERS_MESSAGE, Levers, LeverError, check_combination
from h3serve.errors import ProfileError
from h3serve.models.dit import sparse
from h3serve.models.dit.engine import DiTEngine, DiTRequest
from h3serve.models.dit.layout import build_t2va_layout
from h3serve.models.dit.model import H3DiT, H3DiTConfig
from h3serve.models.dit.sparse import (
    AUDIO,
    TEXT,
    VIDEO,
    SparseConfig,
    attach_sparse,
    masked_attention,
    reference_attention,
    route,
    row_groups,
)

TINY = dict(num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=4, num_refiner_layers=1,
            ffn_dim=64, text_dim=24, freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2)
BLOCK = 16


def _groups(n_text: int, n_video: int, n_audio: int) -> torch.Tensor:
    return torch.tensor([TEXT] * n_text + [VIDEO] * n_video + [AUDIO] * n_audio, dtype=torch.int8)


def test_router_keeps_text_self_and_the_top_blocks_of_each_modality():
    g = torch.Generator().manual_seed(0)
    groups = _groups(20, 200, 70)  # 290 rows: blocks 0-1 hold text, block 12 mixes video and audio, block 18 partial
    n = groups.shape[0]
    q, k = (torch.randn(1, 3, n, 8, generator=g) for _ in range(2))
    cfg = SparseConfig(0.25, block=BLOCK)
    mask = route(q, k, groups, cfg)
    nb = math.ceil(n / BLOCK)
    assert mask.shape == (1, 3, nb, nb)
    kind = [TEXT if (groups[i * BLOCK:(i + 1) * BLOCK] == TEXT).any() else int(groups[i * BLOCK]) for i in range(nb)]
    cell = BLOCK // cfg.cells

    def cells(t, h, i):  # the means of block i's cells that hold rows (the last block: one cell of 2 rows)
        rows = t[0, h, i * BLOCK:(i + 1) * BLOCK].double()
        return [rows[c:c + cell].mean(dim=0) for c in range(0, rows.shape[0], cell)]

    for h in range(3):
        qc, kc = ([torch.stack(cells(t, h, i)) for i in range(nb)] for t in (q, k))
        scores = torch.tensor([[float(torch.logsumexp((a @ b.T).flatten() / math.sqrt(8), dim=0)) for b in kc]
                               for a in qc])
        for i in range(nb):
            row = mask[0, h, i]
            if kind[i] == TEXT:
                assert row.all()  # a query block holding text reads everything
                continue
            want = {j for j in range(nb) if kind[j] == TEXT} | {i}
            for grp in (VIDEO, AUDIO):
                members = [j for j in range(nb) if kind[j] == grp]
                keep = math.ceil(0.25 * len(members))
                want |= set(sorted(members, key=lambda j: -float(scores[i, j]))[:keep])
            assert set(torch.nonzero(row).flatten().tolist()) == want, (h, i)


def test_cell_means_read_q_and_k_in_place_and_average_the_last_cell_over_its_rows():
    """The router pools straight from attention's (B, N, H, D) view in bf16, summing in fp32: the same means as the
    fp32 copy written out, the last (partial) cell over its own rows only."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 101, 3, 8, generator=g).to(torch.bfloat16).transpose(1, 2)   # (B, H, N, D), not contiguous
    cell = 16
    want = torch.stack([x[:, :, a:a + cell].float().sum(dim=2) / len(range(a, min(a + cell, 101)))
                        for a in range(0, 101, cell)], dim=2)
    got = sparse._pool(x, cell)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 7, 8)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sparse._pool(x[:, :, :96], cell), want[:, :, :6], rtol=1e-6, atol=1e-6)   # no tail


def test_the_route_bench_part_runs_on_the_cpu():
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(repo / "bench" / "sparse_attention.py"), "--parts", "route",
                           "--device", "cpu", "--route-heads", "1", "--densities", "0.25", "--iters", "1",
                           "--warmup", "0"], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["bench"], out["rows"], out["heads"]) == ("sparse_route", 73642, 1)
    assert out["pool_qk_ms"] > 0 and out["d0.25"]["route_ms"] > 0 and 0.25 <= out["d0.25"]["kept"] < 0.5


def test_kernel_equals_fp32_attention_with_the_same_block_mask():
    g = torch.Generator().manual_seed(1)
    groups = _groups(10, 150, 40)
    q = torch.randn(1, 2, 200, 16, generator=g)
    k, v = (torch.randn(1, 2, 190, 16, generator=g) for _ in range(2))  # fewer keys than queries (a Ulysses tail)
    mask = route(q, k, groups, SparseConfig(0.125, block=BLOCK))
    assert 0 < float(mask.float().mean()) < 1
    ref = reference_attention(q, k, v, mask, BLOCK)
    out = masked_attention(q, k, v, mask, BLOCK, max_elements=4000)  # several query slices
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert (out - dense).abs().max() > 1e-3  # the mask changes the output: the test can fail
    full = torch.ones_like(mask)
    torch.testing.assert_close(masked_attention(q, k, v, full, BLOCK), dense, rtol=1e-5, atol=1e-5)


def test_row_groups_follow_the_packed_segments():
    layout = build_t2va_layout(5, 2, 4, 6, 3)
    groups = row_groups(layout)
    for seg in layout.segments:
        want = TEXT if seg.kind == "text" else AUDIO if "audio" in seg.kind else VIDEO
        assert (groups[seg.start:seg.stop] == want).all()


@pytest.fixture(scope="module")
def model() -> H3DiT:
    torch.manual_seed(0)
    m = H3DiT(H3DiTConfig(**TINY)).eval().requires_grad_(False)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def _request(**kw) -> DiTRequest:
    g = torch.Generator().manual_seed(3)
    return DiTRequest(text_states=torch.randn(1, 5, TINY["text_dim"], generator=g),
                      text_tags=torch.ones(5, dtype=torch.long), latent_frames=3, latent_h=16, latent_w=16,
                      audio_latents=8, seed=5, **kw)


def _rel_l2(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _sparse_engine(model, density: float, dense_fraction: float = 0.2) -> DiTEngine:
    state = attach_sparse(model, SparseConfig(density, block=BLOCK, dense_fraction=dense_fraction, min_rows=0))
    assert model.sparse is state
    return DiTEngine({"transformer": model}, device=torch.device("cpu"), profile="base")


def _detach(model) -> None:
    model.sparse = None
    for blk in model.transformer_blocks:
        blk.attn.attention_fn = sparse_free


from h3serve.models.dit.kernels import auto_attention as sparse_free  # noqa: E402 - the blocks' default kernel


def test_lever_runs_dense_first_then_sparse_and_composes_with_step_reuse(model):
    plain = DiTEngine({"transformer": model}, device=torch.device("cpu"), profile="base")
    ref = plain.generate(_request(steps=11))  # 10 forwards: 2 dense, 8 routed
    try:
        engine = _sparse_engine(model, 0.25)
        res = engine.generate(_request(steps=11))
        report = model.sparse.last
        assert report["dense_steps"] == 2 and report["sparse_forwards"] == 8
        assert 0.25 < report["kept_mean"] < 1
        assert 0 < _rel_l2(res.video, ref.video) < 0.5 and torch.isfinite(res.audio).all()
        # every step dense: the lever's path is the dense path (the dense kernel, untouched)
        _detach(model)
        engine = _sparse_engine(model, 0.25, dense_fraction=1.0)
        same = engine.generate(_request(steps=11))
        assert torch.equal(same.video, ref.video) and torch.equal(same.audio, ref.audio)
        assert model.sparse.num_steps == 0  # reset after the request: a stray forward runs dense
        _detach(model)
        engine = _sparse_engine(model, 0.25)
        high = engine.generate(_request(steps=11, quality="high"))
        assert high.forwards_computed <= 10 and torch.isfinite(high.video).all()
    finally:
        _detach(model)


def test_fasth3_refuses_sparse_attention_and_the_bounds_name_the_field():
    levers = Levers(sparse_attention="25")
    assert levers.lossy() and levers.on == ("sparse_attention",)
    with pytest.raises(LeverError) as err:
        check_combination("fasth3", levers)
    assert str(err.value) == LEVERS_MESSAGE.format(**CLI_NAMES)
    assert "--sparse-attention" in str(err.value)
    with pytest.raises(LeverError, match=r"--sparse-attention='33' must be one of off, 50, 25, 12.5"):
        Levers(sparse_attention="33").check()
    with pytest.raises(ProfileError, match="sparse-attention"):
        DiTEngine.load("/nonexistent", profile="fasth3", levers=levers)
    assert sparse.density_of("12.5") == 0.125 and sparse.density_of("off") is None


def test_ring_is_refused_with_sparse_attention(model):
    """A Ring chunk sees only part of the keys: sequence parallelism with the lever is Ulysses only."""
    from types import SimpleNamespace

    from h3serve.models.dit.parallel import USPPlan, parallelize_dit

    try:
        attach_sparse(model, SparseConfig(0.25, block=BLOCK))
        with pytest.raises(ValueError, match="Ulysses only, not ring=2"):
            parallelize_dit(model, SimpleNamespace(plan=USPPlan(1, 2)))
    finally:
        _detach(model)
