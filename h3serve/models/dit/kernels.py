"""DiT kernels: attention backend selection and fused element-wise Triton kernels.

Attention (every implementation takes and returns (B, H, N, Dh), no mask, scale 1/sqrt(Dh)):

* ``fa3``: FlashAttention-3 forward (PyPI ``fa3-fwd``), Hopper only. Its layout is (B, N, H, Dh); the model's q/k/v
  are (B, N, H, Dh) buffers seen through a transpose, so the transposes here are views, never copies.
* ``cudnn`` / ``flash``: ``F.scaled_dot_product_attention`` pinned to that backend.
* ``sdpa``: plain ``F.scaled_dot_product_attention`` (PyTorch picks; the CPU path).

The choice is made once per process and device type (``auto_attention``), logged once with its reason (which
``attention_choice`` returns for the DiT stage's Status), and can be forced with
``H3SERVE_ATTENTION=sdpa|cudnn|flash|fa3|fp8``. Auto: fa3 when importable on a CUDA device of compute capability
9.x, else cudnn on CUDA, else sdpa.

Fused element-wise kernels (Triton, CUDA; ``H3SERVE_FUSED=0|1``, default on for CUDA tensors when Triton imports).
Each reproduces the plain torch path's bf16 rounding steps, so the outputs equal it up to the order of the RMS
reduction:

* ``qk_norm_rope_``: per-head RMSNorm (× weight) of q and k, then rotate-half RoPE on the first 2·R/2 channels, in
  place on (B, N, H, Dh) buffers, one launch for both tensors;
* ``rms_modulate``: h = RMSNorm(x)·w·(1 + scale[row]) + shift[row];
* ``gated_residual_rms_modulate_``: x += gate[row]·y (in place), then h = RMSNorm(x)·w·(1 + scale[row]) + shift[row];
* ``gated_residual_``: x += gate[row]·y;
* ``swiglu``: value·silu(gate) of the [value | gate] projection.

``row`` is the AdaLN table row of every sequence row (``modulation_rows``): a per-row int32 index read inside the
kernels, so no (S, D) shift/scale/gate tensor is ever materialized.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger("h3serve.dit.kernels")

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ATTENTION_NAMES = ("sdpa", "cudnn", "flash", "fa3", "fp8")
HALF_DTYPES = (torch.bfloat16, torch.float16)

# ---------------------------------------------------------------------------------------------------------------------
# Attention


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, H, N, Dh) x3 -> (B, H, N, Dh), PyTorch's own backend choice."""
    return F.scaled_dot_product_attention(q, k, v)


def _pinned_sdpa(backend_name: str) -> AttentionFn:
    backend = getattr(SDPBackend, backend_name)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.dtype not in HALF_DTYPES:  # cuDNN / flash have no fp32 kernel: PyTorch's own choice then
            return F.scaled_dot_product_attention(q, k, v)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v)

    attention.__name__ = f"sdpa_{backend_name.lower()}"
    return attention


cudnn_attention = _pinned_sdpa("CUDNN_ATTENTION")
flash_attention = _pinned_sdpa("FLASH_ATTENTION")


def _fa3_func():
    from fa3_fwd_interface import flash_attn_func  # lazy: optional package (PyPI fa3-fwd); registers torch.ops.fa3_fwd

    return flash_attn_func


def fa3_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """FlashAttention-3 on (B, H, N, Dh) views of (B, N, H, Dh) buffers: the transposes are free."""
    if q.dtype not in HALF_DTYPES:  # FA3 is bf16 / fp16 only
        return F.scaled_dot_product_attention(q, k, v)
    out = _fa3_func()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    if isinstance(out, tuple):
        out = out[0]
    return out.transpose(1, 2)


