"""Tensor parallelism for the H3 text encoder (Qwen3-VL's text decoder, the layers up to the one H3 reads).

transformers 5.x declares no decoder-layer plan for Qwen3-VL (`Qwen3VLTextConfig.base_model_tp_plan` covers only
`embed_tokens`), so this is a plan of ours, Megatron style, written as data:

    layers.*.self_attn.q_proj    colwise   (query heads [r*H/tp, (r+1)*H/tp))
    layers.*.self_attn.k_proj    colwise   (KV heads [r*KV/tp, ...); when tp is a multiple of KV, the one KV head
    layers.*.self_attn.v_proj    colwise    this rank's query heads read, replicated: exact, no extra traffic)
    layers.*.self_attn.o_proj    rowwise   (+ all_reduce)
    layers.*.mlp.gate_proj       colwise
    layers.*.mlp.up_proj         colwise
    layers.*.mlp.down_proj       rowwise   (+ all_reduce)
    embed_tokens, norms, q_norm / k_norm (per head), rotary, vision tower   replicated

Two all_reduces per layer; every rank ends with the full hidden state. Only the layers the encoder holds (the first
`layer` = 50) exist, so only those are sharded. Sharding slices the loaded weights in place (the shard is a copy, the
full tensor is dropped), so after `parallelize_encoder` a rank holds 1/tp of each decoder projection.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from h3serve.config.parallel import ParallelDegrees
from h3serve.distributed.proxies import EncoderProxy
from h3serve.distributed.world import Runtime

from .model import TextEncoder

__all__ = ["ENCODER_TP_PLAN", "RowParallelLinear", "parallelize_text_decoder", "parallelize_encoder"]

ENCODER_TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise_kv",
    "self_attn.v_proj": "colwise_kv",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b: the input's last dim is this rank's slice."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def _colwise(linear: nn.Linear, rows: slice) -> None:
    linear.weight = nn.Parameter(linear.weight.data[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[rows].clone(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _rowwise(linear: nn.Linear, cols: slice, group) -> RowParallelLinear:
    bias = None if linear.bias is None else linear.bias.data
    return RowParallelLinear(linear.weight.data[:, cols].clone(), bias, group)


def parallelize_text_decoder(language_model: nn.Module, group, rank: int, tp: int) -> nn.Module:
    """Shard a Qwen3-VL text model's decoder layers over the `tp` ranks of `group` (this is rank `rank`)."""
    cfg = language_model.config
    h, kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // h)
    inter = int(cfg.intermediate_size)
    ParallelDegrees(encoder_tp=tp).validate(dit_heads=1, encoder_heads=h, encoder_kv_heads=kv,
                                            encoder_intermediate=inter)
    if tp == 1:
        return language_model
    hq = h // tp
    q_rows = slice(rank * hq * hd, (rank + 1) * hq * hd)
    if kv % tp == 0:
        kv_heads = (rank * (kv // tp), (rank + 1) * (kv // tp))
    else:  # tp is a multiple of kv: my query heads all read one KV head
        first = (rank * hq) // (h // kv)
        kv_heads = (first, first + 1)
    kv_rows = slice(kv_heads[0] * hd, kv_heads[1] * hd)
    i_rows = slice(rank * (inter // tp), (rank + 1) * (inter // tp))
    for layer in language_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _colwise(attn.q_proj, q_rows)
        _colwise(attn.k_proj, kv_rows)
        _colwise(attn.v_proj, kv_rows)
        attn.o_proj = _rowwise(attn.o_proj, q_rows, group)
        attn.num_key_value_groups = hq // (kv_heads[1] - kv_heads[0])
        _colwise(mlp.gate_proj, i_rows)
        _colwise(mlp.up_proj, i_rows)
        mlp.down_proj = _rowwise(mlp.down_proj, i_rows, group)
    return language_model


def parallelize_encoder(encoder, group, rank: int, tp: int):
    """Apply the TP plan to a loaded `TextEncoder` (its truncated decoder); returns the same encoder."""
    parallelize_text_decoder(encoder.model.language_model, group, rank, tp)
    return encoder


# ---------------------------------------------------------------------------------------------------------------------
# What every rank of a world with an encoder stage runs


def build_encoder_rank(runtime: Runtime, *, checkpoint: str, dtype: torch.dtype, tp: int,
                       fp8: bool = False, resident_layers: int | None = None) -> Callable[[], dict]:
    """Create the TP group over ranks [0, tp) now (every rank of the world calls this, in the same order) and return
    the load: the sharded encoder on the group's members, then the ops for `EncoderProxy`: ENCODE (prompt, images,
    task, references) -> the encoding (None outside the group), PART -> this rank's encoder.

    Two steps so that a world of several models creates all its groups before any rank loads."""
    group, _ = runtime.new_group(range(tp))

    def load() -> dict:
        encoder = None
        if runtime.rank < tp:
            encoder = parallelize_encoder(TextEncoder.load(checkpoint, dtype=dtype, device=runtime.device), group,
                                          runtime.rank, tp)
            encoder.apply_levers(fp8=fp8, resident_layers=resident_layers, row_parallel=(RowParallelLinear,))

        def encode(payload, local):
            if encoder is None:
                return None
            prompt, images, task, references = payload
            return encoder.encode(prompt, images=images, task=task, references=references)

        return {EncoderProxy.ENCODE: encode, EncoderProxy.PART: lambda payload, local: encoder}

    return load
