"""The tiny checkpoint (layout, determinism, diffusers loads it) and the streaming loader (errors, dtypes)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from h3serve.errors import CheckpointError
from h3serve.testing import presets, tiny
from h3serve.weights.folder import CheckpointFolder, describe
from h3serve.weights.load import KEEP_FP32, DtypePolicy, iter_tensors, load_module_weights, name_matches
from h3serve.weights.headers import sha256_file

DIT_FILE = "transformer/diffusion_pytorch_model.safetensors"
# The 12 tensors the release stores in float32 (H3_REFERENCE §1.1).
DIT_FP32_TENSORS = {f"{m}.{p}" for m in ("proj_in", "audio_proj_in", "time_embedder.linear_1",
                                         "time_embedder.linear_2", "proj_out", "audio_proj_out")
                    for p in ("weight", "bias")}


def meta_dit():
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        return MiniMaxH3Transformer3DModel(**presets.TINY_TRANSFORMER)


def rewrite(path: Path, edit) -> None:
    """Load a safetensors file, let `edit(dict)` change it, save it back (metadata kept)."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata=metadata)


# ------------------------------------------------------------------------------------------------------------------
# Tiny checkpoint


def test_tiny_layout_complete(tiny_checkpoint):
    root = Path(tiny_checkpoint)
    index = json.loads((root / "modular_model_index.json").read_text())
    assert index["_class_name"] == "MiniMaxH3ModularPipeline"
    assert index["_blocks_class_name"] == "MiniMaxH3Blocks"
    assert (index["canvas_short_edge"], index["canvas_max_pixels"], index["reference_image_short_edge"]) == (
        768, 1_032_192, 2048)
    for name in tiny.COMPONENTS:
        library, cls, spec = index[name]
        assert (library, cls) == tiny.COMPONENT_CLASSES[name]
        assert spec["subfolder"] == name and (root / name).is_dir()

    ck = CheckpointFolder(root)
    assert sorted(ck.components) == sorted(tiny.COMPONENTS)
    assert ck.pipeline_config["canvas_short_edge"] == 768
    assert ck.component_path("vae") == root / "vae"
    assert ck.config("scheduler")["shift"] == 12.0
    assert ck.config("audio_scheduler")["shift"] == 3.0
    cfg = ck.config("transformer")
    for key, value in presets.TINY_TRANSFORMER.items():
        assert cfg[key] == (list(value) if isinstance(value, tuple) else value), key
    te = ck.config("text_encoder")
    assert te["text_config"]["num_hidden_layers"] == 51
    assert te["text_config"]["rope_parameters"]["mrope_section"] == [6, 5, 5]
    assert (te["image_token_id"], te["video_token_id"], te["vision_start_token_id"]) == (12, 13, 9)
    for f in ("tokenizer/tokenizer.json", "processor/tokenizer.json", "processor/preprocessor_config.json",
              "processor/video_preprocessor_config.json", "text_encoder/model.safetensors", DIT_FILE,
              "transformer_ref/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
              "audio_vae/diffusion_pytorch_model.safetensors"):
        assert (root / f).is_file(), f
    with pytest.raises(CheckpointError, match="'nope' is not in modular_model_index.json"):
        ck.component_path("nope")


