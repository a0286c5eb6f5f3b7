"""The FP8 kernels that only a Hopper GPU runs, against the unfused FP8 path (skipped without one; the GPU run of
`bench/gpu_suite.sh` (`STEPS=fp8test`) runs them): SwiGLU straight to e4m3 rows, the FFN that uses it, and one
quantization shared by the attention's three projections."""

from __future__ import annotations

import pytest
import torch

from h3serve.models.dit import kernels
from h3serve.models.dit import quant
from h3serve.models.dit.model import H3FeedForward

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and quant.fp8_gemm_available("cuda")
                                     and kernels.HAVE_TRITON), reason="needs an FP8 GPU (compute capability 8.9+)")


def _proj(m: int = 4099, f: int = 14336) -> torch.Tensor:
    g = torch.Generator("cuda").manual_seed(0)
    return (torch.randn(m, 2 * f, device="cuda", generator=g) * 2).to(torch.bfloat16)


def test_swiglu_fp8_bytes_equal_quantize_rows_of_swiglu():
    p = _proj()
    p[5] = 0
    q, s = kernels.swiglu_fp8(p, quant.EPS, quant.INV_FP8_MAX)
    rq, rs = quant.quantize_rows(kernels.swiglu(p))
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def test_fp8_ffn_fused_equals_unfused_and_frees_the_swiglu_intermediate():
    torch.manual_seed(0)
    ff = H3FeedForward(5376, 14336).to("cuda", torch.bfloat16).eval()
    ff.net[0].proj.weight.data.normal_(0, 5376 ** -0.5)
    ff.net[2].weight.data.normal_(0, 14336 ** -0.5)
    quant.quantize_linears(ff, quant.re.compile(r"^net\.(0\.proj|2)$"))
    x = torch.randn(1, 8192, 5376, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        proj = ff.net[0].proj(x)
        h = kernels.swiglu(proj).reshape(-1, 14336)  # unfused: bf16 SwiGLU, then quantize_rows, then the GEMM
        want = ff.net[2].forward_rows(*quant.quantize_rows(h), lead=x.shape[:-1])
        del h
        del proj
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        got = ff(x)
        peak = torch.cuda.max_memory_allocated() - base
    assert torch.equal(got, want)
    # proj (2F bf16) + e4m3 rows + output; never the (M, F) bf16 SwiGLU on top
    m, f, d = 8192, 14336, 5376
    assert peak <= m * 2 * f * 2 + m * f + m * d * 2 + (64 << 20), peak


def test_one_quantization_for_three_projections_of_one_input(monkeypatch):
    lin = [quant.FP8Linear(torch.nn.Linear(512, 256, bias=False).to("cuda", torch.bfloat16)) for _ in range(3)]
    x = torch.randn(1, 1 << 15, 512, device="cuda", dtype=torch.bfloat16)  # 2^24 elements: the fused quantization
    calls = []
    real = quant.quantize_rows_fused
    monkeypatch.setattr(quant, "quantize_rows_fused", lambda t: calls.append(1) or real(t))
    with torch.no_grad():
        shared = [m(x) for m in lin]
        assert len(calls) == 1
        alone = []
        for m in lin:
            quant.forget_shared()
            alone.append(m(x))
        assert len(calls) == 4
        x.add_(1)  # modified in place: quantized again
        lin[0](x)
        assert len(calls) == 5
    assert all(torch.equal(a, b) for a, b in zip(shared, alone))
