"""Online FP8 (Hopper): linear layers with e4m3 weights and per-output-channel scales, activations quantized per
row at run time, one `torch._scaled_mm` row-wise GEMM (fp32 accumulate, bf16 out).

    w (N, K) -> w8 = round_e4m3(w / s_w), s_w = amax_row(w) / 448          (N, 1) fp32, once at load
    x (M, K) -> x8 = round_e4m3(x / s_x), s_x = amax_row(x) / 448          (M, 1) fp32, every call
    y = (x8 @ w8^T) * s_x * s_w^T (+ bias)

What is quantized is chosen by name (`DIT_FP8_LINEARS`, `ENCODER_FP8_LINEARS`): the attention and FFN projections
of the DiT's blocks and of the Qwen3-VL text decoder's layers. Embeddings, norms, RoPE, the AdaLN modulation
projections, the input / output heads, the text refiner, the vision tower and both VAEs keep their precision.

Without a Hopper GPU (or on the CPU) the same FP8 weights and activations are dequantized and multiplied in fp32:
the same rounding of the operands, for tests; `fp8_gemm_available` says which path runs.
"""

from __future__ import annotations

import logging
import os
import re
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger("h3serve.dit.quant")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn
INV_FP8_MAX = 1.0 / FP8_MAX  # scales are amax x this (fp32), in torch and in the fused kernels alike
EPS = 1e-12  # an all-zero row gets scale eps / 448, not 0

# Module names (relative to the DiT / the encoder model) whose nn.Linear becomes FP8Linear.
DIT_FP8_LINEARS = re.compile(r"^transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))$")
ENCODER_FP8_LINEARS = re.compile(r"(^|\.)language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$")


def fp8_gemm_available(device: torch.device | str) -> bool:
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) -> e4m3 (..., K) and fp32 scales (..., 1), one per row."""
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp_min(EPS)
    scale = amax * INV_FP8_MAX  # a product, not a division: what torch's CUDA division by a scalar computes anyway
    return (t.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


_COMPILED = None  # the activation quantization as one fused kernel (torch.compile), built on first CUDA use
# Below this many elements the compiled call's fixed host cost (guards, launch) exceeds what fusing saves: a
# 256-token encoder activation stays eager, a DiT activation (73,642 x 5,376 and up) is fused.
FUSE_MIN_ELEMENTS = 1 << 24


def quantize_rows_fused(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of a CUDA activation as one compiled kernel (read once, write e4m3 + scales; no fp32
    temporaries), falling back to the eager ops if compilation fails. H3SERVE_FP8_COMPILE=0 keeps the eager ops."""
    global _COMPILED
    if t.numel() < FUSE_MIN_ELEMENTS:
        return quantize_rows(t)
    if _COMPILED is None:
        if os.environ.get("H3SERVE_FP8_COMPILE", "1") == "0":
            _COMPILED = quantize_rows
        else:
            _COMPILED = torch.compile(quantize_rows, dynamic=True)
    try:
        return _COMPILED(t)
    except Exception as exc:  # noqa: BLE001 - no compiler on this host: the same numbers, eagerly
        log.warning("FP8 activation quantization: compile failed (%s: %s); using eager ops", type(exc).__name__, exc)
        _COMPILED = quantize_rows
        return quantize_rows(t)


_LAST: list = [None]  # (weakref to an activation, its version, its rows): to_q / to_k / to_v share one input


def forget_shared() -> None:
    """Drop the shared rows once their activation has no further FP8 reader (the FFN's input after net.0)."""
    _LAST[0] = None


def _shared_rows(x: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_fused(x2)`, computed once for consecutive calls on the same, unmodified activation `x` (the
    attention's three projections read one normalized input): the same bytes, a third of the passes."""
    try:
        version = x._version
    except RuntimeError:  # an inference-mode tensor keeps no version: no sharing
        return quantize_rows_fused(x2)
    last = _LAST[0]
    if last is not None and last[0]() is x and last[1] == version:
        return last[2]
    _LAST[0] = None  # the previous activation's rows are not kept past their use
    rows = quantize_rows_fused(x2)
    _LAST[0] = (weakref.ref(x, lambda _: _LAST.__setitem__(0, None)), version, rows)
    return rows


class FP8Linear(nn.Module):
    """A drop-in for nn.Linear (same call, out dtype = the original weight's); weight (N, K) e4m3 + scale (N, 1)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = w.dtype  # the layer's output keeps the precision it had
        w8, s = quantize_rows(w)
        self.weight = nn.Parameter(w8, requires_grad=False)  # (N, K) e4m3
        self.register_buffer("weight_scale", s)  # (N, 1) fp32
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(self.out_dtype),
                                                                  requires_grad=False)

    def takes_rows(self, x: torch.Tensor) -> bool:
        """Whether `forward_rows` runs for an activation like `x` (the GEMM path: Hopper or newer)."""
        return x.is_cuda and fp8_gemm_available(x.device)

    def forward_rows(self, x8: torch.Tensor, sx: torch.Tensor, lead: tuple) -> torch.Tensor:
        """The product of an input already quantized per row (e4m3 (M, K), fp32 scales (M, 1)) -> (*lead, N)."""
        y = torch._scaled_mm(x8, self.weight.t(), scale_a=sx, scale_b=self.weight_scale.t(), bias=self.bias,
                             out_dtype=self.out_dtype)  # (M, N)
        return y.view(*lead, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # (..., K)
        x2 = x.reshape(-1, shape[-1])  # (M, K)
        if self.takes_rows(x):
            return self.forward_rows(*_shared_rows(x, x2), lead=shape[:-1])
        x8, sx = quantize_rows(x2)
        y = F.linear(x8.float() * sx, self.weight.float() * self.weight_scale)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(self.out_dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, e4m3 row-wise, out={self.out_dtype}"


def quantize_linears(model: nn.Module, pattern: re.Pattern) -> list[str]:
    """Replace every nn.Linear whose qualified name matches `pattern` by an FP8Linear (in place, module by module:
    the bf16 weight is freed as its FP8 copy is made); returns the names replaced."""
    # exactly nn.Linear: a subclass (or a parallel linear) may do more in its forward than the product
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and pattern.search(n)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FP8Linear(getattr(parent, child)))
    return names


def quantize_dit(model: nn.Module) -> list[str]:
    return quantize_linears(model, DIT_FP8_LINEARS)


def weight_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
