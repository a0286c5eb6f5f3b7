"""FP8 attention for Ring chunks on a Hopper GPU: `attention_with_lse` under the FP8 lever against plain FP8 attention
and exact fp32 attention, and two key halves merged by their LSE. Prints one JSON line.

    python3 bench/fp8_lse_check.py
"""

from __future__ import annotations

import json

import torch

from h3serve.models.dit import kernels
from h3serve.models.dit.parallel import _merge, attention_with_lse


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kernels.choose_attention("cuda", "fp8")
    o, lse = attention_with_lse(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    lse_ref = torch.logsumexp(torch.matmul(q.float(), k.float().transpose(-1, -2)) * 128 ** -0.5, -1)
    o1, l1 = attention_with_lse(q, k[:, :, :4096], v[:, :, :4096])
    o2, l2 = attention_with_lse(q, k[:, :, 4096:], v[:, :, 4096:])
    m, ml = _merge(None, None, o1, l1)
    m, ml = _merge(m, ml, o2, l2)
    print(json.dumps({"fa3": kernels.fa3_available("cuda"), "lse_shape": list(lse.shape),
                      "out_vs_fp8_attention": rel(o, kernels.fp8_attention(q, k, v)), "out_vs_exact": rel(o, ref),
                      "lse_vs_exact": rel(lse, lse_ref), "merged_vs_exact": rel(m, ref)}))


if __name__ == "__main__":
    main()
