"""The AdaLN table (models/dit/adaln.py): with it the DiT's outputs are today's bit for bit on the CPU for every task,
profile and dtype, the table file round-trips and a changed one is refused, a schedule outside the table is still
exact, and the projections' weights are in no device-resident parameter (nor in the layerwise offload's blocks)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from h3serve.config.levers import Levers, lever_conflict
from h3serve.errors import AdaLNTableError
from safetensors import safe_open

from h3serve.models.dit.adaln import ADALN_WEIGHTS, KEY_META
from h3serve.models.dit.engine import DiTEngine, DiTRequest
from h3serve.models.dit.layout import AudioRef, ImageRef
from h3serve.weights.load import name_matches
from h3serve.weights.safetensors import write_safetensors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COMPONENTS = ("transformer", "transformer_ref")
STEPS = 4  # the schedule the tables are built for (3 forwards)
TABLE = Levers(adaln_table=True)


def _request(text_dim: int, task: str = "t2va", *, profile: str = "base", steps: int | None = STEPS,
             quality: str = "lossless") -> DiTRequest:
    g = torch.Generator().manual_seed(3)
    kw = {}
    if task == "fl2va":  # first and last keyframes at the target's latent size
        kw = dict(anchors=("first", "last"), condition_latents=[torch.randn(1, 24, 1, 4, 6, generator=g),
                                                                 torch.randn(1, 24, 1, 4, 6, generator=g)])
    elif task == "ref2va":  # an image reference and an audio reference
        kw = dict(references=[ImageRef(2, 4), AudioRef(3)],
                  condition_latents=[torch.randn(1, 24, 1, 2, 4, generator=g)],
                  reference_audio_rows=[torch.randn(6, 32, generator=g)])
    return DiTRequest(text_states=torch.randn(1, 5, text_dim, generator=g), text_tags=torch.ones(5, dtype=torch.long),
                      latent_frames=2, latent_h=4, latent_w=6, audio_latents=3, seed=5, task=task, profile=profile,
                      steps=steps, quality=quality, **kw)


def _same(a, b) -> bool:
    return torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio)


@pytest.fixture(scope="module")
def plain(tiny_checkpoint):
    """dtype name -> today's engine (both partitions)."""
    return {name: DiTEngine.load(tiny_checkpoint, components=COMPONENTS, dtype=dt) for name, dt in DTYPES.items()}


@pytest.fixture(scope="module")
def tabled(tiny_checkpoint, tmp_path_factory):
    """dtype name -> an engine with the AdaLN table of the 4-point base schedule."""
    root = tmp_path_factory.mktemp("adaln")
    return {name: DiTEngine.load(tiny_checkpoint, components=COMPONENTS, dtype=dt, levers=TABLE, adaln_dir=root,
                                 adaln_steps=STEPS) for name, dt in DTYPES.items()}


