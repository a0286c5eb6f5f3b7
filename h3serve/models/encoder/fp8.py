"""Online FP8 for the Qwen3-VL text decoder: its attention and MLP projections become e4m3 weights with row-wise
scales (`h3serve.models.dit.quant.FP8Linear`); the embeddings, norms, rotary tables and the vision tower keep their
precision. Run after the weights are loaded; under tensor parallelism after the sharding (`parallelize_encoder`):
the column shards are plain linears, the row shards keep their all_reduce around an FP8 GEMM."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from h3serve.models.dit.quant import ENCODER_FP8_LINEARS, FP8Linear, quantize_linears


class FP8RowParallelLinear(nn.Module):
    """A row-parallel linear (weight, bias, group: `encoder.parallel.RowParallelLinear`) with an FP8 GEMM:
    y = all_reduce(fp8(x_shard) @ fp8(W_shard)^T) + b."""

    def __init__(self, row: nn.Module):
        super().__init__()
        out_f, in_f = row.weight.shape
        lin = nn.Linear(in_f, out_f, bias=False, device="meta")
        lin.weight = row.weight
        self.inner = FP8Linear(lin)
        self.bias, self.group = row.bias, row.group

    def forward(self, x):
        y = self.inner(x)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def quantize_text_decoder(model: nn.Module, row_parallel: tuple[type, ...] = ()) -> list[str]:
    """Replace the text decoder's projections of a `Qwen3VLModel` in place (plain linears, and modules of the
    `row_parallel` classes: the tensor-parallel row shards); returns the names replaced."""
    names = quantize_linears(model, ENCODER_FP8_LINEARS)
    rows = [n for n, m in model.named_modules() if type(m) in row_parallel and ENCODER_FP8_LINEARS.search(n)]
    for name in rows:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, FP8RowParallelLinear(getattr(parent, child)))
    names += rows
    if not names:
        raise ValueError("no Qwen3-VL text decoder projections found to quantize (expected "
                         "language_model.layers.N.self_attn.q_proj ...)")
    return names
