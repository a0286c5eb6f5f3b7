"""The MiniMax H3 DiT: one stack of AdaLN transformer blocks over one packed text+video+audio sequence.

Weight-compatible with diffusers' `MiniMaxH3Transformer3DModel` (same state_dict keys, shapes and order), written for
inference speed (H3_REFERENCE §2):

* AdaLN modulation is applied per segment of the packed sequence with one broadcast row of the (3*n_t, 6*D) table,
  not a per-row gather of it; a gather is the fallback for layouts whose segments are not timestep-uniform.
* RoPE cos/sin are built once per forward (fp32 angles from float64 positions cast to fp32, then cast to the
  activation dtype) and shared by every block; only the first 6*rope_freq_dim channels of a head rotate.
* The output heads run only on their own rows, and norm_out only on those rows.
* With an AdaLN table (adaln.py) the blocks and norm_out read their projections' outputs for this forward's
  timesteps from it (`BlockContext.adaln`, `out_modulation`) instead of projecting silu(temb); their weights are then
  not in the model.
* Attention is `F.scaled_dot_product_attention` on (B, H, N, Dh) behind `H3Attention.attend`, which a sequence-parallel
  plan (Ulysses / Ring) may replace from outside; the block-sparse lever (sparse.py) wraps it. Given a `RowShard`, the forward (embed, blocks, heads) runs on the
  shard's rows only and `BlockContext.shard` re-bases the per-row context onto them: the plan adds only the exchange
  around attention and the gather of the outputs.

The released checkpoint is bf16 except FP32_MODULES (and the recomputed rope.inv_freq); `H3DiT.cast` reproduces that.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from os import PathLike
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import kernels
from .quant import EPS as FP8_EPS
from .quant import INV_FP8_MAX, FP8Linear, forget_shared
from .layout import AUDIO_KINDS, NUM_TAGS, VIDEO_KINDS, PackedLayout, RowShard

# Top-level modules that stay float32 in the mixed-precision checkpoint (the rope buffer is fp32 too, but recomputed).
FP32_MODULES = ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out")

# More segments than this and the per-segment loop would cost more launches than a gather costs bandwidth.
MAX_MODULATION_RUNS = 64


@dataclass
class H3DiTConfig:
    """Field names and defaults are diffusers' (= the released model)."""

    num_attention_heads: int = 56
    attention_head_dim: int = 128
    hidden_size: int = 5376
    num_layers: int = 50
    num_refiner_layers: int = 2
    ffn_dim: int = 14336
    in_channels: int = 24
    audio_in_channels: int = 32
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 5120
    freq_dim: int = 256
    time_embed_hidden_dim: int = 5376
    time_embed_dim: int = 2688
    rope_freq_dim: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if self.rotary_dim > self.attention_head_dim:
            raise ValueError(
                f"rope rotates 6*rope_freq_dim = {self.rotary_dim} channels per head, more than "
                f"attention_head_dim = {self.attention_head_dim}"
            )

    @property
    def patch_dim(self) -> int:  # 96 = 24 channels * (1*2*2)
        return self.in_channels * math.prod(self.patch_size)

    @property
    def inner_dim(self) -> int:  # heads * head_dim (7168 > hidden 5376 in the release)
        return self.num_attention_heads * self.attention_head_dim

    @property
    def rotary_dim(self) -> int:  # rotated channels per head: [t | h | w] angles, twice (rotate-half)
        return 2 * 3 * self.rope_freq_dim

    @classmethod
    def from_dict(cls, data: dict) -> "H3DiTConfig":
        """Build from a diffusers config dict; `_class_name`, `_diffusers_version` and other `_` keys are ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in data if not k.startswith("_") and k not in known)
        if unknown:
            raise ValueError(f"unknown H3 transformer config keys {unknown}; known keys are {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_json(cls, path: str | PathLike) -> "H3DiTConfig":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["patch_size"] = list(self.patch_size)
        return d


# ---------------------------------------------------------------------------------------------------------------------
# Per-forward context shared by the blocks


@dataclass
class BlockContext:
    """What every block reads besides the hidden states, built once per forward.

    `runs` are (start, stop, adaln_row) over the rows this context covers, adaln_row = t_idx*3 + tag; when None the
    blocks gather per row with `adaln_rows` (S,) instead.
    """

    temb_act: torch.Tensor  # (n_t, E) silu(temb), fp32: every AdaLN projection reads it
    cos: torch.Tensor  # (S, 3*F) activation dtype
    sin: torch.Tensor  # (S, 3*F)
    runs: list[tuple[int, int, int]] | None
    adaln_rows: torch.Tensor | None  # (S,) int64 on device, gather fallback only
    # With an AdaLN table (adaln.py): every block's adaln_proj output (L, 3*n_t, 6, D) and norm_out.linear's
    # (n_t, 2*D) for this forward's timesteps, read instead of projecting temb_act.
    adaln: torch.Tensor | None = None
    out_modulation: torch.Tensor | None = None

    def shard(self, start: int, stop: int, rows: int | None = None) -> "BlockContext":
        """The context of rows [start, stop) (e.g. a sequence-parallel rank's shard), runs re-based to 0.

        `rows` (>= stop - start) pads the context to a buffer of that many rows: pad rows get zero cos / sin, no run
        and AdaLN table row 0 on the gather path (their outputs are never read).
        """
        pad = (rows if rows is not None else stop - start) - (stop - start)
        runs = None
        if self.runs is not None:
            runs = [(max(a, start) - start, min(b, stop) - start, r) for a, b, r in self.runs if a < stop and b > start]
        table_rows = self.adaln_rows[start:stop] if self.adaln_rows is not None else None
        cos, sin = self.cos[start:stop], self.sin[start:stop]
        if pad:
            cos, sin = (F.pad(t, (0, 0, 0, pad)) for t in (cos, sin))
            table_rows = F.pad(table_rows, (0, pad)) if table_rows is not None else None
        return replace(self, cos=cos, sin=sin, runs=runs, adaln_rows=table_rows)


# Eager modulation, two roundings or one. In bf16 / fp16 it multiplies, rounds, then adds, as the reference does
# (`h * (1 + scale) + shift`, `x + gate * y`): a fused addcmul rounds once and lands one bf16 step off in about a
# quarter of the elements, so only the reference's order makes a bf16 run on CPU bitwise the reference's. In fp32 the
# fused addcmul stays (one rounding, within 1e-7 of the reference; fp32 outputs stay what they were). The fused GPU
# kernels (kernels.py) round once in every dtype: they are held to a tolerance, not to bitwise equality.


def _two_roundings(t: torch.Tensor) -> bool:
    return t.dtype != torch.float32


def _scale_shift(h: torch.Tensor, scale1: torch.Tensor, shift: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out <- h * scale1 + shift (out may be h): the reference's rounding in bf16, one addcmul in fp32."""
    if _two_roundings(out):
        return torch.mul(h, scale1, out=out).add_(shift)
    return torch.addcmul(shift, h, scale1, out=out)


def _modulate_(h: torch.Tensor, shift: torch.Tensor, scale1: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
    """h <- h * scale1[row] + shift[row], in place; h (B, S, D), shift / scale1 (R, D) with scale1 = 1 + scale."""
    if ctx.runs is not None:
        for a, b, r in ctx.runs:
            seg = h[:, a:b]  # (B, n, D) view
            _scale_shift(seg, scale1[r], shift[r], out=seg)
        return h
    rows = ctx.adaln_rows
    return _scale_shift(h, scale1.index_select(0, rows), shift.index_select(0, rows), out=h)


def _gated_add_(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x <- x + gate * y in place: the reference's rounding in bf16, one addcmul in fp32."""
    return x.add_(gate * y) if _two_roundings(x) else x.addcmul_(y, gate)


def _add_gated_(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
    """Residual update x <- x + gate[row] * y, in place; x, y (B, S, D), gate (R, D)."""
    if ctx.runs is not None:
        for a, b, r in ctx.runs:
            _gated_add_(x[:, a:b], y[:, a:b], gate[r])
        return x
    return _gated_add_(x, y, gate.index_select(0, ctx.adaln_rows))


# ---------------------------------------------------------------------------------------------------------------------
# Building blocks


def timestep_sinusoid(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """(n_t,) clean times in [0, 1], unscaled -> (n_t, dim) [cos | sin] with omega_k = max_period^(-k/(dim//2)).

    An odd `dim` ends with one zero column, as the reference's sinusoid pads it.
    """
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / max(half, 1)
    angles = t[:, None].float() * torch.exp(exponent)[None, :]  # (n_t, half)
    return F.pad(torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1), (0, dim % 2))


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first 2*cos.shape[-1] channels of each head, in place; the rest pass through.

    x (B, N, H, Dh); cos / sin (N, R/2), the angle table's first half (its second half repeats it).
    """
    half = cos.shape[-1]
    x1 = x[..., :half]  # (B, N, H, R/2)
    x2 = x[..., half : 2 * half]
    c = cos[:, None, :]  # (N, 1, R/2) broadcast over heads
    s = sin[:, None, :]
    # Separate products (not addcmul) keep the rounding identical to the reference's x*cos + rotate_half(x)*sin.
    lo = x1 * c - x2 * s
    hi = x2 * c + x1 * s
    x1.copy_(lo)
    x2.copy_(hi)
    return x


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full bidirectional attention, no mask, scale 1/sqrt(Dh): (B, H, N, Dh) x3 -> (B, H, N, Dh)."""
    return F.scaled_dot_product_attention(q, k, v)


class H3RotaryEmbedding(nn.Module):
    """3-axis RoPE angles from (t, h, w) positions; one inv_freq (fp32, recomputed, not in the state_dict)."""

    def __init__(self, rope_freq_dim: int, rope_theta: float):
        super().__init__()
        self.rope_freq_dim, self.rope_theta = rope_freq_dim, rope_theta
        self.register_buffer("inv_freq", self._inv_freq(None), persistent=False)

    def _inv_freq(self, device) -> torch.Tensor:
        f = self.rope_freq_dim
        return 1.0 / (self.rope_theta ** (torch.arange(0, 2 * f, 2, dtype=torch.float32, device=device) / (2 * f)))

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute inv_freq in fp32 (after `to_empty`, a meta construction or a dtype cast), on `device` if given."""
        if device is None:
            device = None if self.inv_freq.is_meta else self.inv_freq.device
        self.inv_freq = self._inv_freq(device)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, 3) positions -> cos, sin (S, 3*F) in `dtype`; angles in fp32 whatever the model dtype."""
        inv_freq = self.inv_freq
        if inv_freq.is_meta or inv_freq.dtype != torch.float32:
            inv_freq = self._inv_freq(position_ids.device)  # a meta-built model loads no buffers
        angles = position_ids.to(torch.float32)[:, :, None] * inv_freq.to(position_ids.device)  # (S, 3, F)
        angles = angles.reshape(angles.shape[0], -1)  # (S, 3F): [t | h | w]
        return angles.cos().to(dtype), angles.sin().to(dtype)


class H3TimeEmbedder(nn.Module):
    """Linear -> SiLU -> Linear on the sinusoid; one embedding per distinct timestep (fp32 in the checkpoint)."""

    def __init__(self, freq_dim: int, hidden_dim: int, out_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(freq_dim, hidden_dim)
        self.linear_2 = nn.Linear(hidden_dim, out_dim)

    def forward(self, sinusoid: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(sinusoid)))


class H3Attention(nn.Module):
    """Self-attention with per-head QK RMSNorm and optional partial RoPE; no biases."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int, qk_norm_eps: float):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(hidden_size, inner, bias=False)
        self.to_k = nn.Linear(hidden_size, inner, bias=False)
        self.to_v = nn.Linear(hidden_size, inner, bias=False)
        self.norm_q = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.to_out = nn.ModuleList([nn.Linear(inner, hidden_size, bias=False)])
        # The one place attention happens: replace per instance (e.g. a Ulysses all-to-all around SDPA).
        # Default: the per-process backend choice of `kernels` (fa3 / cuDNN on CUDA, plain SDPA on CPU).
        self.attention_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = kernels.auto_attention

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, H, N, Dh) q, k, v -> (B, H, N, Dh)."""
        return self.attention_fn(q, k, v)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        b, n, _ = x.shape  # (B, N, D)
        if kernels.use_fused(x):  # one kernel: QK RMSNorm + partial RoPE, in place on the projections
            q = self.to_q(x).view(b, n, self.heads, self.head_dim)  # (B, N, H, Dh)
            k = self.to_k(x).view(b, n, self.heads, self.head_dim)
            kernels.qk_norm_rope_(q, k, self.norm_q.weight, self.norm_k.weight, self.norm_q.eps,
                                  *(rope if rope is not None else (None, None)))
        else:
            q = self.norm_q(self.to_q(x).view(b, n, self.heads, self.head_dim))  # (B, N, H, Dh)
            k = self.norm_k(self.to_k(x).view(b, n, self.heads, self.head_dim))
            if rope is not None:
                apply_rope_(q, *rope)
                apply_rope_(k, *rope)
        v = self.to_v(x).view(b, n, self.heads, self.head_dim)
        o = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, H, N, Dh)
        o = o.transpose(1, 2).reshape(b, n, self.heads * self.head_dim).to(q.dtype)  # (B, N, H*Dh)
        return self.to_out[0](o)


class _SwiGLUIn(nn.Module):
    """Holds the fused [value; gate] projection under the checkpoint name `ff.net.0.proj`."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, 2 * inner, bias=False)


class H3FeedForward(nn.Module):
    """SwiGLU: value * silu(gate), [value; gate] halves of net.0.proj, then net.2. net.1 is a weightless slot."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.net = nn.ModuleList([_SwiGLUIn(dim, inner), nn.Identity(), nn.Linear(inner, dim, bias=False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = self.net[0].proj(x)  # (B, N, 2F): [value | gate]
        down = self.net[2]
        if kernels.use_fused(proj):
            if isinstance(down, FP8Linear) and down.takes_rows(proj):  # SwiGLU straight to the FP8 GEMM's input
                forget_shared()  # x's rows: net.0 was their last reader
                rows = kernels.swiglu_fp8(proj, FP8_EPS, INV_FP8_MAX)
                del proj
                return down.forward_rows(*rows, lead=x.shape[:-1])
            h = kernels.swiglu(proj)
        else:
            value, gate = proj.chunk(2, dim=-1)  # (B, N, F) each
            h = F.silu(gate).mul_(value)
            del value, gate
        del proj  # (B, N, 2F) freed before the down projection: the block's activation peak
        return down(h)


class H3RefinerBlock(nn.Module):
    """Plain pre-norm block over the text only: no modulation, no RoPE."""

    def __init__(self, c: H3DiTConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.attn = H3Attention(c.hidden_size, c.num_attention_heads, c.attention_head_dim, c.qk_norm_eps)
        self.norm2 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.ff = H3FeedForward(c.hidden_size, c.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class H3TokenRefiner(nn.Module):
    def __init__(self, c: H3DiTConfig):
        super().__init__()
        self.refiner_blocks = nn.ModuleList([H3RefinerBlock(c) for _ in range(c.num_refiner_layers)])
        self.final_norm = nn.RMSNorm(c.hidden_size, eps=c.final_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.refiner_blocks:
            x = block(x)
        return self.final_norm(x)


class H3AdaLNModulation(nn.Module):
    """silu(temb) (n_t, E) -> table (n_t*3, 6, D), row t_idx*3 + tag.

    The 6 params: shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp.
    """

    def __init__(self, time_embed_dim: int, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.linear = nn.Linear(time_embed_dim, NUM_TAGS * 6 * hidden_size)

    def forward(self, temb_act: torch.Tensor) -> torch.Tensor:
        # SiLU was applied at temb's fp32 precision; only its result is cast down to the projection's dtype.
        return self.linear(temb_act.to(self.linear.weight.dtype)).view(-1, 6, self.hidden_size)


class H3Block(nn.Module):
    """x += gate_msa * Attn(norm1(x)*(1+scale_msa)+shift_msa); x += gate_mlp * FF(norm2(x)*(1+scale_mlp)+shift_mlp)."""

    def __init__(self, c: H3DiTConfig, layer: int = 0):
        super().__init__()
        self.layer = layer  # index in the stack: its slice of an AdaLN table
        self.norm1 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.attn = H3Attention(c.hidden_size, c.num_attention_heads, c.attention_head_dim, c.qk_norm_eps)
        self.norm2 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.ff = H3FeedForward(c.hidden_size, c.ffn_dim)
        self.adaln_proj = H3AdaLNModulation(c.time_embed_dim, c.hidden_size)  # None once an AdaLN table took it

    def forward(self, x: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
        """x (B, S, D) is updated in place and returned."""
        if ctx.adaln is not None:
            table = ctx.adaln[self.layer]  # (R, 6, D), R = 3*n_t: the table's rows for this forward
        else:
            table = self.adaln_proj(ctx.temb_act)  # (R, 6, D)
        if kernels.use_fused(x):
            return self._forward_fused(x, table, ctx)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table.unbind(1)  # (R, D) each
        h = _modulate_(self.norm1(x), shift_msa, 1.0 + scale_msa, ctx)
        _add_gated_(x, self.attn(h, (ctx.cos, ctx.sin)), gate_msa, ctx)
        h = _modulate_(self.norm2(x), shift_mlp, 1.0 + scale_mlp, ctx)
        _add_gated_(x, self.ff(h), gate_mlp, ctx)
        return x

    def _forward_fused(self, x: torch.Tensor, table: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
        """The same block with fused norm+modulate and gate+residual(+norm+modulate) kernels."""
        rows = kernels.modulation_rows(ctx, x.device)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = map(kernels.table_rows, table.unbind(1))
        h = kernels.rms_modulate(x, self.norm1.weight, self.norm1.eps, shift_msa, scale_msa, rows)
        y = self.attn(h, (ctx.cos, ctx.sin))
        h = kernels.gated_residual_rms_modulate_(x, y, gate_msa, self.norm2.weight, self.norm2.eps, shift_mlp,
                                                 scale_mlp, rows)
        return kernels.gated_residual_(x, self.ff(h), gate_mlp, rows)


class H3OutputNorm(nn.Module):
    """RMSNorm then (shift, scale) chosen per timestep only (no modality index)."""

    def __init__(self, hidden_size: int, time_embed_dim: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.linear = nn.Linear(time_embed_dim, 2 * hidden_size)

    def project(self, temb_act: torch.Tensor) -> torch.Tensor:
        """(n_t, E) -> (n_t, 2*D): the part an AdaLN table stores."""
        return self.linear(temb_act.to(self.linear.weight.dtype))

    @staticmethod
    def table(projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_t, 2*D) `project` output -> shift, 1 + scale, each (n_t, D)."""
        shift, scale = projected.chunk(2, dim=-1)
        return shift, 1.0 + scale


# ---------------------------------------------------------------------------------------------------------------------
# The model


@dataclass
class _RowPlan:
    """Host-side description of one forward's rows (pure Python ints)."""

    runs: list[tuple[int, int, int]] | None  # (start, stop, adaln_row) over the sequence
    video: list[tuple[int, int, int]] | None  # (start, stop, t_idx) of the video rows, in video_indices order
    audio: list[tuple[int, int, int]] | None


class H3DiT(nn.Module):
    FP32_MODULES = FP32_MODULES
    # Levers set from outside (off by default): a LayerwiseOffload (offload.py) streams the blocks; a StepReuse
    # (reuse.py) decides per forward which blocks run; an AdaLNTable (adaln.py) holds the AdaLN projections' outputs.
    block_runner = None
    step_policy = None
    adaln_table = None
    sparse = None  # a SparseAttention (sparse.py): block-sparse attention past a request's first steps

    def __init__(self, config: H3DiTConfig):
        super().__init__()
        c = self.config = config
        # Creation order = diffusers' state_dict order, so a streamed checkpoint reads front to back.
        self.proj_in = nn.Linear(c.patch_dim, c.hidden_size)
        self.audio_proj_in = nn.Linear(c.audio_in_channels, c.hidden_size)
        self.context_embedder = nn.Linear(c.text_dim, c.hidden_size)
        self.time_embedder = H3TimeEmbedder(c.freq_dim, c.time_embed_hidden_dim, c.time_embed_dim)
        self.rope = H3RotaryEmbedding(c.rope_freq_dim, c.rope_theta)
        self.token_refiner = H3TokenRefiner(c)
        self.transformer_blocks = nn.ModuleList([H3Block(c, i) for i in range(c.num_layers)])
        self.norm_out = H3OutputNorm(c.hidden_size, c.time_embed_dim, c.final_norm_eps)
        self.proj_out = nn.Linear(c.hidden_size, c.patch_dim)
        self.audio_proj_out = nn.Linear(c.hidden_size, c.audio_in_channels)

    # -- precision ------------------------------------------------------------------------------------------------

    @staticmethod
    def is_fp32_param(name: str) -> bool:
        """Whether a state_dict key belongs to a module the checkpoint keeps in fp32."""
        return name.split(".", 1)[0] in FP32_MODULES

    def cast(self, dtype: torch.dtype) -> "H3DiT":
        """Cast to `dtype` (e.g. bf16) keeping FP32_MODULES and rope.inv_freq in fp32, like the released checkpoint."""
        for name, child in self.named_children():
            child.to(torch.float32 if name in FP32_MODULES or name == "rope" else dtype)
        self.rope.reset_buffers()
        return self

    def init_buffers(self, device: torch.device | str | None = None) -> "H3DiT":
        """Recompute the non-persistent buffers (rope.inv_freq); call after `to_empty()` or a meta-device load."""
        self.rope.reset_buffers(device)
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The block stack's dtype (the residual stream follows the text projection's)."""
        return self.context_embedder.weight.dtype

    # -- forward --------------------------------------------------------------------------------------------------

    def forward(
        self,
        video_rows: torch.Tensor,
        audio_rows: torch.Tensor,
        text_states: torch.Tensor,
        timesteps: torch.Tensor,
        timestep_indices: torch.Tensor,
        layout: PackedLayout,
        shard: RowShard | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Velocities of every video and audio row (with a `shard`: of the shard's own rows only).

        video_rows (B, Nv, 96), audio_rows (B, Na, 32), text_states (B, L, text_dim); timesteps (n_t,) distinct clean
        times in [0, 1] and timestep_indices (S,) into them (CPU is best for both: the segment plan is built and an
        AdaLN table is looked up on the host);
        layout ideally already on the model's device (it is moved otherwise).
        Returns (B, Nv, 96) and (B, Na, 32) in the heads' dtype (fp32 when cast); with a shard, (B, v1 - v0, 96) and
        (B, a1 - a0, 32) for its `video` / `audio` ranges, and attention must see every shard (a sequence-parallel
        `attention_fn`).
        """
        device = self.context_embedder.weight.device
        layout = layout.to(device)  # no-op when the caller already moved it (the loop does, once)
        if self.sparse is not None:
            self.sparse.forward(layout)  # one forward = one step: the router's step count and row groups
        x, ctx, plan = self.embed(video_rows, audio_rows, text_states, timesteps, timestep_indices, layout, shard)
        x = self.step_policy.run(self, x, ctx) if self.step_policy is not None else self.run_blocks(x, ctx)
        return self.heads(x, ctx, plan, timestep_indices, layout, shard)

    def plan_rows(self, timestep_indices: torch.Tensor, layout: PackedLayout) -> _RowPlan:
        """Per-segment plan; None parts mean "gather per row" (segments not uniform in timestep, or too many)."""
        ti = timestep_indices.to("cpu", torch.long)  # one host sync per forward if the caller passed a device tensor
        if ti.shape[0] != layout.seq_len:
            raise ValueError(f"timestep_indices has {ti.shape[0]} rows, the layout {layout.seq_len}")
        seg_t = []
        for seg in layout.segments:
            t = int(ti[seg.start])
            if seg.stop - seg.start > 1 and not bool((ti[seg.start : seg.stop] == t).all()):
                return _RowPlan(None, None, None)
            seg_t.append(t)
        runs: list[tuple[int, int, int]] = []
        for seg, t in zip(layout.segments, seg_t):
            row = t * NUM_TAGS + seg.tag
            if runs and runs[-1][1] == seg.start and runs[-1][2] == row:
                runs[-1] = (runs[-1][0], seg.stop, row)  # merge neighbours with the same modulation row
            else:
                runs.append((seg.start, seg.stop, row))
        video = [(s.start, s.stop, t) for s, t in zip(layout.segments, seg_t) if s.kind in VIDEO_KINDS]
        audio = [(s.start, s.stop, t) for s, t in zip(layout.segments, seg_t) if s.kind in AUDIO_KINDS]
        return _RowPlan(runs if len(runs) <= MAX_MODULATION_RUNS else None, video, audio)

    def embed(
        self,
        video_rows: torch.Tensor,
        audio_rows: torch.Tensor,
        text_states: torch.Tensor,
        timesteps: torch.Tensor,
        timestep_indices: torch.Tensor,
        layout: PackedLayout,
        shard: RowShard | None = None,
    ) -> tuple[torch.Tensor, BlockContext, _RowPlan]:
        """Project and pack the three streams into x (B, S, D); build the per-forward block context.

        With a `shard`: x (B, shard.rows, D) holds rows [start, stop) then zero padding, only those rows are projected
        and the context covers them (the text refiner still runs over the whole text, L << S).
        """
        own = shard if shard is not None else RowShard.whole(layout)
        d = self.config.hidden_size
        b = text_states.shape[0]
        if video_rows.shape[1] != layout.num_video_rows or audio_rows.shape[1] != layout.num_audio_rows:
            raise ValueError(
                f"got {video_rows.shape[1]} video / {audio_rows.shape[1]} audio rows, the layout has "
                f"{layout.num_video_rows} / {layout.num_audio_rows}"
            )
        text = self.token_refiner(self.context_embedder(text_states.to(self.context_embedder.weight.dtype)))
        dtype = text.dtype  # the text stream sets the residual dtype (bf16 when cast)
        (t0, t1), (v0, v1), (a0, a1) = own.text, own.video, own.audio
        video = self.proj_in(video_rows[:, v0:v1].to(self.proj_in.weight.dtype)).to(dtype)  # (B, Nv, D)
        audio = self.audio_proj_in(audio_rows[:, a0:a1].to(self.audio_proj_in.weight.dtype)).to(dtype)  # (B, Na, D)

        x = torch.empty(b, own.rows, d, dtype=dtype, device=text.device)  # (B, S, D); every own row is written below
        x[:, own.stop - own.start :].zero_()  # a shard's padding rows, if any
        x.index_copy_(1, layout.text_indices[t0:t1] - own.start, text[:, t0:t1])
        x.index_copy_(1, layout.video_indices[v0:v1] - own.start, video)
        x.index_copy_(1, layout.audio_indices[a0:a1] - own.start, audio)

        temb_act = self.temb_act(timesteps.to(x.device))  # (n_t, E)
        adaln = out_modulation = None
        if self.adaln_table is not None:
            adaln, out_modulation = self.adaln_table.lookup(timesteps, temb_act)
        cos, sin = self.rope(layout.position_ids, dtype)  # (S, 3F) each, once per forward
        plan = self.plan_rows(timestep_indices, layout)
        rows = None
        if plan.runs is None:
            rows = timestep_indices.to(x.device, torch.long) * NUM_TAGS + layout.token_tags
        ctx = BlockContext(temb_act=temb_act, cos=cos, sin=sin, runs=plan.runs, adaln_rows=rows, adaln=adaln,
                           out_modulation=out_modulation)
        if shard is not None:
            ctx = ctx.shard(shard.start, shard.stop, shard.rows)
        return x, ctx, plan

    def temb_act(self, timesteps: torch.Tensor) -> torch.Tensor:
        """(n_t,) clean times on the model's device -> silu(temb) (n_t, E): the one input of every AdaLN projection."""
        sinusoid = timestep_sinusoid(timesteps, self.config.freq_dim)  # (n_t, freq_dim) fp32
        return F.silu(self.time_embedder(sinusoid.to(self.time_embedder.linear_1.weight.dtype)))

    def run_blocks(self, x: torch.Tensor, ctx: BlockContext, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Blocks [start, stop) on x (B, S, D), in place."""
        if self.block_runner is not None:
            return self.block_runner.run(x, ctx, start, stop)
        for block in self.transformer_blocks[start:stop]:
            x = block(x, ctx)
        return x

    def heads(
        self,
        x: torch.Tensor,
        ctx: BlockContext,
        plan: _RowPlan,
        timestep_indices: torch.Tensor,
        layout: PackedLayout,
        shard: RowShard | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """norm_out + proj_out on the video rows only, norm_out + audio_proj_out on the audio rows only.

        With a `shard`, x holds its rows (as `embed` packed them) and only its own video / audio rows are computed.
        """
        own = shard if shard is not None else RowShard.whole(layout)
        start, stop = own.start, own.stop
        projected = ctx.out_modulation if ctx.out_modulation is not None else self.norm_out.project(ctx.temb_act)
        shift, scale1 = self.norm_out.table(projected)  # (n_t, D) each
        outs = []
        for runs, indices, (j0, j1), proj in (
            (plan.video, layout.video_indices, own.video, self.proj_out),
            (plan.audio, layout.audio_indices, own.audio, self.audio_proj_out),
        ):
            if runs is not None:
                h = x.new_empty(x.shape[0], j1 - j0, x.shape[2])  # (B, N_mod, D)
                o = 0
                for a, b, t in runs:
                    a, b = max(a, start), min(b, stop)  # the run's rows inside the shard
                    if a >= b:
                        continue
                    seg = h[:, o : o + b - a]
                    _scale_shift(self.norm_out.norm(x[:, a - start : b - start]), scale1[t], shift[t], out=seg)
                    o += b - a
            else:
                mine = indices[j0:j1]
                t_rows = timestep_indices.to(x.device, torch.long).index_select(0, mine)
                h = self.norm_out.norm(x.index_select(1, mine - start))
                h = _scale_shift(h, scale1.index_select(0, t_rows), shift.index_select(0, t_rows), out=h)
            outs.append(proj(h.to(proj.weight.dtype)))
        return outs[0], outs[1]
