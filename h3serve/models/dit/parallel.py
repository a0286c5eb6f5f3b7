"""Sequence parallelism for the H3 DiT: Ulysses x Ring (USP), applied from outside the model.

The plan, as a reader should see it (P = ulysses * ring DiT ranks, S packed rows, n = ceil(S / P) rows per rank):

    packed rows [0, S) ── sharded once by rows (`row_shards`): rank d owns [d*n, d*n + n); the last ranks pad up
                          to n rows. The model's own forward runs on that `RowShard` (H3DiT.forward(..., shard=)):
    token_refiner       ── replicated (text only, L << S); each rank keeps its own text rows
    proj_in / audio_proj_in ── the rank's own rows only; RoPE cos/sin and AdaLN runs sliced to them
    every H3Block       ── local rows; around attention:
                             Ulysses all-to-all (B, n, H, D) -> (B, U*n, H/U, D)   [ranks of one ulysses group]
                             Ring attention over the R chunks of U*n rows, partial softmaxes merged by
                             log-sum-exp in fp32                                     [ranks of one ring group]
                             all-to-all back (B, U*n, H/U, D) -> (B, n, H, D)
    norm_out + proj_out / audio_proj_out ── local rows; only the 96-wide video (24 ch x 1x2x2 patch) and 32-wide
                             audio rows are all-gathered, never the 5376-wide hidden state

Rank layout: DiT rank d = ring_index * ulysses + ulysses_index, so one ulysses group holds U consecutive row shards
(= one ring chunk of U*n contiguous rows) and a ring group holds one rank of every ulysses group.

Padding: the pad rows all lie at the end of the packed sequence, so masking them out as keys is cutting the key
range of the last chunk(s) to the valid rows; pad rows start as zeros, are never read as keys and are dropped
before the gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from h3serve.config.levers import Levers
from h3serve.config.lora import LORA_CACHE_BYTES, parse_loras
from h3serve.config.parallel import ParallelDegrees
from h3serve.distributed.proxies import DiTEngineProxy
from h3serve.distributed.world import Runtime, check_identical, weights_digest

from .engine import DiTEngine
from .kernels import HALF_DTYPES, chosen_attention, fa3_attention_with_lse, fp8_attention_with_lse
from .layout import PackedLayout, RowShard, row_shards
from .model import H3DiT

__all__ = ["USPPlan", "USPGroups", "USPDiT", "parallelize_dit", "load_usp_engine", "ring_attention",
           "attention_with_lse", "ulysses_rows_to_heads", "ulysses_heads_to_rows"]


@dataclass(frozen=True)
class USPPlan:
    """Ulysses x Ring degrees of the DiT group (ranks [0, ulysses*ring) of the world)."""

    ulysses: int = 1
    ring: int = 1

    @property
    def world(self) -> int:
        return self.ulysses * self.ring

    def validate(self, num_heads: int) -> "USPPlan":
        ParallelDegrees(ulysses=self.ulysses, ring=self.ring, vae_pp=1).validate(dit_heads=num_heads)
        return self


@dataclass
class USPGroups:
    """This rank's place in the DiT mesh and its process groups (None where the degree is 1)."""

    plan: USPPlan
    rank: int  # DiT rank d
    data: object  # the DiT group: gathers of the output rows
    control: object  # gloo group over the DiT ranks: stop flags
    ulysses: object | None
    ring: object | None
    ring_ranks: list[int]  # global ranks of my ring group, by ring index

    @property
    def ulysses_index(self) -> int:
        return self.rank % self.plan.ulysses

    @property
    def ring_index(self) -> int:
        return self.rank // self.plan.ulysses

    @classmethod
    def build(cls, runtime: Runtime, plan: USPPlan) -> "USPGroups | None":
        """Create the groups; every rank of the world calls this in the same order. None off the DiT group."""
        if plan.world > runtime.world_size:
            raise ValueError(f"ulysses x ring = {plan.world} needs {plan.world} ranks, the world has "
                             f"{runtime.world_size}")
        u, r = plan.ulysses, plan.ring
        data, control = runtime.new_group(range(plan.world))
        uly_groups = [runtime.new_group([ri * u + ui for ui in range(u)])[0] if u > 1 else None for ri in range(r)]
        ring_groups = [runtime.new_group([ri * u + ui for ri in range(r)])[0] if r > 1 else None for ui in range(u)]
        if runtime.rank >= plan.world:
            return None
        d = runtime.rank
        return cls(plan=plan, rank=d, data=data, control=control, ulysses=uly_groups[d // u],
                   ring=ring_groups[d % u], ring_ranks=[ri * u + d % u for ri in range(r)])


# ---------------------------------------------------------------------------------------------------------------------
# Attention pieces


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention (B, H, Nq, D) x (B, H, Nk, D) -> out (B, H, Nq, D), log-sum-exp (B, H, Nq) fp32."""
    nq = q.shape[-2]
    if chosen_attention(q.device)[0] == "fp8":  # the FP8 attention lever: Ring chunks in FP8 too
        return fp8_attention_with_lse(q, k, v)
    if q.device.type == "cuda" and q.dtype in HALF_DTYPES and chosen_attention(q.device)[0] == "fa3":
        return fa3_attention_with_lse(q, k, v)  # the fastest kernel on Hopper, LSE included
    try:
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[:2]
            return out, lse[..., :nq].float()
        if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
            res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False)
            return res[0], res[1][..., :nq].float()
        if q.device.type == "cuda":
            res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)
            return res[0], res[1][..., :nq].float()
    except (RuntimeError, NotImplementedError):
        pass  # an unsupported shape / build: the exact math below
    scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, H, Nq, Nk)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(q.dtype), lse


def _merge(out, lse, o_b, lse_b):
    """Merge two partial softmax attentions over disjoint key sets, in fp32 (out is updated in place).

    With new = logaddexp(lse, lse_b): out * exp(lse - new) + o_b * exp(lse_b - new) = lerp(out, o_b, w) where
    w = exp(lse_b - new) = sigmoid(lse_b - lse); one pass over the block instead of three.
    """
    if out is None:
        return o_b.float(), lse_b
    out.lerp_(o_b.float(), torch.sigmoid(lse_b - lse)[..., None])
    return out, torch.logaddexp(lse, lse_b)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, ring_ranks: Sequence[int],
                   ring_index: int, valid: Sequence[int]) -> torch.Tensor:
    """Attention of the local query chunk over every ring rank's key/value chunk.

    q, k, v (B, H, c, D): this rank's chunk (k, v: views of (B, c, H, D) buffers, as the projections and the Ulysses
    exchange leave them; those buffers travel as they are); `valid[j]` = how many leading rows of chunk j are real
    (the rest is padding and is cut out of the keys). K/V travel around the ring (send to the next, receive from the
    previous, overlapped with the current block's attention); partial results are merged by log-sum-exp in fp32.
    """
    r = len(ring_ranks)
    kb, vb = (x.transpose(1, 2).contiguous() for x in (k, v))  # (B, c, H, D); no copy when already so laid out
    nxt, prv = ring_ranks[(ring_index + 1) % r], ring_ranks[(ring_index - 1) % r]
    out = lse = None
    for step in range(r):
        src = (ring_index - step) % r
        reqs = []
        if step < r - 1:
            next_k, next_v = torch.empty_like(kb), torch.empty_like(vb)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kb, nxt, group),
                                           dist.P2POp(dist.isend, vb, nxt, group),
                                           dist.P2POp(dist.irecv, next_k, prv, group),
                                           dist.P2POp(dist.irecv, next_v, prv, group)])
        n_valid = valid[src]
        if n_valid > 0:
            o_b, lse_b = attention_with_lse(q, kb[:, :n_valid].transpose(1, 2), vb[:, :n_valid].transpose(1, 2))
            out, lse = _merge(out, lse, o_b, lse_b)
        for req in reqs:
            req.wait()
        if step < r - 1:
            kb, vb = next_k, next_v
    return out.to(q.dtype)


def ulysses_rows_to_heads(xs: Sequence[torch.Tensor], group, u: int) -> list[torch.Tensor]:
    """Each (B, H, n, D) of this rank's rows, all heads -> (B, H/U, U*n, D): all rows of the group, H/U heads.

    One all-to-all per tensor, each launched as soon as its send buffer is packed, so that packing the next tensor
    overlaps the previous exchange. Send buffers are (U, B, n, H/U, D) (head chunk j goes to rank j), so the receive
    buffer of rank i is (U, B, n, H/U, D) = rows of rank 0, 1, ... for heads chunk i. At B = 1 that already is the
    (B, N, H/U, D) layout attention reads: returned as a (B, H/U, N, D) view, nothing is copied after the exchange.
    """
    works, recvs = [], []
    for x in xs:
        b, h, n, d = x.shape
        send = torch.empty(u, b, n, h // u, d, dtype=x.dtype, device=x.device)
        send.copy_(x.transpose(1, 2).reshape(b, n, u, h // u, d).permute(2, 0, 1, 3, 4))  # the one copy
        recv = torch.empty_like(send)
        works.append(dist.all_to_all_single(recv, send, group=group, async_op=True))
        recvs.append(recv)
    out = []
    for work, recv in zip(works, recvs):
        work.wait()
        _, b, n, hu, d = recv.shape
        rows = recv.view(b, u * n, hu, d) if b == 1 else recv.transpose(0, 1).reshape(b, u * n, hu, d)
        out.append(rows.transpose(1, 2))  # (B, H/U, N, D) view of (B, N, H/U, D)
    return out


def ulysses_heads_to_rows(x: torch.Tensor, group, u: int) -> torch.Tensor:
    """Inverse of `ulysses_rows_to_heads`: (B, H/U, U*n, D) -> (B, H, n, D), a view of a (B, n, H, D) buffer.

    Attention writes (B, N, H/U, D); at B = 1 that is the (U, B, n, H/U, D) send buffer as it stands.
    """
    b, hu, un, d = x.shape
    n = un // u
    send = x.transpose(1, 2).reshape(b, u, n, hu, d).transpose(0, 1).contiguous()  # (U, B, n, H/U, D); free at B = 1
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j] = head chunk j of my rows
    rows = recv.permute(1, 2, 0, 3, 4).reshape(b, n, u * hu, d)  # (B, n, H, D): the one copy
    return rows.transpose(1, 2)


# ---------------------------------------------------------------------------------------------------------------------
# The parallel model


class _USPAttention:
    """The `attention_fn` of every H3Block under USP; reads the current forward's geometry from its owner."""

    def __init__(self, owner: "USPDiT"):
        self.owner = owner

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g, shard = self.owner.groups, self.owner._shard
        u, r = g.plan.ulysses, g.plan.ring
        if u > 1:
            q, k, v = ulysses_rows_to_heads((q, k, v), g.ulysses, u)
        chunk = u * shard.rows  # rows of one ring chunk
        valid = [max(0, min(chunk, shard.seq_len - j * chunk)) for j in range(r)]
        if r > 1:
            o = ring_attention(q, k, v, group=g.ring, ring_ranks=g.ring_ranks, ring_index=g.ring_index, valid=valid)
        else:
            nv = valid[0]
            dense = chosen_attention(q.device)[1]  # same kernel as one GPU
            sparse = self.owner.model.sparse  # block-sparse lever: this rank routes its own heads
            k, v = k[:, :, :nv], v[:, :, :nv]
            o = sparse.attend(q, k, v, dense) if sparse is not None else dense(q, k, v)
        if u > 1:
            o = ulysses_heads_to_rows(o, g.ulysses, u)
        return o


class USPDiT(nn.Module):
    """An H3DiT run as one rank of a Ulysses x Ring group; same call signature and outputs as `H3DiT.forward`.

    Built by `parallelize_dit`. The model runs its own embed / blocks / heads on this rank's `RowShard`; this adds
    only the gather of the narrow output rows (the exchange around attention is the blocks' `attention_fn`).
    """

    def __init__(self, model: H3DiT, groups: USPGroups):
        super().__init__()
        self.model = model
        self.groups = groups
        self._shard: RowShard | None = None  # the current forward's, read by the blocks' attention
        self._cache: tuple[PackedLayout, list[RowShard]] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def config(self):
        return self.model.config

    def shards(self, layout: PackedLayout) -> list[RowShard]:
        # The loop passes one layout object per request. The cache keeps that object alive: keyed by id() alone, a
        # later request's layout could reuse the id of a freed one (e.g. a warm-up's) and get its stale shards.
        if self._cache is None or self._cache[0] is not layout:
            self._cache = (layout, row_shards(layout, self.groups.plan.world))
        return self._cache[1]

    def forward(self, video_rows: torch.Tensor, audio_rows: torch.Tensor, text_states: torch.Tensor,
                timesteps: torch.Tensor, timestep_indices: torch.Tensor, layout: PackedLayout
                ) -> tuple[torch.Tensor, torch.Tensor]:
        shards = self.shards(layout)  # keyed by the loop's own layout object, before any copy to the device
        self._shard = shards[self.groups.rank]
        video, audio = self.model(video_rows, audio_rows, text_states, timesteps, timestep_indices, layout,
                                  shard=self._shard)
        return (self._gather_rows(video, [s.video[1] - s.video[0] for s in shards]),
                self._gather_rows(audio, [s.audio[1] - s.audio[0] for s in shards]))

    def _gather_rows(self, local: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """(B, c_d, C) per rank -> (B, sum c, C) in rank order (= the modality's row order)."""
        width = max(counts)
        buf = local.new_zeros(local.shape[0], width, local.shape[2])
        buf[:, :local.shape[1]] = local
        parts = [torch.empty_like(buf) for _ in counts]
        dist.all_gather(parts, buf, group=self.groups.data)
        return torch.cat([p[:, :c] for p, c in zip(parts, counts)], dim=1)


def parallelize_dit(model: H3DiT, groups: USPGroups) -> USPDiT:
    """Apply the USP plan of `groups` to a loaded (and, for FastH3, already fused) H3DiT: the one way to make a DiT
    sequence parallel. Checks the degrees against the model's heads, then gives every H3Block the USP attention
    (the text refiner, replicated, keeps plain attention); returns the rank's USPDiT."""
    groups.plan.validate(model.config.num_attention_heads)
    if model.sparse is not None and groups.plan.ring > 1:
        raise ValueError(f"block-sparse attention runs with Ulysses only, not ring={groups.plan.ring}: a ring "
                         "chunk sees only part of the keys it would route over")
    usp = USPDiT(model, groups)
    attention = _USPAttention(usp)
    for block in model.transformer_blocks:
        block.attn.attention_fn = attention
    return usp


def load_usp_engine(runtime: Runtime, usp: USPGroups, checkpoint: str, *, components, dtype: torch.dtype,
                    profile: str, adapter: str | None, adapter_sha256: str | None, levers: Levers = Levers(),
                    adaln_dir: str | None = None, adaln_steps: int | None = None, loras: str | None = None,
                    lora_cache_bytes: int = LORA_CACHE_BYTES):
    """This DiT rank's engine: weights streamed (FastH3: the adapter fused into them, before any sharding), checked
    identical on every rank of the DiT group by digest (with an AdaLN table, its input weights too: each rank reads
    or builds its own), then each model wrapped in the USP plan."""
    engine = DiTEngine.load(checkpoint, components=components, dtype=dtype, device=runtime.device, profile=profile,
                            adapter=adapter, adapter_sha256=adapter_sha256, levers=levers, offload=False,
                            adaln_dir=adaln_dir, adaln_steps=adaln_steps, loras=parse_loras(loras),
                            lora_cache_bytes=lora_cache_bytes)   # each rank reads (and checks) its LoRA files
    for name, model in sorted(engine.models.items()):
        table = engine.adaln_tables.get(name)
        digest = weights_digest(model.state_dict().items()) + (table.key["weights_sha256"] if table else "")
        check_identical(runtime, digest, f"DiT {name} weights", control=usp.control)
        engine.models[name] = parallelize_dit(model, usp)
    engine.apply_offload(levers, group=usp.data)  # after the digest check: allgather ranks keep only shards
    return engine


# ---------------------------------------------------------------------------------------------------------------------
# What every rank of a world with a DiT stage runs


def build_dit_rank(runtime: Runtime, *, checkpoint: str, dtype: torch.dtype, components: Sequence[str], profile: str,
                   adapter: str | None, adapter_sha256: str | None, ulysses: int, ring: int,
                   levers: Levers = Levers(), adaln_dir: str | None = None,
                   adaln_steps: int | None = None, loras: str | None = None,
                   lora_cache_bytes: int = LORA_CACHE_BYTES) -> Callable[[], dict]:
    """Create the USP groups over ranks [0, ulysses x ring) now (every rank of the world calls this, in the same
    order) and return the load: the DiT engine under USP on the groups' members (`load_usp_engine`), then the ops
    for `DiTEngineProxy`: GENERATE request -> the result (None outside the groups; the stop flag is agreed across
    them at every step), PART -> this rank's engine.

    Two steps so that a world of several models creates all its groups before any rank loads."""
    usp = USPGroups.build(runtime, USPPlan(ulysses, ring))

    def load() -> dict:
        engine = None
        if usp is not None:
            engine = load_usp_engine(runtime, usp, checkpoint, components=components, dtype=dtype, profile=profile,
                                     adapter=adapter, adapter_sha256=adapter_sha256, levers=levers,
                                     adaln_dir=adaln_dir, adaln_steps=adaln_steps, loras=loras,
                                     lora_cache_bytes=lora_cache_bytes)

        def generate(req, local):
            if engine is None:
                return None
            should_stop = runtime.agreed_stop(local.should_stop if local else None, usp.control)
            return engine.generate(req, on_step=local.on_step if local else None, should_stop=should_stop)

        return {DiTEngineProxy.GENERATE: generate, DiTEngineProxy.PART: lambda payload, local: engine}

    return load