def fa3_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-3 returning the softmax log-sum-exp too (for ring merges): (B, H, Nq, Dh) x (B, H, Nk, Dh) ->
    out (B, H, Nq, Dh), lse (B, H, Nq) fp32. Key/value views need only a unit stride on the last axis."""
    out, lse = _fa3_func()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), return_attn_probs=True)[:2]
    return out.transpose(1, 2), lse.float()


_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0


def _quantize_heads(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N, H, Dh) -> e4m3 (B, N, H, Dh) contiguous and the descale (B, H) fp32: one scale per batch and head."""
    amax = t.abs().amax(dim=(1, 3)).float().clamp_min(1e-12)  # (B, H)
    scale = amax / _FP8_MAX
    q8 = (t.float() / scale[:, None, :, None]).clamp_(-_FP8_MAX, _FP8_MAX).to(_FP8).contiguous()
    return q8, scale


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """FP8 (e4m3) attention, a lossy quality mode: q, k, v quantized per batch and head, FA3's FP8 forward on Hopper;
    elsewhere the same quantized operands dequantized into SDPA (same rounding of the inputs, for tests).
    (B, H, N, Dh) x3 -> (B, H, N, Dh) in q's dtype."""
    q8, sq = _quantize_heads(q.transpose(1, 2))  # (B, N, H, Dh)
    k8, sk = _quantize_heads(k.transpose(1, 2))
    v8, sv = _quantize_heads(v.transpose(1, 2))
    if q.is_cuda and fa3_available(q.device):
        out = _fa3_func()(q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv)
        if isinstance(out, tuple):
            out = out[0]
        return out.transpose(1, 2).to(q.dtype)
    deq = [(t8.float() * s[:, None, :, None]).transpose(1, 2) for t8, s in ((q8, sq), (k8, sk), (v8, sv))]
    return F.scaled_dot_product_attention(*deq).to(q.dtype)


