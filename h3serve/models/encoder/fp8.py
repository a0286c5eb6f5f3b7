"""Online FP8 for the Qwen3-VL text decoder: its attention and MLP projections become e4m3 weights with row-wise
scales (`h3serve.models.dit.quant.FP8Linear`); the embeddings, norms, rotary tables and the vision tower keep their
precision. Run after the weights are loaded (and before any tensor-parallel sharding)."""

from __future__ import annotations

from torch import nn

from h3serve.models.dit.quant import ENCODER_FP8_LINEARS, quantize_linears


def quantize_text_decoder(model: nn.Module) -> list[str]:
    """Replace the text decoder's projections of a `Qwen3VLModel` in place; returns the names replaced."""
    names = quantize_linears(model, ENCODER_FP8_LINEARS)
    if not names:
        raise ValueError("no Qwen3-VL text decoder projections found to quantize (expected "
                         "language_model.layers.N.self_attn.q_proj ...)")
    return names