def test_tiny_init_is_deterministic_and_atomic(tiny_checkpoint, tmp_path):
    start = time.perf_counter()
    again = tiny.init_tiny_checkpoint(tmp_path / "again", seed=0)
    elapsed = time.perf_counter() - start
    assert elapsed < 60, elapsed  # ~3 s on an idle core; the recipe budget is 15 s
    files = sorted(p.relative_to(tiny_checkpoint) for p in Path(tiny_checkpoint).rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (again / rel).read_bytes() == (Path(tiny_checkpoint) / rel).read_bytes(), rel
    # The two partitions differ, and another seed gives other weights.
    dit = (again / DIT_FILE).read_bytes()
    assert dit != (again / "transformer_ref/diffusion_pytorch_model.safetensors").read_bytes()
    assert not list(tmp_path.glob(".again.tmp-*"))  # no leftovers beside the target

    # Existing folder: reused when it is the same recipe + seed, refused otherwise.
    assert tiny.init_tiny_checkpoint(again, seed=0) == again
    with pytest.raises(CheckpointError, match="already exists"):
        tiny.init_tiny_checkpoint(again, seed=1)


def test_tiny_init_interrupted_leaves_nothing(tmp_path, monkeypatch):
    def half_build(root, seed, preset="tiny"):
        (root / "transformer").mkdir()
        (root / "modular_model_index.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "_build_into", half_build)
    with pytest.raises(KeyboardInterrupt):
        tiny.init_tiny_checkpoint(tmp_path / "ck", seed=0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.diffusers
@pytest.mark.timeout(300)
def test_diffusers_loads_and_runs_tiny_t2va(tiny_checkpoint):
    """diffusers' own ModularPipeline loads the folder (workflow t2va, fp32) and runs 2 steps at 256x256."""
    import numpy as np

    pipe = tiny.reference_pipeline(tiny_checkpoint, workflow="t2va", dtype=torch.float32)
    assert type(pipe).__name__ == "MiniMaxH3ModularPipeline"
    assert pipe.transformer.dtype == torch.float32
    assert getattr(pipe, "transformer_ref", None) is None  # t2va loads only its own partition
    state = pipe(prompt="A red fox runs across a snowy field.", height=256, width=256, num_frames=124,
                 num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np")
    videos, audio = state.get("videos"), state.get("audio")
    assert videos.shape == (1, 124, 256, 256, 3)
    assert 0.0 <= videos.min() and videos.max() <= 1.0 and float(np.std(videos)) > 0.01
    assert tuple(audio.shape) == (1, 2, 165_600) and float(audio.float().std()) > 0
    assert state.get("sampling_rate") == 32000
    assert tuple(state.get("prompt_embeds").shape)[::2] == (1, 64)


# ------------------------------------------------------------------------------------------------------------------
# Folder / streaming


def test_streaming_and_describe(tiny_checkpoint):
    ck = CheckpointFolder(tiny_checkpoint)
    reference = load_file(str(Path(tiny_checkpoint) / DIT_FILE))
    seen = {}
    for name, tensor in iter_tensors(ck, "transformer", dtype_policy=DtypePolicy(torch.bfloat16, ("proj_in",))):
        seen[name] = tensor
        expected = torch.float32 if name.startswith("proj_in.") else torch.bfloat16
        assert tensor.dtype == expected, name
        assert torch.equal(tensor, reference[name].to(expected))
    assert set(seen) == set(reference) and len(seen) == 62

    d = describe(tiny_checkpoint)
    assert d["class_name"] == "MiniMaxH3ModularPipeline" and d["blocks_class_name"] == "MiniMaxH3Blocks"
    dit = d["components"]["transformer"]
    assert (dit["class"], dit["tensors"], dit["params"], dit["tensor_bytes"]) == (
        "MiniMaxH3Transformer3DModel", 62, 268_960, 268_960 * 4)
    assert dit["dtypes"] == {"float32": {"tensors": 62, "params": 268_960, "bytes": 268_960 * 4}}
    assert d["components"]["scheduler"]["config_file"] == "scheduler_config.json"
    assert d["components"]["text_encoder"]["class"] == "Qwen3VLForConditionalGeneration"

    path = Path(tiny_checkpoint) / DIT_FILE
    assert sha256_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert name_matches("time_embedder.linear_1.weight", ["time_embedder"])
    assert not name_matches("audio_proj_in.weight", ["proj_in"])
    assert name_matches("decoder.blocks.0.norm1.weight", ["norm1"]) and name_matches("a.b", ["*"])


def test_load_dit_on_meta(tiny_checkpoint):
    model = meta_dit()
    report = load_module_weights(model, tiny_checkpoint, "transformer")
    reference = load_file(str(Path(tiny_checkpoint) / DIT_FILE))
    assert report.tensors == 62 and report.bytes_read == 268_960 * 4 and report.fused == 0
    assert report.files == [DIT_FILE] and report.untouched_buffers == ["rope.inv_freq"]
    state = model.state_dict()
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name
    assert not any(p.is_meta for p in model.parameters())
    assert model.rope.inv_freq.is_meta  # non-persistent buffer: left to the module


def test_load_other_components(tiny_checkpoint):
    """The same loader fills diffusers' VAE and transformers' Qwen3-VL built on meta."""
    from diffusers import AutoencoderKLMiniMaxH3
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        vae = AutoencoderKLMiniMaxH3(**presets.TINY_VIDEO_VAE)
        te = Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_pretrained(Path(tiny_checkpoint) / "text_encoder"))
    r = load_module_weights(vae, tiny_checkpoint, "vae", dtype=torch.bfloat16, keep_fp32=KEEP_FP32["vae"])
    assert r.tensors == 73 and vae.encoder.conv_in.weight.dtype == torch.float32
    assert vae.post_quant_conv.weight.dtype == torch.bfloat16
    r = load_module_weights(te, tiny_checkpoint, "text_encoder", dtype=torch.bfloat16)
    assert r.tensors == 603 and r.loaded_dtypes == {"bfloat16": 603}


def test_incomplete_folder_errors(copy_checkpoint):
    root = copy_checkpoint()
    CheckpointFolder(root)  # complete

    # Missing component folder.
    (root / "transformer_ref" / "config.json").unlink()
    (root / "transformer_ref" / "diffusion_pytorch_model.safetensors").rename(root / "moved.safetensors")
    (root / "transformer_ref").rmdir()
    with pytest.raises(CheckpointError, match=r"transformer_ref/: component folder of 'transformer_ref' is missing"):
        CheckpointFolder(root)
    CheckpointFolder(root, components=["transformer", "vae"])  # a t2va deployment does not need it

    # Missing weights file.
    (root / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"vae/: no \*\.safetensors weights"):
        CheckpointFolder(root, components=["vae"])

    # Missing config.
    (root / "audio_vae" / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"audio_vae/config.json: 'audio_vae' has no config file"):
        CheckpointFolder(root, components=["audio_vae"])

    # Missing index.
    (root / "modular_model_index.json").unlink()
    with pytest.raises(CheckpointError, match="modular_model_index.json is missing"):
        CheckpointFolder(root)


def test_missing_shard_and_missing_tensor(copy_checkpoint, tmp_path):
    src = copy_checkpoint()
    sharded = tiny.write_release_dtype_copy(src, tmp_path / "sharded", max_shard_bytes=100_000)
    ck = CheckpointFolder(sharded)
    shards = ck.weight_files("transformer")
    assert len(shards) >= 3 and (sharded / "transformer/diffusion_pytorch_model.safetensors.index.json").is_file()

    # Remove one tensor from a shard: the index still lists it.
    victim = shards[1]
    with safe_open(str(victim), framework="pt") as f:
        gone = sorted(f.keys())[0]
    rewrite(victim, lambda t: t.pop(gone))
    with pytest.raises(CheckpointError) as err:
        load_module_weights(meta_dit(), sharded, "transformer")
    assert f"transformer/{victim.name}: tensor '{gone}' listed in the shard index is missing" in str(err.value)

    # Remove a shard file.
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"transformer/{victim.name}: shard listed in "
                                              r"diffusion_pytorch_model.safetensors.index.json is missing"):
        CheckpointFolder(sharded)

    # Single file: a tensor missing from it.
    rewrite(src / DIT_FILE, lambda t: t.pop("transformer_blocks.1.ff.net.2.weight"))
    with pytest.raises(CheckpointError) as err:
        load_module_weights(meta_dit(), src, "transformer")
    assert (f"{DIT_FILE}: tensor 'transformer_blocks.1.ff.net.2.weight' is missing (the module expects it)"
            in str(err.value))


def test_wrong_shape_dtype_and_unexpected_key(copy_checkpoint):
    root = copy_checkpoint()
    name = "transformer_blocks.0.attn.to_q.weight"
    original = load_file(str(root / DIT_FILE))

    rewrite(root / DIT_FILE, lambda t: t.__setitem__(name, t[name][:, :63].contiguous()))
    with pytest.raises(CheckpointError) as err:
        load_module_weights(meta_dit(), root, "transformer")
    assert str(err.value) == f"{DIT_FILE}: tensor '{name}' has shape [64, 63], expected [64, 64]"

    rewrite(root / DIT_FILE, lambda t: t.__setitem__(name, torch.zeros(64, 64, dtype=torch.int32)))
    with pytest.raises(CheckpointError) as err:
        load_module_weights(meta_dit(), root, "transformer")
    assert str(err.value) == (f"{DIT_FILE}: tensor '{name}' has dtype int32, expected one of float32, "
                              "bfloat16, float16")

    def add_extra(t):
        t[name] = original[name]
        t["transformer_blocks.0.attn.to_gate_compress.weight"] = torch.zeros(64, 64)

    rewrite(root / DIT_FILE, add_extra)
    with pytest.raises(CheckpointError) as err:
        load_module_weights(meta_dit(), root, "transformer")
    assert str(err.value) == (f"{DIT_FILE}: unexpected tensor 'transformer_blocks.0.attn.to_gate_compress.weight' "
                              "(the module has no such parameter)")

    (root / DIT_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=rf"{DIT_FILE}: not a readable safetensors file"):
        load_module_weights(meta_dit(), root, "transformer")


def test_mixed_bf16_fp32_copy_loads(tiny_checkpoint, tmp_path):
    mixed = tiny.write_release_dtype_copy(tiny_checkpoint, tmp_path / "mixed", max_shard_bytes=200_000)
    d = describe(mixed)
    dit = d["components"]["transformer"]["dtypes"]
    assert dit["float32"]["tensors"] == 12 and dit["bfloat16"]["tensors"] == 50
    # proj_in, audio_proj_in, time_embedder.linear_1/2, proj_out, audio_proj_out (weights + biases)
    assert dit["float32"]["params"] == (64 * 96 + 64) + (64 * 32 + 64) + (64 * 16 + 64) + (32 * 64 + 32) + (
        96 * 64 + 96) + (32 * 64 + 32)
    assert set(d["components"]["text_encoder"]["dtypes"]) == {"bfloat16"}
    assert set(d["components"]["vae"]["dtypes"]) == {"float32"}
    assert set(d["components"]["audio_vae"]["dtypes"]) == {"float32"}

    model = meta_dit()
    report = load_module_weights(model, mixed, "transformer", dtype=torch.bfloat16,
                                 keep_fp32=KEEP_FP32["transformer"])
    assert report.stored_dtypes == {"float32": 12, "bfloat16": 50}
    assert report.loaded_dtypes == {"float32": 12, "bfloat16": 50}
    assert len(report.files) >= 3
    reference = load_file(str(Path(tiny_checkpoint) / DIT_FILE))
    for name, tensor in model.state_dict().items():
        if name in DIT_FP32_TENSORS:
            assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[name]), name
        else:
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, reference[name].to(torch.bfloat16)), name

    # fp32 everywhere from the mixed copy: the bf16-stored tensors are upcast.
    model = meta_dit()
    load_module_weights(model, mixed, "transformer", dtype=torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