def fp8_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_attention` returning the log-sum-exp too (a Ring chunk): (B, H, Nq, Dh) x (B, H, Nk, Dh) -> out
    (B, H, Nq, Dh) in q's dtype, lse (B, H, Nq) fp32. Off Hopper: the dequantized operands, exact fp32 math."""
    q8, sq = _quantize_heads(q.transpose(1, 2))
    k8, sk = _quantize_heads(k.transpose(1, 2))
    v8, sv = _quantize_heads(v.transpose(1, 2))
    if q.is_cuda and fa3_available(q.device):
        out, lse = _fa3_func()(q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv, return_attn_probs=True)[:2]
        return out.transpose(1, 2).to(q.dtype), lse.float()
    qf, kf, vf = [(t8.float() * s[:, None, :, None]).transpose(1, 2) for t8, s in ((q8, sq), (k8, sk), (v8, sv))]
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * qf.shape[-1] ** -0.5  # (B, H, Nq, Nk)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), vf).to(q.dtype), lse


_IMPLS: dict[str, AttentionFn] = {
    "sdpa": sdpa_attention,
    "cudnn": cudnn_attention,
    "flash": flash_attention,
    "fa3": fa3_attention,
    "fp8": fp8_attention,
}


def fa3_unavailable(device: torch.device | str | None = None) -> str | None:
    """Why FA3 cannot run on `device` (None: fa3-fwd imports and the device is a Hopper GPU, compute capability
    9.x)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        _fa3_func()
    except ModuleNotFoundError as exc:
        if exc.name == "fa3_fwd_interface":
            return "fa3-fwd not installed"
        return f"fa3-fwd does not load: {type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - built for another torch/CUDA, a missing shared library
        return f"fa3-fwd does not load: {type(exc).__name__}: {exc}"
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(dev)
    if major != 9:
        return f"{torch.cuda.get_device_name(dev)} is compute capability {major}.{minor}, FA3 needs 9.x (Hopper)"
    return None


def fa3_available(device: torch.device | str | None = None) -> bool:
    """fa3-fwd imports and the device is a Hopper GPU (compute capability 9.x)."""
    return fa3_unavailable(device) is None


def _off_cuda(device: torch.device) -> str:
    return "no CUDA device" if not torch.cuda.is_available() else f"the DiT runs on {device.type}"


def _resolve(device: torch.device, name: str | None, reason: str | None) -> tuple[str, AttentionFn, str]:
    """(name, implementation, why): `name` (chosen for `reason`), else $H3SERVE_ATTENTION, else the auto choice."""
    env = os.environ.get("H3SERVE_ATTENTION", "")
    if name:
        why = reason or f"{name} chosen"
    elif env:
        name, why = env, f"H3SERVE_ATTENTION={env}"
    else:
        name, why = "auto", ""
    name = name.lower()
    if name == "auto":
        if device.type == "cuda":
            missing = fa3_unavailable(device)
            name, why = ("fa3", "auto: fa3-fwd on a Hopper GPU") if missing is None else ("cudnn", f"auto: {missing}")
        else:
            name, why = "sdpa", f"auto: {_off_cuda(device)}"
    if name not in _IMPLS:
        raise ValueError(f"unknown attention implementation {name!r}; choose one of {ATTENTION_NAMES} or 'auto'")
    if name not in ("sdpa", "fp8") and device.type != "cuda":
        raise ValueError(f"attention {name!r} needs a CUDA device, got {device}")
    if name == "fa3":
        _fa3_func()  # fail loudly here when forced but missing
    if name == "fp8":  # the path `fp8_attention` takes on this device
        missing = fa3_unavailable(device) if device.type == "cuda" else _off_cuda(device)
        why += "; FA3's FP8 forward" if missing is None else f"; SDPA on the dequantized e4m3 operands ({missing})"
    return name, _IMPLS[name], why


def resolve_attention(device: torch.device | str, name: str | None = None) -> tuple[str, AttentionFn]:
    """The attention implementation for `device`: `name`, else $H3SERVE_ATTENTION, else the auto choice."""
    return _resolve(torch.device(device), name, None)[:2]


_CHOSEN: dict[str, tuple[str, AttentionFn]] = {}
_WHY: dict[str, str] = {}   # why each device type's choice was made (`attention_choice`)


def chosen_attention(device: torch.device | str) -> tuple[str, AttentionFn]:
    """The per-process choice for `device`'s type, made (and logged) on first use."""
    dev = torch.device(device)
    if dev.type not in _CHOSEN:
        name, fn, why = _resolve(dev, None, None)
        _CHOSEN[dev.type], _WHY[dev.type] = (name, fn), why
        log.info("DiT attention on %s: %s (%s)", dev.type, name, why)
    return _CHOSEN[dev.type]


def choose_attention(device: torch.device | str, name: str, reason: str | None = None) -> None:
    """Fix the per-process choice for `device`'s type (a deployment lever: `fp8` attention), for `reason`."""
    dev = torch.device(device)
    name, fn, why = _resolve(dev, name, reason)
    _CHOSEN[dev.type], _WHY[dev.type] = (name, fn), why
    log.info("DiT attention on %s: %s (%s)", dev.type, name, why)


def attention_choice(device: torch.device | str) -> dict[str, str]:
    """The per-process choice for `device`'s type and why, as a stage reports it: {"kernel", "reason"}."""
    dev = torch.device(device)
    name = chosen_attention(dev)[0]
    return {"kernel": name, "reason": _WHY[dev.type]}


def reset_attention_choice() -> None:
    """Forget the per-process choice (tests, or after changing $H3SERVE_ATTENTION)."""
    _CHOSEN.clear()
    _WHY.clear()


def auto_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The default `H3Attention.attention_fn`: dispatches to the per-process choice for q's device."""
    return chosen_attention(q.device)[1](q, k, v)


# ---------------------------------------------------------------------------------------------------------------------
# Fused element-wise kernels

try:  # Triton is optional: CPU-only installs may lack it
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # noqa: BLE001
    triton = tl = None
    HAVE_TRITON = False


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_fused(x: torch.Tensor) -> bool:
    """Whether the fused kernels run for `x`: $H3SERVE_FUSED=1/0 forces; default on for CUDA tensors."""
    flag = os.environ.get("H3SERVE_FUSED", "auto").lower()
    if not HAVE_TRITON or flag in ("0", "false", "off", "no"):
        return False
    if flag in ("1", "true", "on", "yes"):
        return x.is_cuda or _interpreting()
    return x.is_cuda


def modulation_rows(ctx, device: torch.device | str) -> torch.Tensor:
    """The AdaLN table row of every row of `ctx` (a `BlockContext`), int32 (S,) on `device`, cached on ctx.

    Built from the context's runs on the host (one small copy per forward) or from its per-row gather index.
    """
    cached = ctx.__dict__.get("_modulation_rows")
    if cached is not None and cached.device == torch.device(device):
        return cached
    if ctx.runs is not None:
        n = ctx.cos.shape[0]
        rows = torch.zeros(n, dtype=torch.int32)  # rows no run covers (a shard's padding) read table row 0
        for a, b, r in ctx.runs:
            rows[a:b] = r
        rows = rows.to(device, non_blocking=True)
    else:
        rows = ctx.adaln_rows.to(device=device, dtype=torch.int32)
    ctx.__dict__["_modulation_rows"] = rows
    return rows


# Kernel bodies are plain functions, jit-compiled on first use (`_kernels`), so that TRITON_INTERPRET=1 set by a
# test after import still selects Triton's interpreter. `x.to(DT).to(tl.float32)` is one rounding step of the
# plain path (torch's RMSNorm rounds once, after the weight).


def _qk_norm_rope_kernel(
    q_ptr, k_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr,
    n_rows, heads, seq, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr, DT: tl.constexpr,
):
    pid = tl.program_id(0)
    which = tl.program_id(1)
    if which == 0:
        x_ptr = q_ptr
        w_ptr = wq_ptr
    else:
        x_ptr = k_ptr
        w_ptr = wk_ptr
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # (R,) over B*N*H
    cols = tl.arange(0, HEAD_DIM)  # (D,)
    rmask = rows < n_rows
    m = rmask[:, None]
    offs = rows[:, None].to(tl.int64) * HEAD_DIM + cols[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)  # (R,)
    w = tl.load(w_ptr + cols).to(tl.float32)
    n = (x * rstd[:, None] * w[None, :]).to(DT).to(tl.float32)
    if ROPE:
        # partner channel of rotate-half: c < HALF -> c + HALF (subtracted), HALF <= c < 2*HALF -> c - HALF
        lo = cols < HALF
        rot = cols < 2 * HALF
        pcols = tl.where(lo, cols + HALF, tl.where(rot, cols - HALF, cols))
        xp = tl.load(x_ptr + rows[:, None].to(tl.int64) * HEAD_DIM + pcols[None, :], mask=m, other=0.0)
        wp = tl.load(w_ptr + pcols).to(tl.float32)
        npart = (xp.to(tl.float32) * rstd[:, None] * wp[None, :]).to(DT).to(tl.float32)
        tok = (rows // heads) % seq
        ccols = tl.where(lo, cols, cols - HALF)
        cmask = m & rot[None, :]
        coffs = tok[:, None].to(tl.int64) * HALF + ccols[None, :]
        c = tl.load(cos_ptr + coffs, mask=cmask, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + coffs, mask=cmask, other=0.0).to(tl.float32)
        a = (n * c).to(DT).to(tl.float32)
        b = (npart * s).to(DT).to(tl.float32)
        out = tl.where(lo[None, :], a - b, a + b)
        out = tl.where(rot[None, :], out, n)
    else:
        out = n
    tl.store(x_ptr + offs, out.to(DT), mask=m)


def _modulate_kernel(
    x_ptr, y_ptr, gate_ptr, w_ptr, shift_ptr, scale_ptr, rows_ptr, h_ptr,
    D, eps,
    RESIDUAL: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr,
):
    """One sequence row per program: [x += gate[r]*y]; [h = rmsnorm(x)*w*(1+scale[r]) + shift[r]]."""
    row = tl.program_id(0).to(tl.int64)
    s_idx = tl.program_id(1).to(tl.int64)  # batch index
    n_seq = tl.num_programs(0)
    r = tl.load(rows_ptr + row).to(tl.int64)
    base = (s_idx * n_seq + row) * D
    cols = tl.arange(0, BLOCK_D)
    cm = cols < D
    x = tl.load(x_ptr + base + cols, mask=cm, other=0.0).to(tl.float32)
    if RESIDUAL:
        y = tl.load(y_ptr + base + cols, mask=cm, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + r * D + cols, mask=cm, other=0.0).to(tl.float32)
        x = (x + y * g).to(DT).to(tl.float32)
        tl.store(x_ptr + base + cols, x.to(DT), mask=cm)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        n = (x * rstd * w).to(DT).to(tl.float32)
        sc = tl.load(scale_ptr + r * D + cols, mask=cm, other=0.0).to(tl.float32)
        sh = tl.load(shift_ptr + r * D + cols, mask=cm, other=0.0).to(tl.float32)
        sc1 = (1.0 + sc).to(DT).to(tl.float32)
        tl.store(h_ptr + base + cols, (sh + n * sc1).to(DT), mask=cm)


def _swiglu_kernel(p_ptr, o_ptr, F_DIM, BLOCK: tl.constexpr, DT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = cols < F_DIM
    v = tl.load(p_ptr + row * 2 * F_DIM + cols, mask=cm, other=0.0).to(tl.float32)
    g = tl.load(p_ptr + row * 2 * F_DIM + F_DIM + cols, mask=cm, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    tl.store(o_ptr + row * F_DIM + cols, (act * v).to(DT), mask=cm)


def _swiglu_fp8_kernel(p_ptr, q_ptr, s_ptr, F_DIM, EPS, INV_MAX, BLOCK: tl.constexpr, DT: tl.constexpr):
    # One row per program: SwiGLU rounded as `_swiglu_kernel` rounds it, the row's amax, then the e4m3 row (the
    # down projection's FP8 input) and its scale; the bf16 SwiGLU output is never written.
    row = tl.program_id(0).to(tl.int64)
    base = row * 2 * F_DIM
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, F_DIM, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        cm = cols < F_DIM
        v = tl.load(p_ptr + base + cols, mask=cm, other=0.0).to(tl.float32)
        g = tl.load(p_ptr + base + F_DIM + cols, mask=cm, other=0.0).to(tl.float32)
        h = ((g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32) * v).to(DT).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(h))
    scale = tl.maximum(tl.max(amax, axis=0), EPS) * INV_MAX
    tl.store(s_ptr + row, scale)
    for start in range(0, F_DIM, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        cm = cols < F_DIM
        v = tl.load(p_ptr + base + cols, mask=cm, other=0.0).to(tl.float32)
        g = tl.load(p_ptr + base + F_DIM + cols, mask=cm, other=0.0).to(tl.float32)
        h = ((g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32) * v).to(DT).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(h, scale), -448.0), 448.0)
        tl.store(q_ptr + row * F_DIM + cols, q.to(tl.float8e4nv), mask=cm)


_JIT: dict[bool, dict] = {}


def _kernels() -> dict:
    key = _interpreting()
    if key not in _JIT:
        _JIT[key] = {f.__name__: triton.jit(f) for f in (_qk_norm_rope_kernel, _modulate_kernel, _swiglu_kernel,
                                                          _swiglu_fp8_kernel)}
    return _JIT[key]


def _tl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def qk_norm_rope_(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float,
                  cos: torch.Tensor | None = None,
                  sin: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on contiguous (B, N, H, Dh) q, k: RMSNorm(·)·w per head, then RoPE on the first 2·cos.shape[-1]
    channels (cos / sin (N, R/2) in the activation dtype); no RoPE when cos is None."""
    if not (q.is_contiguous() and k.is_contiguous()) or q.shape != k.shape:
        raise ValueError("qk_norm_rope_ needs contiguous q, k of one shape")
    b, n, h, d = q.shape
    if d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two")
    rope = cos is not None
    half = cos.shape[-1] if rope else 1
    if rope:
        cos, sin = cos.contiguous(), sin.contiguous()
        if cos.shape[0] != n or 2 * half > d:
            raise ValueError(f"cos/sin {tuple(cos.shape)} do not fit q {tuple(q.shape)}")
    rows = b * n * h
    block_r = 16
    grid = (triton.cdiv(rows, block_r), 2)
    _kernels()["_qk_norm_rope_kernel"][grid](
        q, k, wq, wk, cos if rope else q, sin if rope else q, rows, h, n, float(eps),
        HEAD_DIM=d, HALF=half, ROPE=rope, BLOCK_R=block_r, DT=_tl_dtype(q.dtype), num_warps=4,
    )
    return q, k


def _row_kernel(x, y, gate, w, shift, scale, rows, eps, residual: bool, norm: bool) -> torch.Tensor | None:
    if not x.is_contiguous():
        raise ValueError("x must be contiguous (B, S, D)")
    b, s, d = x.shape
    if rows.shape[0] != s:
        raise ValueError(f"{rows.shape[0]} modulation rows for {s} sequence rows")
    h = torch.empty_like(x) if norm else None
    if y is not None:
        y = y.contiguous()
    dummy = x
    block = triton.next_power_of_2(d)
    _kernels()["_modulate_kernel"][(s, b)](
        x, y if residual else dummy, gate if residual else dummy, w if norm else dummy,
        shift if norm else dummy, scale if norm else dummy, rows, h if norm else dummy, d, float(eps),
        RESIDUAL=residual, NORM=norm, BLOCK_D=block, DT=_tl_dtype(x.dtype),
        num_warps=max(1, min(16, block // 512)),
    )
    return h


def rms_modulate(x: torch.Tensor, w: torch.Tensor, eps: float, shift: torch.Tensor, scale: torch.Tensor,
                 rows: torch.Tensor) -> torch.Tensor:
    """h = RMSNorm(x)·w·(1 + scale[rows]) + shift[rows]; x (B, S, D), shift / scale (R, D) rows of the AdaLN table
    (any row stride: views of the (R, 6, D) table are fine when its rows are contiguous), rows (S,) int32."""
    return _row_kernel(x, None, None, w, shift, scale, rows, eps, residual=False, norm=True)


def gated_residual_rms_modulate_(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float,
                                 shift: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x += gate[rows]·y in place, then h = RMSNorm(x)·w·(1 + scale[rows]) + shift[rows] (returned)."""
    return _row_kernel(x, y, gate, w, shift, scale, rows, eps, residual=True, norm=True)


def gated_residual_(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x += gate[rows]·y in place; returns x."""
    _row_kernel(x, y, gate, None, None, None, rows, 0.0, residual=True, norm=False)
    return x


def swiglu(proj: torch.Tensor) -> torch.Tensor:
    """(…, 2F) [value | gate] -> (…, F) value·silu(gate), silu rounded first like `F.silu(gate).mul_(value)`."""
    p = proj.contiguous()
    f2 = p.shape[-1]
    f = f2 // 2
    out = p.new_empty(*p.shape[:-1], f)
    m = p.numel() // f2
    block = 1024
    _kernels()["_swiglu_kernel"][(m, triton.cdiv(f, block))](p, out, f, BLOCK=block, DT=_tl_dtype(p.dtype), num_warps=4)
    return out


def swiglu_fp8(proj: torch.Tensor, eps: float, inv_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(…, 2F) [value | gate] -> the SwiGLU output quantized per row as `quant.quantize_rows` quantizes it:
    e4m3 (M, F) and fp32 scales (M, 1), M = the leading dims flattened; one pass, no bf16 (M, F) intermediate."""
    p = proj.contiguous()
    f = p.shape[-1] // 2
    m = p.numel() // (2 * f)
    q = torch.empty(m, f, dtype=torch.float8_e4m3fn, device=p.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=p.device)
    _kernels()["_swiglu_fp8_kernel"][(m,)](p, q, scale, f, eps, inv_max, BLOCK=1024, DT=_tl_dtype(p.dtype),
                                           num_warps=4)
    return q, scale


def table_rows(t: torch.Tensor) -> torch.Tensor:
    """An (R, D) view of the AdaLN table as the kernels read it: rows at stride D (a contiguous copy if needed;
    the table is tiny, R = 3·n_t rows)."""
    return t.contiguous()