@torch.no_grad()
@pytest.mark.parametrize("task", ["t2va", "fl2va", "ref2va"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_latents_with_the_table_are_todays_bitwise(plain, tabled, task, dtype):
    text_dim = plain[dtype].models["transformer"].config.text_dim
    table = tabled[dtype].adaln_tables["transformer_ref" if task == "ref2va" else "transformer"]
    misses = table.misses
    want = plain[dtype].generate(_request(text_dim, task))
    got = tabled[dtype].generate(_request(text_dim, task))
    assert _same(got, want)
    assert table.misses == misses  # every forward read its rows from the table: none was computed


@torch.no_grad()
def test_the_blocks_read_the_table(plain, tabled):
    """The check above can fail: an entry changed in place changes the latents."""
    engine = tabled["fp32"]
    text_dim = engine.models["transformer"].config.text_dim
    table = engine.adaln_tables["transformer"]
    want = plain["fp32"].generate(_request(text_dim))
    entry = next(iter(table.entries.values()))
    saved = entry.blocks.clone()
    try:
        entry.blocks[1].mul_(1.5)  # block 1's rows for the first step
        assert not _same(engine.generate(_request(text_dim)), want)
    finally:
        entry.blocks.copy_(saved)
    assert _same(engine.generate(_request(text_dim)), want)


@torch.no_grad()
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fasth3_with_the_table_is_todays_bitwise(tiny_checkpoint, tiny_adapter, tmp_path, dtype):
    kw = dict(profile="fasth3", adapter=tiny_adapter.path, adapter_sha256=tiny_adapter.sha256, dtype=DTYPES[dtype])
    ref = DiTEngine.load(tiny_checkpoint, **kw)
    engine = DiTEngine.load(tiny_checkpoint, levers=TABLE, adaln_dir=tmp_path, **kw)
    text_dim = ref.models["transformer"].config.text_dim
    req = _request(text_dim, profile="fasth3", steps=None)
    assert _same(engine.generate(req), ref.generate(req))
    table = engine.adaln_tables["transformer"]
    assert table.misses == 0 and table.report()["entries"] == 4  # FastH3 serves t2va only: one entry a forward
    # the adapter is fused into the projections before the table is keyed: not the base model's table
    base = DiTEngine.load(tiny_checkpoint, dtype=DTYPES[dtype], levers=TABLE, adaln_dir=tmp_path, adaln_steps=5)
    assert base.adaln_tables["transformer"].key["weights_sha256"] != table.key["weights_sha256"]


@torch.no_grad()
def test_a_schedule_outside_the_table_is_computed_exactly_on_first_use(plain, tabled):
    for dtype in DTYPES:
        text_dim = plain[dtype].models["transformer"].config.text_dim
        table = tabled[dtype].adaln_tables["transformer"]
        before = table.misses
        for task in ("t2va", "fl2va"):
            req = _request(text_dim, task, steps=7)
            assert _same(tabled[dtype].generate(req), plain[dtype].generate(req))
        missed = table.misses - before
        assert missed >= 5  # 6 forwards; only the first step (t = 0) shares its timesteps with the 4-point grid
        assert _same(tabled[dtype].generate(req), plain[dtype].generate(req))
        assert table.misses - before == missed  # kept: the second request computes nothing


@torch.no_grad()
def test_step_reuse_and_fp8_with_the_table_are_bitwise_as_without(tiny_checkpoint, tmp_path):
    text_dim = DiTEngine.load(tiny_checkpoint).models["transformer"].config.text_dim
    high = _request(text_dim, steps=8, quality="high")
    for levers, req in ((Levers(), high), (Levers(fp8=True), _request(text_dim))):
        ref = DiTEngine.load(tiny_checkpoint, levers=levers)
        engine = DiTEngine.load(tiny_checkpoint, levers=dataclasses.replace(levers, adaln_table=True), adaln_dir=tmp_path,
                                adaln_steps=req.steps)
        assert _same(engine.generate(req), ref.generate(req)), levers
        assert engine.adaln_tables["transformer"].misses == 0
    # FP8 never quantized the AdaLN projections: the table holds plain linears' outputs either way
    assert all(type(p.linear).__name__ == "Linear" for p in engine.adaln_tables["transformer"].projections)


@torch.no_grad()
def test_layerwise_offload_streams_blocks_without_the_projections(tmp_path):
    from tests.unit.test_offload import TINY, tiny_model  # 6 layers: a window of 3 streams 5 blocks

    req = _request(TINY["text_dim"])
    cpu = torch.device("cpu")
    ref = DiTEngine({"transformer": tiny_model()}, device=cpu, profile="base")
    ref.apply_offload(Levers(resident_blocks=3))
    engine = DiTEngine({"transformer": tiny_model()}, device=cpu, profile="base")
    table = engine.use_adaln_table(tmp_path, steps=req.steps)["transformer"]
    engine.apply_offload(Levers(resident_blocks=3))
    assert _same(engine.generate(req), ref.generate(req)) and table.misses == 0
    off, plain_off = (e.models["transformer"].block_runner for e in (engine, ref))
    per_block = sum(p.numel() * p.element_size() for p in table.projections[0].parameters())
    assert off.report()["streamed_blocks"] == 5 and off.copies >= 5
    assert off.block_bytes == plain_off.block_bytes - per_block > 0  # no projection is packed or streamed
    with pytest.raises(ValueError, match="before the layerwise offload"):
        engine.use_adaln_table(tmp_path)
    twice = DiTEngine({"transformer": tiny_model()}, device=cpu, profile="base")
    twice.use_adaln_table(tmp_path, steps=req.steps)
    with pytest.raises(ValueError, match="already in a table"):
        twice.use_adaln_table(tmp_path, steps=req.steps)


def test_projection_weights_are_not_device_parameters(tiny_checkpoint, tmp_path):
    ref = DiTEngine.load(tiny_checkpoint, dtype=torch.bfloat16).models["transformer"]
    engine = DiTEngine.load(tiny_checkpoint, dtype=torch.bfloat16, levers=TABLE, adaln_dir=tmp_path)
    model = engine.models["transformer"]
    names = [n for n, _ in model.named_parameters()]
    assert names and not [n for n in names if name_matches(n, ADALN_WEIGHTS)]
    assert all(block.adaln_proj is None for block in model.transformer_blocks) and model.norm_out.linear is None

    def nbytes(named):
        return sum(t.numel() * t.element_size() for _, t in named)

    adaln = nbytes((n, p) for n, p in ref.named_parameters() if name_matches(n, ADALN_WEIGHTS))
    assert adaln > 0
    assert nbytes(model.named_parameters()) == nbytes(ref.named_parameters()) - adaln
    assert engine.adaln_tables["transformer"].report()["host_weight_bytes"] == adaln


def _table_file(engine: DiTEngine, component: str = "transformer"):
    return engine.adaln_tables[component].path


def test_the_file_round_trips_and_a_changed_one_is_refused(tiny_checkpoint, tmp_path):
    first = DiTEngine.load(tiny_checkpoint, levers=TABLE, adaln_dir=tmp_path, adaln_steps=STEPS)
    path = _table_file(first)
    assert path.parent == tmp_path and path.name.startswith("adaln-transformer-") and path.suffix == ".safetensors"
    built = first.adaln_tables["transformer"]
    second = DiTEngine.load(tiny_checkpoint, levers=TABLE, adaln_dir=tmp_path, adaln_steps=STEPS)
    read = second.adaln_tables["transformer"]
    assert _table_file(second) == path and read.build_seconds == 0.0  # read, not built
    assert built.entries.keys() == read.entries.keys()
    for k, e in built.entries.items():
        assert torch.equal(read.entries[k].blocks, e.blocks) and torch.equal(read.entries[k].out, e.out)
    text_dim = second.models["transformer"].config.text_dim
    assert _same(second.generate(_request(text_dim)), DiTEngine.load(tiny_checkpoint).generate(_request(text_dim)))

    # one byte of the tensors changed: refused, naming the file
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(AdaLNTableError, match="do not match the sha256") as info:
        DiTEngine.load(tiny_checkpoint, levers=TABLE, adaln_dir=tmp_path, adaln_steps=STEPS)
    assert str(path) in str(info.value)

    # a consistent file made for another key (here: its own key with another dtype) under this key's name: refused
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {n: f.get_tensor(n).clone() for n in f.keys()}  # not views of the file about to be rewritten
    key = json.loads(meta[KEY_META])
    key["dtype"] = "bfloat16"
    write_safetensors(path, tensors, {**meta, KEY_META: json.dumps(key, sort_keys=True)})
    with pytest.raises(AdaLNTableError, match="made for another") as info:
        DiTEngine.load(tiny_checkpoint, levers=TABLE, adaln_dir=tmp_path, adaln_steps=STEPS)
    assert str(path) in str(info.value)


def test_a_read_only_directory_keeps_the_table_in_memory(tiny_checkpoint, tmp_path, monkeypatch):
    def read_only(path, *args, **kwargs):  # what a read-only mount answers (chmod does not stop root)
        raise PermissionError(30, "Read-only file system", str(path))

    monkeypatch.setattr("h3serve.models.dit.adaln.write_safetensors", read_only)
    engine = DiTEngine.load(tiny_checkpoint, levers=TABLE, adaln_dir=tmp_path, adaln_steps=STEPS)
    table = engine.adaln_tables["transformer"]
    assert table.path is None and table.report()["entries"] > 0 and not list(tmp_path.iterdir())
    text_dim = engine.models["transformer"].config.text_dim
    assert _same(engine.generate(_request(text_dim)), DiTEngine.load(tiny_checkpoint).generate(_request(text_dim)))


def test_mp4_bytes_with_the_table_are_todays(tiny_checkpoint, tmp_path):
    """The embedded pipeline end to end (encoder, DiT, VAEs, muxer), fp32 and bf16: the same MP4 bytes."""
    from h3serve.config.request import validate_request
    from h3serve.pipeline import Pipeline

    for dtype in DTYPES:
        pipe = Pipeline.load(tiny_checkpoint, device="cpu", dtype=dtype)
        req = validate_request(prompt="a red kite", seconds=5, width=256, height=256, seed=5, steps=3, dtype=dtype)
        pipe.generate(req, tmp_path / f"plain-{dtype}.mp4")
        pipe.dit = DiTEngine.load(tiny_checkpoint, dtype=DTYPES[dtype], levers=TABLE, adaln_dir=tmp_path / "tables",
                                  adaln_steps=3)
        pipe.generate(req, tmp_path / f"table-{dtype}.mp4")
        assert pipe.dit.adaln_tables["transformer"].misses == 0
        assert (tmp_path / f"plain-{dtype}.mp4").read_bytes() == (tmp_path / f"table-{dtype}.mp4").read_bytes()


def test_the_lever_from_generate_gives_the_same_mp4_in_memory(tiny_checkpoint, tmp_path):
    """`h3serve generate --adaln-table on` (the lever table's flag; no --adaln-dir: the table is built in memory) writes
    the bytes the plain run writes; FastH3 may take it."""
    import subprocess
    import sys

    def generate(name: str, *flags: str) -> bytes:
        out = tmp_path / f"{name}.mp4"
        r = subprocess.run([sys.executable, "-m", "h3serve.cli", "generate", "--checkpoint", str(tiny_checkpoint),
                            "--prompt", "a kite", "--seconds", "5", "--size", "256x256", "--steps", "3", "--seed", "2",
                            "--no-progress", "-o", str(out), *flags], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return out.read_bytes()

    assert generate("table", "--adaln-table", "on") == generate("plain")
    assert lever_conflict("fasth3", TABLE) is None


def test_bench_counts_the_released_bytes_and_its_device_part_is_bitwise():
    """bench/adaln.py: the byte counts of bench/RESULTS.md §15 (H3_REFERENCE §1.2: 260,209,152 parameters an
    adaln_proj, 28,917,504 in norm_out of which 5,376 are its RMSNorm's), and its device part's smoke run."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(repo / "bench" / "adaln.py"), "--parts", "bytes,device", "--device", "cpu",
           "--layers", "2", "--width", "64", "--frames", "22", "--height", "64", "--width-px", "96"]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts, device = (json.loads(line) for line in proc.stdout.strip().splitlines())
    assert counts["adaln_proj_bytes_per_block"] == 2 * 260_209_152
    assert counts["norm_out_linear_bytes"] == 2 * (28_917_504 - 5_376)
    assert counts["dit_weight_bytes_on_device_table_off"] == 66_280_430_144  # 66,280,430,080 + rope.inv_freq's 64
    assert counts["dit_weight_bytes_on_device_table_on"] == 66_280_430_144 - 50 * 2 * 260_209_152 - 57_824_256
    assert counts["table"]["fasth3/transformer"]["entries"] == 4
    assert device["bitwise_equal"] and device["computed_on_miss"] == 0
