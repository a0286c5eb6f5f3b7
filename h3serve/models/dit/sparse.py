"""Block-sparse attention (`--sparse-attention PCT`): a training-free block router and one block-sparse kernel.

Lossy, off by default. In the spirit of SGLang's SubBlock router for H3 (the first steps dense, scores in fp32 from
pooled cells, per packed segment), with 128-row blocks where SubBlock has 64 (measured: see `SparseConfig.block`):

* the packed sequence is cut into `block`-row blocks (the last one partial), each into `cells` cells; q and k are
  mean-pooled per cell in fp32 and a (query block, key block) pair is scored by the log-sum-exp of its cells'
  pooled, scaled dot products (an estimate of the block's unnormalized softmax mass; one mean per block averages
  away what decides which keys a query wants), per batch and head;
* per query block and per key group (video rows, audio rows) the top ceil(density × blocks of that group) key blocks
  are kept, so neither modality starves the other; key blocks holding a text row, the query block's own block and
  every key block of a query block holding a text row are always kept (text conditions everything);
* the first `dense_fraction` of a request's steps (10 of 50) and sequences under `min_rows` rows run dense.

The block mask is executed by FlashAttention-4's block-sparse forward (PyPI ``flash-attn-4``, Hopper and later)
where it imports, else by `masked_attention` (SDPA over the token mask built from the block mask, a slice of query
rows at a time: the CPU path and the reference). Either way the output equals dense attention with that block mask
applied. With Ulysses each rank routes its own heads over the whole sequence (the exchange puts every row on every
rank; the padding of the last shard sits at the end); Ring attention is refused with it. Step reuse composes: the
router runs on whichever blocks a step computes.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .layout import AUDIO_KINDS, PackedLayout

log = logging.getLogger("h3serve.dit.sparse")

# Row groups of the router: text rows (always attended), video rows (targets, conditions, image references), audio.
TEXT, VIDEO, AUDIO = 0, 1, 2
KEY_GROUPS = (VIDEO, AUDIO)  # the groups whose key blocks are chosen by score (text key blocks are always kept)
SPARSE_KERNELS = ("fa4", "sdpa")

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SparseConfig:
    """density: kept fraction of each query block's scored key blocks, per key group; block: rows per block;
    dense_fraction: leading fraction of a request's steps that run dense; min_rows: shorter sequences run dense."""

    density: float
    block: int = 128  # measured: FA4's Hopper forward at 64-row blocks (64 x 64 tiles) ran 1.47x slower per kept pair
    cells: int = 4  # cells per block on each side (32-row cells)
    dense_fraction: float = 0.2
    min_rows: int = 4096

    def __post_init__(self) -> None:
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"sparse attention density {self.density} must be in (0, 1]")
        if self.block < 16 or self.block % 16 or self.cells < 1 or self.block % self.cells:
            raise ValueError(f"sparse attention block {self.block} must be a multiple of 16 and of its cells "
                             f"({self.cells})")
        if not 0.0 <= self.dense_fraction <= 1.0:
            raise ValueError(f"sparse attention dense_fraction {self.dense_fraction} must be in [0, 1]")

    def dense_steps(self, num_steps: int) -> int:
        """Leading steps that run dense: 10 of 50, 1 of FastH3's 4."""
        return math.ceil(self.dense_fraction * num_steps - 1e-9)


def row_groups(layout: PackedLayout) -> torch.Tensor:
    """(S,) int8 router group of every packed row: TEXT, VIDEO (video / condition video) or AUDIO."""
    groups = torch.full((layout.seq_len,), VIDEO, dtype=torch.int8)
    for seg in layout.segments:
        if seg.kind == "text":
            groups[seg.start:seg.stop] = TEXT
        elif seg.kind in AUDIO_KINDS:
            groups[seg.start:seg.stop] = AUDIO
    return groups


