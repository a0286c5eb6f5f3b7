"""FastH3 `fastvideo-lora-v2` adapter: fusion while streaming, checksum, VSA refusal, wrong-model and count checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import h3serve.weights.adapter as adapter_mod
from h3serve.errors import AdapterError, CheckpointError
from h3serve.testing import presets, tiny
from h3serve.testing.adapters import init_adapter
from h3serve.weights.adapter import Adapter, split_key
from h3serve.weights.load import KEEP_FP32, load_module_weights
from h3serve.weights.headers import sha256_file

DIT_FILE = "transformer/diffusion_pytorch_model.safetensors"


def meta_dit():
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        return MiniMaxH3Transformer3DModel(**presets.TINY_TRANSFORMER)


def edited_adapter(src: Path, dst: Path, edit=None, meta_edit=None) -> str:
    """Copy an adapter file with its tensors / metadata edited; returns the new sha256."""
    with safe_open(str(src), framework="pt") as f:
        metadata = dict(f.metadata())
    tensors = load_file(str(src))
    if edit:
        edit(tensors)
    if meta_edit:
        meta_edit(metadata)
    save_file(tensors, str(dst), metadata=metadata)
    return sha256_file(dst)


def unfused_reference(base: dict, adapter: dict) -> dict:
    """W + B·A + diff and b + diff_b, computed here independently of h3serve (fp32)."""
    out = {k: v.clone().float() for k, v in base.items()}
    for key, value in adapter.items():
        if key.endswith(".lora_A.weight"):
            module = key[: -len(".lora_A.weight")]
            out[f"{module}.weight"] += adapter[f"{module}.lora_B.weight"].float() @ value.float()
        elif key.endswith(".diff_b"):
            out[key[: -len(".diff_b")] + ".bias"] += value.float()
        elif key.endswith(".diff"):
            out[key[: -len(".diff")] + ".weight"] += value.float()
    return out


def test_synthetic_adapter_contents(tiny_checkpoint, tiny_adapter, tmp_path):
    with safe_open(str(tiny_adapter.path), framework="pt") as f:
        meta = f.metadata()
        keys = list(f.keys())
    # 2 blocks x 7 linears + 2 refiner blocks x 6 linears, A and B each; 7 diff + 4 diff_b.
    assert meta["format"] == "fastvideo-lora-v2" and meta["base_model"] == "MiniMaxAI/MiniMax-H3"
    assert meta["finetuned_model"] == "FastVideo/FastH3-synthetic" and meta["rank"] == "4"
    assert (meta["low_rank_tensors"], meta["diff_tensors"], meta["set_weight_tensors"]) == ("52", "11", "0")
    assert meta["application"].startswith("W = W_base + lora_B @ lora_A")
    assert len(keys) == 63
    assert "transformer_blocks.1.adaln_proj.linear.lora_A.weight" in keys
    assert "token_refiner.refiner_blocks.0.ff.net.0.proj.lora_B.weight" in keys
    assert {"proj_in.diff", "proj_in.diff_b", "norm_out.linear.diff_b", "transformer_blocks.0.norm1.diff"} <= set(keys)
    assert split_key("a.b.diff_b") == ("a.b", "diff_b") and split_key("a.lora_A.weight") == ("a", "lora_A")

    ad = Adapter.open(tiny_adapter.path, tiny_adapter.sha256)
    assert ad.rank == 4 and len(ad.patches) == 33
    assert ad.counts == {"low_rank_tensors": 52, "diff_tensors": 11, "set_weight_tensors": 0}
    # Deterministic for a seed.
    assert init_adapter(tiny_checkpoint, tmp_path / "again.safetensors", rank=4, seed=0) == tiny_adapter.sha256
    assert init_adapter(tiny_checkpoint, tmp_path / "other.safetensors", rank=4, seed=1) != tiny_adapter.sha256


def test_fusion_matches_unfused_reference(tiny_checkpoint, tiny_adapter):
    ad = Adapter.open(tiny_adapter.path, tiny_adapter.sha256)
    model = meta_dit()
    report = load_module_weights(model, tiny_checkpoint, "transformer", adapter=ad)
    assert report.fused == len(ad.targets()) == 26 + 7 + 4
    assert ad.unused() == []

    base = load_file(str(Path(tiny_checkpoint) / DIT_FILE))
    expected = unfused_reference(base, load_file(str(tiny_adapter.path)))
    state = model.state_dict()
    worst = max((state[n] - expected[n]).abs().max().item() for n in expected)
    assert worst <= 1e-6, worst
    changed = [n for n in base if not torch.equal(state[n], base[n])]
    assert sorted(changed) == sorted(ad.targets())


def test_fusion_before_cast_on_mixed_copy(tiny_checkpoint, tiny_adapter, tmp_path):
    """Release dtypes: fuse in fp32 into the stored dtype (bf16 / fp32), then cast to the load dtype."""
    mixed = tiny.write_release_dtype_copy(tiny_checkpoint, tmp_path / "mixed")
    ad = Adapter.open(tiny_adapter.path, tiny_adapter.sha256)
    model = meta_dit()
    load_module_weights(model, mixed, "transformer", adapter=ad, dtype=torch.bfloat16,
                        keep_fp32=KEEP_FP32["transformer"])
    base = load_file(str(mixed / DIT_FILE))
    expected = unfused_reference(base, load_file(str(tiny_adapter.path)))
    state = model.state_dict()
    for name in ("proj_in.weight", "proj_out.bias"):  # stored fp32, kept fp32
        assert state[name].dtype == torch.float32
        assert (state[name] - expected[name]).abs().max().item() <= 1e-6
    for name in ("transformer_blocks.0.attn.to_q.weight", "norm_out.linear.bias"):  # stored bf16
        assert state[name].dtype == torch.bfloat16
        assert torch.allclose(state[name].float(), expected[name], rtol=2 ** -7, atol=1e-6)


def test_wrong_checksum_refused_before_reading(tiny_adapter, monkeypatch):
    opened = []

    def spy(*args, **kwargs):
        opened.append(args)
        raise AssertionError("safe_open called before the checksum was verified")

    monkeypatch.setattr(adapter_mod, "safe_open", spy)
    wrong = "0" * 64
    with pytest.raises(AdapterError) as err:
        Adapter.open(tiny_adapter.path, wrong)
    assert f"expected {wrong}, actual {tiny_adapter.sha256}" in str(err.value)
    assert opened == []
    with pytest.raises(AdapterError, match="not a 64-digit hex digest"):
        Adapter.open(tiny_adapter.path, "abc")


def test_vsa_gates_refused(tiny_checkpoint, tmp_path):
    path = tmp_path / "vsa.safetensors"
    digest = init_adapter(tiny_checkpoint, path, vsa=True)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["set_weight_tensors"] == "2"
    with pytest.raises(AdapterError) as err:
        Adapter.open(path, digest)
    message = str(err.value)
    assert "2 VSA-only tensors" in message and "attn.to_gate_compress.set_weight" in message
    assert "need video sparse attention; h3serve runs dense attention; use the dense-datafree adapter" in message


def test_adapter_for_another_model_refused(tiny_checkpoint, tiny_adapter, tmp_path):
    def add_block(t):
        t["transformer_blocks.7.attn.to_q.lora_A.weight"] = torch.zeros(4, 64)
        t["transformer_blocks.7.attn.to_q.lora_B.weight"] = torch.zeros(64, 4)

    path = tmp_path / "deeper.safetensors"
    digest = edited_adapter(tiny_adapter.path, path, add_block,
                            lambda m: m.__setitem__("low_rank_tensors", str(int(m["low_rank_tensors"]) + 2)))
    ad = Adapter.open(path, digest)  # the file itself is consistent
    with pytest.raises(AdapterError) as err:
        load_module_weights(meta_dit(), tiny_checkpoint, "transformer", adapter=ad)
    assert ("1 adapter targets are not tensors of the transformer model (adapter for a different model?): "
            "transformer_blocks.7.attn.to_q.weight (lora_A/lora_B)") in str(err.value)

    # Used directly, the unmatched module is reported by unused().
    ad.reset_usage()
    ad.fuse("proj_in.weight", torch.zeros(64, 96))
    assert "transformer_blocks.7.attn.to_q (lora_A/lora_B)" in ad.unused()
    assert "proj_in (diff)" not in ad.unused() and "proj_in (diff_b)" in ad.unused()

    # A delta whose shape does not fit the base tensor.
    wide = tmp_path / "wide.safetensors"
    digest = edited_adapter(tiny_adapter.path, wide,
                            lambda t: t.__setitem__("proj_in.diff", torch.zeros(64, 95)))
    with pytest.raises(AdapterError, match=r"proj_in diff has shape \[64, 95\] but 'proj_in.weight' has shape "
                                           r"\[64, 96\]"):
        load_module_weights(meta_dit(), tiny_checkpoint, "transformer", adapter=Adapter.open(wide, digest))


def test_metadata_checks(tiny_adapter, tmp_path):
    def refused(name, edit=None, meta_edit=None, match=""):
        path = tmp_path / f"{name}.safetensors"
        digest = edited_adapter(tiny_adapter.path, path, edit, meta_edit)
        with pytest.raises(AdapterError, match=match):
            Adapter.open(path, digest)

    refused("count", meta_edit=lambda m: m.__setitem__("low_rank_tensors", "50"),
            match="declares low_rank_tensors=50 but the file holds 52")
    refused("nocount", meta_edit=lambda m: m.pop("diff_tensors"),
            match="does not declare diff_tensors")
    refused("dropped", edit=lambda t: t.pop("proj_out.diff_b"),
            match="declares diff_tensors=11 but the file holds 10")
    refused("format", meta_edit=lambda m: m.__setitem__("format", "peft"),
            match="metadata format is 'peft', expected 'fastvideo-lora-v2'")
    refused("base", meta_edit=lambda m: m.__setitem__("base_model", "Wan-AI/Wan2.1"),
            match="is for base_model 'Wan-AI/Wan2.1'")
    refused("key", edit=lambda t: t.__setitem__("proj_in.alpha", torch.zeros(1)),
            match="tensor 'proj_in.alpha' is not a fastvideo-lora-v2 key")
    refused("rank", meta_edit=lambda m: m.__setitem__("rank", "8"),
            match="has rank 4, metadata declares rank 8")

    def unpair(t):
        t.pop("proj_in.diff")
        t["proj_in.lora_A.weight"] = torch.zeros(4, 96)

    refused("unpaired", edit=unpair,
            meta_edit=lambda m: m.update(low_rank_tensors="53", diff_tensors="10"),
            match="module 'proj_in' has no lora_B.weight")

    with pytest.raises(AdapterError, match="does not exist"):
        Adapter.open(tmp_path / "absent.safetensors", tiny_adapter.sha256)


def test_init_adapter_needs_the_component(tiny_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="not in modular_model_index.json"):
        init_adapter(tiny_checkpoint, tmp_path / "x.safetensors", component="unet")
    assert not (tmp_path / "x.safetensors").exists()
