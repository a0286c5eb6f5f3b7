"""bench/e2e_parallel.py end to end on the tiny checkpoint: CPU, fp32, 2 gloo ranks per side.

The script runs as a subprocess, exactly as the GPU runner runs it, and must print one JSON line with every field the
report needs. The two sides' final latents must agree within the tolerance the JSON states (fp32: max|Δ| <= 1e-4,
rel L2 <= 1e-5; measured ~1e-6 / ~1e-7), checked again here from the saved .pt files. Two runs: the default prompt
(packed length even: diffusers' plain Ulysses split) and an odd-length prompt (diffusers' Ulysses-anything, with
the script's gloo gather shim).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "e2e_parallel.py"
FP32_BOUND = {"max_abs": 1e-4, "rel_l2": 1e-5}
ODD_PROMPT = "a kite over the sea at dusk"  # 13 tokens: 2960 video + 414 audio + 13 rows, odd

STAGES = {"encoder_s", "dit_s", "vae_decode_s", "mux_s"}
SIDE_FIELDS = {"load_s", "stages", "t_client", "rtf", "mp4", "latents_path", "memory_per_rank", "peak_memory_per_gpu",
               "warmup_t_client", "t_client_runs"}
TOP_FIELDS = {"bench", "device", "torch", "diffusers_version", "geometry", "world", "dtype", "seed", "ours",
              "diffusers", "speedup_t_client", "latents", "target", "meets_target", "warnings"}


def _bench():
    spec = importlib.util.spec_from_file_location("bench_e2e_parallel", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(checkpoint, adapter, out: Path, *extra: str) -> tuple[int, dict, str]:
    cmd = [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), "--adapter", str(adapter),
           "--size", "320x256", "--seconds", "5", "--device", "cpu", "--dtype", "fp32", "--world", "2",
           "--out", str(out), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must be one JSON line, got {len(lines)}:\n{proc.stdout[-2000:]}\n" \
                            f"stderr:\n{proc.stderr[-4000:]}"
    return proc.returncode, json.loads(lines[0]), proc.stderr


def _check_report(rc: int, report: dict, stderr: str) -> None:
    assert rc == 0, f"exit status {rc}; errors: ours={report.get('ours', {}).get('error')} " \
                    f"diffusers={report.get('diffusers', {}).get('error')}\n{stderr[-4000:]}"
    missing = TOP_FIELDS - set(report)
    assert not missing, f"JSON lacks {sorted(missing)}"
    assert report["bench"] == "e2e_parallel" and report["world"] == 2 and report["target"] == 1.6
    geo = report["geometry"]
    assert (geo["width"], geo["height"], geo["frames"]) == (320, 256, 124)
    assert geo["seq_len"] == 37 * 8 * 10 + 2 * 207 + geo["text_tokens"]
    for side in ("ours", "diffusers"):
        data = report[side]
        assert "error" not in data, data["error"]
        assert not SIDE_FIELDS - set(data), f"{side} lacks {sorted(SIDE_FIELDS - set(data))}"
        assert set(data["stages"]) == STAGES
        assert all(v > 0 for v in data["stages"].values()), data["stages"]
        assert data["t_client"] > 0 and data["rtf"] == pytest.approx(data["t_client"] / (124 / 24))
        assert sorted(m["rank"] for m in data["memory_per_rank"]) == [0, 1]    # every rank reported its memory
        assert all(m["max_rss_bytes"] > 0 for m in data["memory_per_rank"])
        assert Path(data["mp4"]).stat().st_size > 0 and Path(data["latents_path"]).is_file()
    assert report["ours"]["degrees"] == {"encoder_tp": 2, "ulysses": 2, "ring": 1, "vae_pp": 2}
    settings = report["diffusers"]["settings"]
    assert settings["context_parallel"]["ulysses_degree"] == 2 and settings["attention_backend"] == "native"
    assert settings["adapter_tensors_fused"] > 0
    assert report["speedup_t_client"] == pytest.approx(report["diffusers"]["t_client"] / report["ours"]["t_client"])

    lat = report["latents"]
    assert lat["tolerance"]["max_abs"] <= FP32_BOUND["max_abs"] and lat["tolerance"]["rel_l2"] <= FP32_BOUND["rel_l2"]
    assert lat["within_tolerance"], lat
    ours = torch.load(report["ours"]["latents_path"])
    theirs = torch.load(report["diffusers"]["latents_path"])
    for key, shape in (("video", (1, 24, 37, 16, 20)), ("audio", (2, 32, 207))):
        assert tuple(ours[key].shape) == tuple(theirs[key].shape) == shape
        diff = (ours[key].double() - theirs[key].double())
        assert diff.abs().max().item() <= FP32_BOUND["max_abs"], key
        assert (diff.norm() / theirs[key].double().norm()).item() <= FP32_BOUND["rel_l2"], key
        assert lat[key]["max_abs_diff"] == pytest.approx(diff.abs().max().item(), abs=1e-12)
        assert theirs[key].abs().max() > 0.5  # non-trivial latents


@pytest.fixture(scope="module")
def default_run(tiny_checkpoint, tiny_adapter, tmp_path_factory):
    return _run(tiny_checkpoint, tiny_adapter.path, tmp_path_factory.mktemp("e2e_parallel"))


def test_default_prompt_report_and_latents(default_run):
    rc, report, stderr = default_run
    _check_report(rc, report, stderr)
    assert report["geometry"]["seq_len"] % 2 == 0
    assert report["diffusers"]["settings"]["context_parallel"]["ulysses_anything"] is False
    assert report["diffusers"]["settings"]["encoder_placement"] == "split"


def test_default_run_writes_playable_mp4s(default_run):
    import av

    _, report, _ = default_run
    for side in ("ours", "diffusers"):
        with av.open(report[side]["mp4"]) as container:
            video, audio = container.streams.video[0], container.streams.audio[0]
            assert (video.codec_context.name, audio.codec_context.name) == ("h264", "aac")
            assert (video.codec_context.width, video.codec_context.height) == (320, 256)
            assert audio.codec_context.sample_rate == 32000
            assert sum(1 for _ in container.decode(video=0)) == 124


def test_odd_packed_length_uses_ulysses_anything(tiny_checkpoint, tiny_adapter, tmp_path):
    rc, report, stderr = _run(tiny_checkpoint, tiny_adapter.path, tmp_path, "--prompt", ODD_PROMPT)
    _check_report(rc, report, stderr)
    assert report["geometry"]["seq_len"] % 2 == 1
    assert report["diffusers"]["settings"]["context_parallel"]["ulysses_anything"] is True


def test_compare_latents_flags_divergence():
    bench = _bench()
    gen = torch.Generator().manual_seed(0)
    ours = {"video": torch.randn(1, 24, 4, 2, 2, generator=gen), "audio": torch.randn(2, 32, 5, generator=gen)}
    same = bench.compare_latents(ours, {k: v + 1e-7 for k, v in ours.items()}, "fp32")
    assert same["within_tolerance"] and same["video"]["max_abs_diff"] <= 2e-7
    moved = dict(ours, audio=ours["audio"] + 1e-3)
    far = bench.compare_latents(ours, moved, "fp32")
    assert not far["within_tolerance"] and far["video"]["within_tolerance"] and not far["audio"]["within_tolerance"]
    wrong_shape = bench.compare_latents(ours, dict(ours, video=ours["video"][:, :, :3]), "fp32")
    assert not wrong_shape["within_tolerance"]
    nan = bench.compare_latents(ours, dict(ours, video=ours["video"] * float("nan")), "bf16")
    assert not nan["within_tolerance"]


def test_latents_pairs_compares_every_saved_run(tmp_path):
    bench = _bench()
    gen = torch.Generator().manual_seed(1)
    base = {"video": torch.randn(1, 24, 4, 2, 2, generator=gen), "audio": torch.randn(2, 32, 5, generator=gen)}
    torch.save(base, tmp_path / "ours_latents.pt")
    torch.save({k: v * 1.01 for k, v in base.items()}, tmp_path / "ours-cudnn_latents.pt")
    torch.save(dict(base, audio=base["audio"][:, :, :4]), tmp_path / "diffusers_latents.pt")  # other geometry
    torch.save(dict(base, run={"seed": 1}), tmp_path / "ours-seed1_latents.pt")  # another request's, same shapes
    pairs = bench.latents_pairs(tmp_path)
    assert set(pairs) == {"ours vs ours-cudnn"}  # other shapes or another run key: left out, not compared
    assert pairs["ours vs ours-cudnn"]["video"]["rel_l2"] == pytest.approx(0.01 / 1.01, rel=1e-5)
    moved = (base["audio"] * 1.01).double() - base["audio"].double()
    assert pairs["ours vs ours-cudnn"]["audio"]["max_abs_diff"] == pytest.approx(moved.abs().max().item(), rel=1e-12)


def test_tagged_ours_run_keeps_the_untagged_files(tiny_checkpoint, tiny_adapter, default_run):
    _, report, _ = default_run
    out = Path(report["out"])
    rc, tagged, stderr = _run(tiny_checkpoint, tiny_adapter.path, out, "--skip-diffusers", "--tag", "sdpa",
                              "--ours-attention", "sdpa", "--warmups", "0")
    assert rc == 0, stderr[-3000:]
    assert tagged["ours"]["tag"] == "sdpa" and tagged["ours"]["attention"] == "sdpa"
    assert tagged["ours"]["warmup_t_client"] is None
    assert Path(tagged["ours"]["latents_path"]).name == "ours-sdpa_latents.pt"
    assert (out / "ours_latents.pt").is_file() and (out / "ours_result.json").is_file()
    pairs = tagged["latents_pairs"]
    assert {"diffusers vs ours", "diffusers vs ours-sdpa", "ours vs ours-sdpa"} <= set(pairs)
    # the same kernels on the CPU: the tagged run repeats the untagged one bit for bit
    assert pairs["ours vs ours-sdpa"]["video"]["max_abs_diff"] == 0.0
    # FastH3's lossless levers (ours' lever flags): the same latents bit for bit
    rc, levers, stderr = _run(tiny_checkpoint, tiny_adapter.path, out, "--skip-diffusers", "--tag", "levers",
                              "--warmups", "0", "--vae-pp", "1", "--adaln-table", "on", "--dit-resident-blocks", "2",
                              "--encoder-resident-layers", "2", "--vae-staged", "on")
    assert rc == 0, stderr[-3000:]
    assert levers["ours"]["levers"] == ["resident_blocks", "encoder_resident_layers", "vae_staged", "adaln_table"]
    assert levers["latents_pairs"]["ours vs ours-levers"]["video"]["max_abs_diff"] == 0.0
    assert levers["latents_pairs"]["ours vs ours-levers"]["audio"]["max_abs_diff"] == 0.0
    # a lossy lever FastH3 refuses runs only with --uncertified, for its deviation from lossless FastH3
    rc, fp8, stderr = _run(tiny_checkpoint, tiny_adapter.path, out, "--skip-diffusers", "--tag", "fp8",
                           "--warmups", "0", "--world", "1", "--fp8", "on", "--uncertified")
    assert rc == 0, stderr[-3000:]
    assert fp8["ours"]["uncertified"] is True and fp8["ours"]["levers"] == ["fp8"]
    assert 0 < fp8["latents_pairs"]["ours vs ours-fp8"]["video"]["rel_l2"] < 0.05


def test_lossy_lever_on_fasth3_is_refused_without_uncertified(tiny_checkpoint, tiny_adapter, tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--checkpoint", str(tiny_checkpoint), "--adapter", str(tiny_adapter.path),
           "--device", "cpu", "--out", str(tmp_path), "--fp8", "on"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "profile fasth3 takes no --fp8" in proc.stderr


def test_bad_tag_is_refused(tiny_checkpoint, tiny_adapter, tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--checkpoint", str(tiny_checkpoint), "--adapter", str(tiny_adapter.path),
           "--device", "cpu", "--out", str(tmp_path), "--tag", "../x"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--tag '../x'" in proc.stderr


def test_bf16_judged_against_the_spread_of_ours_variants():
    bench = _bench()
    gen = torch.Generator().manual_seed(2)
    theirs = {"video": torch.randn(1, 24, 4, 2, 2, generator=gen), "audio": torch.randn(2, 32, 5, generator=gen)}
    noise = {k: torch.randn(v.shape, generator=gen) for k, v in theirs.items()}
    ours = {k: v + 0.07 * noise[k] * v.norm() / noise[k].norm() for k, v in theirs.items()}  # rel L2 0.07
    assert not bench.compare_latents(ours, theirs, "bf16")["within_tolerance"]  # fixed 0.05
    pairs = {"ours vs ours-cudnn": {"video": {"rel_l2": 0.06}, "audio": {"rel_l2": 0.05}},
             "ours vs ours-gpu1": {"video": {"rel_l2": 0.05}, "audio": {"rel_l2": 0.02}},
             "diffusers vs ours": {"video": {"rel_l2": 0.9}, "audio": {"rel_l2": 0.9}}}  # not a variant of ours
    floor = bench.noise_floor(pairs)
    assert floor == {"video": 0.06, "audio": 0.05}
    judged = bench.compare_latents(ours, theirs, "bf16", floor=floor)
    assert judged["within_tolerance"], judged
    assert judged["tolerance"]["rel_l2_per_key"] == pytest.approx({"video": 0.09, "audio": 0.075})
    # beyond 1.5x the variants' spread is still a divergence, and fp32 ignores the floor
    far = {k: v + 0.2 * noise[k] * v.norm() / noise[k].norm() for k, v in theirs.items()}
    assert not bench.compare_latents(far, theirs, "bf16", floor=floor)["within_tolerance"]
    assert not bench.compare_latents(ours, theirs, "fp32", floor=floor)["within_tolerance"]
    assert bench.noise_floor({"diffusers vs ours": pairs["diffusers vs ours"]}) is None