def _pool(x: torch.Tensor, cell: int) -> torch.Tensor:
    """(B, H, N, D) -> fp32 cell means (B, H, ceil(N / cell), D), the last cell over its own rows. Summed in fp32
    straight from x's own layout (a (B, N, H, D) view as attention hands it over): no fp32 or contiguous copy of q / k,
    which was most of the router's time."""
    n = x.shape[2]
    full = n // cell
    means = []
    if full:
        means.append(x[:, :, :full * cell].unflatten(2, (full, cell)).sum(dim=3, dtype=torch.float32).div_(cell))
    if full * cell < n:
        means.append(x[:, :, full * cell:].sum(dim=2, keepdim=True, dtype=torch.float32).div_(n - full * cell))
    return means[0] if len(means) == 1 else torch.cat(means, dim=2)


def _cells(x: torch.Tensor, block: int, cells: int) -> tuple[torch.Tensor, int]:
    """Cell means padded to whole blocks, (B, H, nb, cells, D), and how many cells of the last block hold rows."""
    cell = block // cells
    pooled = _pool(x, cell)
    nc = pooled.shape[2]
    nb = -(-x.shape[2] // block)
    pooled = F.pad(pooled, (0, 0, 0, nb * cells - nc))
    return pooled.view(*pooled.shape[:2], nb, cells, -1), nc - (nb - 1) * cells


def block_scores(q: torch.Tensor, k: torch.Tensor, block: int, cells: int, heads_at_once: int = 8) -> torch.Tensor:
    """(B, H, nq, nk) fp32: log Σ over the block pair's cell pairs of exp(mean q cell · mean k cell / sqrt(D)); cells
    past the sequence end take no part. A few heads at a time (the cell-pair matrix is cells² times the block one)."""
    scale = q.shape[-1] ** -0.5
    qc, q_last = _cells(q, block, cells)  # (B, H, nq, c, D)
    kc, k_last = _cells(k, block, cells)
    b, h, nq = qc.shape[:3]
    nk = kc.shape[2]
    out = torch.empty(b, h, nq, nk, device=q.device)
    for h0 in range(0, h, heads_at_once):
        h1 = min(h, h0 + heads_at_once)
        s = torch.matmul(qc[:, h0:h1].flatten(2, 3), kc[:, h0:h1].flatten(2, 3).transpose(-1, -2)) * scale
        s = s.view(b, h1 - h0, nq, cells, nk, cells)
        s[:, :, -1, q_last:] = float("-inf")  # the last blocks' empty cells
        s[..., -1, k_last:] = float("-inf")
        # over the key cells (contiguous), then over the query cells: no permuted copy of the pair matrix
        out[:, h0:h1] = torch.logsumexp(torch.logsumexp(s, dim=-1), dim=3)
    return out


def block_groups(groups: torch.Tensor, n: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of the first n rows (rows past len(groups): padding, VIDEO): (its group, whether it holds a text
    row). A block's group is TEXT if any row is text, else its first row's."""
    g = groups[:n].to(torch.int64)
    if g.shape[0] < n:
        g = F.pad(g, (0, n - g.shape[0]), value=VIDEO)
    nb = -(-n // block)
    padded = F.pad(g, (0, nb * block - n), value=VIDEO).view(nb, block)
    has_text = (padded == TEXT).any(dim=1)
    first = padded[:, 0]
    return torch.where(has_text, torch.full_like(first, TEXT), first), has_text


def route(q: torch.Tensor, k: torch.Tensor, groups: torch.Tensor, config: SparseConfig) -> torch.Tensor:
    """The block mask (B, H, nq, nk) bool of q (B, H, Nq, D) over k (B, H, Nk, D); `groups` the packed rows' router
    groups (`row_groups`) on q's device. Query rows past len(groups) are padding (a Ulysses tail): they take no part
    in the pooling, and a block of padding alone reads every key block (its output is never read)."""
    block = config.block
    n_q = q.shape[2]
    real = min(n_q, groups.shape[0])
    scores = block_scores(q[:, :, :real], k, block, config.cells)  # (B, H, nq, nk) fp32
    nq, nk = scores.shape[-2:]
    _, q_text = block_groups(groups, real, block)
    k_group, k_text = block_groups(groups, k.shape[2], block)
    mask = torch.zeros_like(scores, dtype=torch.bool)
    for g in KEY_GROUPS:
        members = k_group == g
        count = int(members.sum())
        if count == 0:
            continue
        keep = min(count, math.ceil(config.density * count - 1e-9))
        top = scores.masked_fill(~members, float("-inf")).topk(keep, dim=-1).indices
        mask.scatter_(-1, top, True)
    mask |= k_text  # text key blocks: every query block reads the prompt
    mask |= q_text[:, None]  # text query blocks read everything
    diag = torch.arange(min(nq, nk), device=q.device)
    mask[..., diag, diag] = True  # each block reads itself
    pad_blocks = -(-n_q // block) - nq
    if pad_blocks:
        mask = torch.cat([mask, mask.new_ones(*mask.shape[:2], pad_blocks, nk)], dim=2)
    return mask


def token_mask(block_mask: torch.Tensor, nq: int, nk: int, block: int, q0: int = 0) -> torch.Tensor:
    """(B, H, nqb, nkb) block mask -> (B, H, nq, nk) token mask of query rows [q0, q0 + nq)."""
    rows = torch.arange(q0, q0 + nq, device=block_mask.device) // block
    cols = torch.arange(nk, device=block_mask.device) // block
    return block_mask[:, :, rows][..., cols]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor, block: int,
                     max_elements: int = 1 << 27) -> torch.Tensor:
    """Attention of q (B, H, Nq, D) over k, v (B, H, Nk, D) with the block mask applied (scale 1/sqrt(D)): SDPA over
    the token mask, a slice of query rows at a time so that no mask slice exceeds `max_elements`. The reference and
    the CPU path (every query block keeps at least its own key block, so no row is fully masked)."""
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    out = torch.empty_like(q)
    step = max(block, (max_elements // max(1, b * h * nk)) // block * block)
    for a in range(0, nq, step):
        z = min(nq, a + step)
        m = token_mask(block_mask, z - a, nk, block, a)
        out[:, :, a:z] = F.scaled_dot_product_attention(q[:, :, a:z], k, v, attn_mask=m)
    return out


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor,
                        block: int) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(D) with the masked pairs at -inf) v in fp32, written out: what every kernel must equal."""
    scores = torch.matmul(q.double(), k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~token_mask(block_mask, q.shape[2], k.shape[2], block), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.double()).to(q.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# The block-sparse kernel


def _fa4():
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # lazy: optional package (PyPI flash-attn-4)
    from flash_attn.cute.interface import flash_attn_func

    return flash_attn_func, BlockSparseTensorsTorch


def fa4_unavailable(device: torch.device) -> str | None:
    """Why FlashAttention-4's block-sparse forward cannot run on `device` (None: it can)."""
    if device.type != "cuda":
        return f"the DiT runs on {device.type}"
    try:
        _fa4()
    except Exception as exc:  # noqa: BLE001 - not installed, or built for another CUDA
        return f"flash-attn-4 does not load: {type(exc).__name__}: {exc}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"compute capability {major}.{minor}; FlashAttention-4 needs 9.x or later"
    return None


def block_indices(block_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, nq, nk) bool -> kept key blocks per query block: counts (B, H, nq) int32 and indices (B, H, nq, nk)
    int32, kept ones first in ascending order."""
    counts = block_mask.sum(dim=-1, dtype=torch.int32)
    order = torch.sort((~block_mask).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return counts, order.contiguous()


def fa4_block_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor,
                     block: int) -> torch.Tensor:
    """FlashAttention-4's block-sparse forward on (B, H, N, D) views of (B, N, H, D) buffers; the kept blocks are
    passed as its partially masked blocks with no mask function (only the sequence end masks inside them)."""
    flash_attn_func, tensors = _fa4()
    counts, idx = block_indices(block_mask)
    # No fully unmasked list: its counts are zero (the Hopper forward indexes the list even then, so it is given).
    sparse = tensors(mask_block_cnt=counts, mask_block_idx=idx, full_block_cnt=torch.zeros_like(counts),
                     full_block_idx=torch.zeros_like(idx), block_size=(block, block))
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_sparse_tensors=sparse)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2)


def choose_kernel(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """(kernel, why): $H3SERVE_SPARSE_KERNEL=fa4|sdpa forces; else fa4 where it loads (bf16 / fp16), else sdpa."""
    forced = os.environ.get("H3SERVE_SPARSE_KERNEL", "").lower()
    if forced:
        if forced not in SPARSE_KERNELS:
            raise ValueError(f"H3SERVE_SPARSE_KERNEL={forced!r}: choose one of {SPARSE_KERNELS}")
        return forced, f"H3SERVE_SPARSE_KERNEL={forced}"
    missing = fa4_unavailable(device)
    if missing is None and dtype in (torch.bfloat16, torch.float16):
        return "fa4", "FlashAttention-4 block-sparse forward"
    return "sdpa", f"masked SDPA ({missing or f'{dtype} activations'})"


class SparseAttention:
    """The lever's per-model state: which forward of the request this is and the packed rows' groups.

    `begin(num_steps)` before a request's first forward, `forward(layout)` at the start of each forward (H3DiT does
    it), `attend(q, k, v, dense)` in place of the dense kernel `dense`."""

    def __init__(self, config: SparseConfig):
        self.config = config
        self.kernel: str | None = None
        self.why = ""
        self.last: dict | None = None
        self.begin(0)

    def begin(self, num_steps: int) -> None:
        self.num_steps, self.step = num_steps, -1
        self.sparse_forwards = 0
        self._kept: torch.Tensor | None = None  # the kept fraction of block pairs, summed over sparse calls
        self._calls = 0
        self._groups: torch.Tensor | None = None
        self._layout: PackedLayout | None = None

    def end(self) -> dict:
        """After a request: its report (kept as `last`), then forwards outside a request run dense."""
        self.last = self.report()
        self.begin(0)
        return self.last

    def forward(self, layout: PackedLayout) -> None:
        """Called once per DiT forward (= one denoising step)."""
        self.step += 1
        if self._layout is not layout:
            self._layout, self._groups = layout, None
        if self.active():
            self.sparse_forwards += 1

    def active(self) -> bool:
        """Whether this forward routes: past the dense steps (a forward outside a request: never) and long enough."""
        if self._layout is None or self._layout.seq_len < self.config.min_rows or self.num_steps == 0:
            return False
        return self.step >= self.config.dense_steps(self.num_steps)

    def groups(self, device: torch.device) -> torch.Tensor:
        if self._groups is None or self._groups.device != device:
            self._groups = row_groups(self._layout).to(device)
        return self._groups

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dense: AttentionFn) -> torch.Tensor:
        if not self.active():
            return dense(q, k, v)
        if self.kernel is None:
            self.kernel, self.why = choose_kernel(q.device, q.dtype)
            log.info("sparse attention at %.4g density on %s: %s (%s)", self.config.density, q.device.type,
                     self.kernel, self.why)
        mask = route(q, k, self.groups(q.device), self.config)
        kept = mask.float().mean()  # stays on the device: no host sync per layer
        self._kept = kept if self._kept is None else self._kept + kept
        self._calls += 1
        if self.kernel == "fa4":
            return fa4_block_sparse(q, k, v, mask, self.config.block)
        return masked_attention(q, k, v, mask, self.config.block)

    def report(self) -> dict:
        return {"density": self.config.density, "block": self.config.block, "kernel": self.kernel,
                "dense_steps": self.config.dense_steps(self.num_steps), "sparse_forwards": self.sparse_forwards,
                "kept_mean": round(float(self._kept) / self._calls, 4) if self._calls else None}


def density_of(setting: str) -> float | None:
    """The lever's setting ("off" or a percent, config.vocab.SPARSE_DENSITIES) as a fraction (None: off)."""
    return None if setting == "off" else float(setting) / 100.0


def attach_sparse(model, config: SparseConfig) -> SparseAttention:
    """Give an H3DiT block-sparse attention: every block's attention runs through `SparseAttention.attend` around its
    current dense kernel (a sequence-parallel plan applied later routes its local attention through it instead)."""
    state = SparseAttention(config)
    model.sparse = state
    for blk in model.transformer_blocks:
        dense = blk.attn.attention_fn
        blk.attn.attention_fn = lambda q, k, v, dense=dense: state.attend(q, k, v, dense)
    return state
