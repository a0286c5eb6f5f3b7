"""Online FP8 (the plain CPU path: the same e4m3 operands dequantized into an fp32 GEMM) against the plain bf16 /
fp32 layers: what is quantized and what keeps its precision, bytes, and the deviation of layers, the DiT forward,
attention and the text decoder."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from h3serve.models.dit import kernels
from h3serve.models.dit.model import H3DiT, H3DiTConfig
from h3serve.models.dit.quant import FP8, FP8Linear, quantize_dit, quantize_rows, weight_bytes

TINY = dict(num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=3, num_refiner_layers=1,
            ffn_dim=64, text_dim=24, freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2)


def rel_l2(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_fp8_linear_tracks_the_linear_and_halves_its_bytes():
    torch.manual_seed(0)
    lin = nn.Linear(256, 384, bias=True).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(4, 50, 256, dtype=torch.bfloat16)
    q = FP8Linear(lin)
    assert q.weight.dtype == FP8 and q.weight_scale.shape == (384, 1)
    y, want = q(x), lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == want.shape
    assert 0 < rel_l2(y, want) < 0.06
    assert weight_bytes(q) == 384 * 256 + 384 * 4 + 384 * 2  # e4m3 weight + fp32 scales + bf16 bias


def test_quantize_rows_handles_zero_rows_and_saturates_nothing():
    t = torch.randn(3, 64)
    t[1] = 0
    q, s = quantize_rows(t)
    assert torch.isfinite(s).all() and (q[1].float() == 0).all()
    assert float((q.float() * s - t).abs().max()) <= float(t.abs().max()) / 16 + 1e-6


def test_quantize_dit_replaces_block_projections_only():
    torch.manual_seed(0)
    model = H3DiT(H3DiTConfig(**TINY)).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.cast(torch.bfloat16)
    from tests.unit.test_offload import inputs  # the same tiny geometry as the offload tests

    args = inputs()
    with torch.no_grad():
        want = model(*args)
    names = quantize_dit(model)
    assert len(names) == 6 * TINY["num_layers"]
    assert {n.split(".", 2)[2] for n in names} == {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                                  "ff.net.0.proj", "ff.net.2"}
    for block in model.transformer_blocks:  # AdaLN modulation and norms keep their precision
        assert type(block.adaln_proj.linear) is nn.Linear and block.adaln_proj.linear.weight.dtype == torch.bfloat16
    for name in ("proj_in", "proj_out", "audio_proj_out", "context_embedder"):
        assert type(getattr(model, name)) is nn.Linear
    assert all(type(m) is nn.Linear for m in model.token_refiner.modules() if isinstance(m, (nn.Linear, FP8Linear)))
    with torch.no_grad():
        got = model(*args)
    assert 0 < rel_l2(got[0], want[0]) < 0.1 and 0 < rel_l2(got[1], want[1]) < 0.1


def test_fp8_attention_tracks_sdpa():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 96, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    got = kernels.fp8_attention(q, k, v)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert 0 < rel_l2(got, want) < 0.06
    name, fn = kernels.resolve_attention("cpu", "fp8")
    assert fn is kernels.fp8_attention


def test_text_decoder_fp8_keeps_embeddings_norms_and_vision(tiny_checkpoint):
    pytest.importorskip("transformers")
    from h3serve.models.encoder.fp8 import quantize_text_decoder
    from h3serve.models.encoder.model import TextEncoder

    enc = TextEncoder.load(tiny_checkpoint, dtype=torch.float32)
    want = enc.encode("a red kite over the sea").states
    names = quantize_text_decoder(enc.model)
    assert len(names) == 7 * enc.num_layers and not any("visual" in n for n in names)
    assert type(enc.model.language_model.embed_tokens) is nn.Embedding
    assert all(type(m) is nn.Linear for m in enc.model.visual.modules() if isinstance(m, (nn.Linear, FP8Linear)))
    got = enc.encode("a red kite over the sea").states
    assert got.shape == want.shape and 0 < rel_l2(got, want) < 0.1


def _encoder_rank(rank: int, store: str, ckpt: str, q) -> None:
    import torch.distributed as dist

    from h3serve.models.encoder.fp8 import quantize_text_decoder
    from h3serve.models.encoder.model import TextEncoder
    from h3serve.models.encoder.parallel import RowParallelLinear, parallelize_encoder

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        enc = parallelize_encoder(TextEncoder.load(ckpt, dtype=torch.float32), dist.group.WORLD, rank, 2)
        names = quantize_text_decoder(enc.model, row_parallel=(RowParallelLinear,))
        # numpy travels by value (a tensor would travel as a file descriptor this process must outlive)
        q.put((rank, len(names), enc.encode("a red kite over the sea").states.numpy()))
    finally:
        dist.destroy_process_group()


def test_text_decoder_fp8_under_tensor_parallel_two_gloo_ranks(tiny_checkpoint, tmp_path):
    import torch.multiprocessing as mp

    from h3serve.models.encoder.model import TextEncoder

    want = TextEncoder.load(tiny_checkpoint, dtype=torch.float32)
    layers = want.num_layers
    want = want.encode("a red kite over the sea").states
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_encoder_rank, args=(k, str(tmp_path / "store"), str(tiny_checkpoint), q))
             for k in range(2)]
    for p in procs:
        p.start()
    got = [q.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    got = [(rank, n, torch.from_numpy(states)) for rank, n, states in got]
    for rank, n, states in got:
        assert n == 7 * layers  # o_proj and down_proj are the row-parallel shards, quantized too
        assert 0 < rel_l2(states, want) < 0.1, rank
    assert torch.equal(got[0][2], got[1][2])  # every rank ends with the same hidden state


def test_fp8_attention_with_lse_merges_like_one_pass():
    """Ring chunks under the FP8 lever: two key halves merged by their LSE give one pass over all keys."""
    from h3serve.models.dit.parallel import _merge

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
    full, lse_full = kernels.fp8_attention_with_lse(q, k, v)
    assert torch.allclose(full, kernels.fp8_attention(q, k, v), atol=1e-5)
    want = F.scaled_dot_product_attention(q, k, v)
    assert 0 < rel_l2(full, want) < 0.06
    o1, l1 = kernels.fp8_attention_with_lse(q, k[:, :, :32], v[:, :, :32])
    o2, l2 = kernels.fp8_attention_with_lse(q, k[:, :, 32:], v[:, :, 32:])
    out, lse = _merge(None, None, o1, l1)
    out, lse = _merge(out, lse, o2, l2)
    # the halves carry their own per-head scales: as close to exact attention as the one pass is
    assert 0 < rel_l2(out, want) < 0.06 and rel_l2(lse, lse_full) < 0.01
