"""The streaming release-geometry writer, run at the tiny geometry through the same code path (small shards)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from h3serve.models.dit.model import H3DiT, H3DiTConfig
from h3serve.testing import fullsize, presets
from h3serve.weights.folder import CheckpointFolder
from h3serve.weights.load import KEEP_FP32, load_module_weights

SHARD = 64 << 10
DIT_FP32_TENSORS = {f"{m}.{p}" for m in ("proj_in", "audio_proj_in", "time_embedder.linear_1",
                                         "time_embedder.linear_2", "proj_out", "audio_proj_out")
                    for p in ("weight", "bias")}
# Tiny depths, smaller still than the tiny preset (the encoder keeps its 51 layers: the pipeline reads index 50).
OVERRIDE = {"transformer": {"num_layers": 1, "num_refiner_layers": 1}}


def _write(path: Path, seed: int = 0, **kw) -> Path:
    return fullsize.init_full_checkpoint(path, seed, with_ref=True, max_shard_bytes=SHARD, geometry="tiny",
                                         layers_override=OVERRIDE, threads=2, **kw)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("full") / "ck")


def _digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_layout_shards_and_index(written):
    ck = CheckpointFolder(written)
    assert set(ck.components) == {"text_encoder", "tokenizer", "processor", "transformer", "transformer_ref", "vae",
                                  "audio_vae", "scheduler", "audio_scheduler"}
    for component, stem in (("transformer", "diffusion_pytorch_model"), ("vae", "diffusion_pytorch_model"),
                            ("text_encoder", "model")):
        folder = written / component
        index = json.loads((folder / f"{stem}.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and files[0] == f"{stem}-00001-of-{len(files):05d}.safetensors"
        infos = ck.tensor_infos(component)
        assert index["metadata"]["total_size"] == sum(i.nbytes for i in infos.values())
        assert (folder / "config.json").is_file()
    te = json.loads((written / "text_encoder" / "config.json").read_text())
    tok = json.loads((written / "tokenizer" / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in tok}
    assert te["image_token_id"] == ids["<|image_pad|>"] and te["vision_start_token_id"] == ids["<|vision_start|>"]


def test_release_storage_dtypes(written):
    ck = CheckpointFolder(written)
    for component in ("transformer", "transformer_ref"):
        infos = ck.tensor_infos(component)
        assert {n for n, i in infos.items() if i.dtype == torch.float32} == DIT_FP32_TENSORS
        assert {i.dtype for n, i in infos.items() if n not in DIT_FP32_TENSORS} == {torch.bfloat16}
    assert {i.dtype for i in ck.tensor_infos("text_encoder").values()} == {torch.bfloat16}
    for component in ("vae", "audio_vae"):
        assert {i.dtype for i in ck.tensor_infos(component).values()} == {torch.float32}


def test_loads_into_h3dit_and_diffusers_classes(written):
    config = H3DiTConfig.from_json(written / "transformer" / "config.json")
    assert config.num_layers == 1 and config.hidden_size == presets.TINY_TRANSFORMER["hidden_size"]
    with torch.device("meta"):
        model = H3DiT(config)
    report = load_module_weights(model, written, "transformer", dtype=torch.bfloat16,
                                 keep_fp32=KEEP_FP32["transformer"])
    assert report.tensors == len(CheckpointFolder(written).tensor_infos("transformer"))
    assert not any(p.is_meta for p in model.parameters())
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())
    for component in ("vae", "audio_vae", "text_encoder"):
        meta = fullsize.build_meta_model(component, "tiny")
        load_module_weights(meta, written, component)
    # Sane values: norm weights one, other weights ~N(0, 0.02).
    sd = model.state_dict()
    w = next(v for k, v in sd.items() if k.endswith("to_q.weight")).float()
    assert 0.015 < w.std().item() < 0.025


def test_deterministic_for_a_seed(written, tmp_path):
    again = _write(tmp_path / "again")
    assert _digests(again) == _digests(written)
    other = fullsize.init_full_checkpoint(tmp_path / "other", 1, max_shard_bytes=SHARD, geometry="tiny",
                                          layers_override=OVERRIDE, components=["transformer"])
    assert _digests(other)["transformer/config.json"] == _digests(written)["transformer/config.json"]
    ours = {k: v for k, v in _digests(written).items() if k.startswith("transformer/diffusion")}
    theirs = {k: v for k, v in _digests(other).items() if k.startswith("transformer/diffusion")}
    assert ours.keys() == theirs.keys() and ours != theirs
    # A component left out is declared as not shipped; the folder still validates.
    assert CheckpointFolder(other).components == ["transformer"]


def test_existing_folder_is_refused(written):
    from h3serve.errors import CheckpointError

    with pytest.raises(CheckpointError, match="already exists"):
        _write(written)


def test_synthetic_folder_holds_holes_and_loads_generated_values(written, tmp_path):
    from h3serve.weights.load import iter_tensors

    synth = _write(tmp_path / "synth", synthetic=True)
    real, fake = CheckpointFolder(written), CheckpointFolder(synth)
    for component in ("transformer", "text_encoder", "vae", "audio_vae"):
        assert {n: (i.shape, i.dtype) for n, i in real.tensor_infos(component).items()} == \
            {n: (i.shape, i.dtype) for n, i in fake.tensor_infos(component).items()}
    files = fake.weight_files("transformer")
    apparent = sum(f.stat().st_size for f in files)
    on_disk = sum(f.stat().st_blocks * 512 for f in files)
    assert on_disk < apparent / 4, (on_disk, apparent)   # the N(0, 0.02) tensors are holes
    written_dit = dict(iter_tensors(real, "transformer"))
    first = dict(iter_tensors(fake, "transformer"))
    assert first.keys() == written_dit.keys()
    for name, t in first.items():
        if name.endswith("norm_q.weight") or ".norm" in name and name.endswith(".bias"):
            assert torch.equal(t, written_dit[name]), name   # fixed values are stored for real
    q = next(v for k, v in first.items() if k.endswith("to_q.weight")).float()
    assert 0.015 < q.std().item() < 0.025 and q.abs().max() > 0
    again = dict(iter_tensors(fake, "transformer"))
    assert all(torch.equal(first[n], again[n]) for n in first)   # generated the same way every load
    assert not torch.equal(q, written_dit[next(k for k in first if k.endswith("to_q.weight"))].float())
    for component in ("vae", "audio_vae", "text_encoder"):   # every class loads it
        load_module_weights(fullsize.build_meta_model(component, "tiny"), synth, component)
    assert json.loads((synth / fullsize.STAMP_FILE).read_text())["storage"] == "synthetic"


def test_cli_writes_a_synthetic_full_checkpoint_in_megabytes(tmp_path, capsys):
    from h3serve.cli import main

    assert main(["checkpoint", "init", "--preset", "full", "--synthetic", str(tmp_path / "full")]) == 0
    files = [f for f in (tmp_path / "full").rglob("*") if f.is_file()]
    apparent = sum(f.stat().st_size for f in files)
    assert apparent > 130e9 and sum(f.stat().st_blocks * 512 for f in files) < 50e6
    assert main(["checkpoint", "init", "--synthetic", str(tmp_path / "tiny")]) != 0
    assert "--synthetic is only used with --preset full" in capsys.readouterr().err
