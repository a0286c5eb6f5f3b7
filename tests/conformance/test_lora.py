"""A LoRA-applied DiT (models/dit/lora.py) against diffusers' MiniMax-H3 LoRA loading (PEFT) on the same tiny
transformer and the same diffusers-format LoRA file: one forward, max |delta| <= 1e-5 in fp32."""

from __future__ import annotations

import pytest
import torch

from h3serve.config.lora import LoraEntry
from h3serve.models.dit import layout as L
from h3serve.models.dit.lora import applied, load_lora
from h3serve.models.dit.model import H3DiT, H3DiTConfig
from h3serve.weights.headers import sha256_file
from h3serve.weights.safetensors import write_safetensors

pytest.importorskip("peft")
diffusers = pytest.importorskip("diffusers")
from diffusers import MiniMaxH3Transformer3DModel  # noqa: E402
from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin  # noqa: E402

from tests.conformance.test_dit import ODD, TEXT_TAGS, _inputs, _perturbed_reference, _ref_forward  # noqa: E402

T, H, W, A = 2, 4, 4, 4
TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2", "adaln_proj.linear")


class _Pipe(MiniMaxH3LoraLoaderMixin):
    """The mixin's host: what `load_lora_weights` reads from a pipeline (its two partitions)."""

    def __init__(self, transformer):
        self.transformer, self.transformer_ref, self.hf_device_map, self.components = transformer, None, None, {}


def _write_lora(path, model: MiniMaxH3Transformer3DModel, *, rank: int, alpha: float | None, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    mods = dict(model.named_modules())
    tensors = {}
    for i in range(ODD["num_layers"]):
        for t in TARGETS:
            lin = mods[f"transformer_blocks.{i}.{t}"]
            key = f"transformer.transformer_blocks.{i}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, lin.in_features, generator=g) / lin.in_features ** .5
            tensors[f"{key}.lora_B.weight"] = torch.randn(lin.out_features, rank, generator=g) * 0.1
    write_safetensors(path, tensors, {"alpha": str(alpha)} if alpha is not None else None)
    return sha256_file(path)


@pytest.mark.parametrize("alpha,scale", [(None, 1.0), (2.0, 0.7)])
def test_lora_forward_matches_diffusers_peft(tmp_path, alpha, scale):
    ref = _perturbed_reference(ODD)
    ours = H3DiT(H3DiTConfig.from_dict(dict(ref.config))).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    path = tmp_path / "lora.safetensors"
    entry = LoraEntry("x", str(path), _write_lora(path, ref, rank=4, alpha=alpha, seed=3))

    layout = L.build_t2va_layout(7, T, H, W, A, text_token_tags=TEXT_TAGS)
    v, a, txt = _inputs(layout)
    u, ti = L.row_timesteps(layout, 0.4, 0.6)
    with torch.no_grad():
        base_v, base_a = ours(v, a, txt, u, ti, layout)
        with applied(ours, load_lora(ours, entry, torch.device("cpu")), scale):
            ov, oa = ours(v, a, txt, u, ti, layout)
        again_v, again_a = ours(v, a, txt, u, ti, layout)

        _Pipe(ref).load_lora_weights(str(path), adapter_name="x")
        ref.set_adapters(["x"], weights=[scale])
        rv, ra = _ref_forward(ref, v, a, txt, u, ti, layout)

    assert (ov - base_v).abs().max() > 1e-2   # the LoRA moves the output well beyond the tolerance
    assert (ov - rv).abs().max() <= 1e-5 and (oa - ra).abs().max() <= 1e-5
    assert torch.equal(again_v, base_v) and torch.equal(again_a, base_a)   # hooks gone: base bytes again
