"""Two-rank stages against one rank, for real: several processes, gloo on the CPU, tiny models.

Reference first (1 rank, in this process), then the same op on every rank of a launched stage, then compare.
DiT / encoder in fp32 within max|Δ| <= 1e-5 (Ring and TP re-associate fp32 sums; Ulysses and patch parallel are
bitwise in practice); VAE patch parallel bitwise.
"""

from __future__ import annotations

import pytest
import torch

from h3serve.distributed.world import launch
from h3serve.errors import Cancelled
from h3serve.testing.rankcases import GEOMETRIES, TOL, maxdiff

from .workers import (SPARSE, build_suite, dit_inputs, dit_request, qwen_text_states, sparse_request, tiny_dit,
                      tiny_qwen_text)


@pytest.fixture(scope="module")
def stage2(tiny_checkpoint):
    with launch(2, build_suite, (str(tiny_checkpoint), [(2, 1), (1, 2)], (2,), 2), timeout_s=60) as h:
        yield h


# -- DiT USP ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("geometry", ["S28", "S25", "fl2va", "per-row-t"])
@pytest.mark.parametrize("plan", [(2, 1), (1, 2)], ids=["ulysses2", "ring2"])
def test_dit_two_ranks_match_one(stage2, plan, geometry):
    geo, kw = GEOMETRIES[geometry]
    ref = tiny_dit()(*dit_inputs(*geo, **kw))
    out = stage2.call("forward", (plan, geo, kw))
    assert [o.shape for o in out] == [r.shape for r in ref]
    assert maxdiff(out, ref) <= TOL
    assert stage2.last_outcomes == {1: "ok"}


def test_cancel_stops_every_rank_at_the_same_step_then_serves_the_next(stage2):
    from h3serve.models.dit.engine import DiTEngine

    done = []
    with pytest.raises(Cancelled) as info:
        stage2.call("generate", ((2, 1), dit_request(steps=8)), should_stop=lambda: len(done) >= 3,
                    on_step=lambda i, n: done.append(i))
    assert "before denoising step 4 of" in str(info.value)
    assert stage2.last_outcomes == {1: f"Cancelled: {info.value}"}  # rank 1 stopped at the same boundary
    assert [stage2.runtime.store.get(f"test/steps/{r}").decode() for r in (0, 1)] == ["3", "3"]

    res = stage2.call("generate", ((2, 1), dit_request()))  # the stage is still healthy and serves the next one
    ref = DiTEngine({"transformer": tiny_dit()}, device=torch.device("cpu"), profile="base").generate(dit_request())
    assert stage2.healthy and res.steps == ref.steps
    assert maxdiff((res.video, res.audio), (ref.video, ref.audio)) <= TOL


def test_dit_two_ranks_with_sparse_attention_route_each_ranks_heads_as_one_rank_does(stage2):
    """Ulysses: each rank routes its own two heads over the whole sequence; the result is the one-rank result."""
    from h3serve.models.dit.engine import DiTEngine
    from h3serve.models.dit.sparse import attach_sparse

    model = tiny_dit()
    attach_sparse(model, SPARSE)
    ref = DiTEngine({"transformer": model}, device=torch.device("cpu"), profile="base").generate(sparse_request())
    dense = DiTEngine({"transformer": tiny_dit()}, device=torch.device("cpu"), profile="base").generate(
        sparse_request())
    res, report = stage2.call("generate_sparse", ((2, 1), sparse_request(), SPARSE))
    assert report["sparse_forwards"] == 4 and report["kept_mean"] < 1, report  # 5 forwards, the first dense
    assert maxdiff((res.video, res.audio), (ref.video, ref.audio)) <= TOL
    assert maxdiff((res.video, res.audio), (dense.video, dense.audio)) > 100 * TOL  # the routing mattered


@pytest.mark.parametrize("plan", [(2, 1), (1, 2)], ids=["ulysses2", "ring2"])
def test_dit_two_ranks_with_the_adaln_table_are_bitwise_as_without(stage2, plan, tmp_path):
    """Each rank reads its rows from its own table (the same file, written by whichever rank came first)."""
    want = stage2.call("generate", (plan, dit_request()))
    got, report = stage2.call("generate_adaln", (plan, dit_request(), str(tmp_path)))
    assert torch.equal(got.video, want.video) and torch.equal(got.audio, want.audio)
    assert report["computed_on_miss"] == 0 and report["entries"] > 0
    assert [p.name for p in tmp_path.iterdir()] == [report["file"].rsplit("/", 1)[1]]
    assert stage2.last_outcomes == {1: "ok"}


@pytest.mark.parametrize("plan", [(2, 1), (1, 2)], ids=["ulysses2", "ring2"])
def test_dit_two_ranks_with_a_lora_match_one(stage2, plan, tmp_path):
    """Per-request LoRA under USP: each rank hooks its own Linears (whole rows), as one rank does."""
    import dataclasses

    from h3serve.config.lora import LoraEntry
    from h3serve.models.dit.engine import DiTEngine
    from h3serve.weights.headers import sha256_file
    from h3serve.weights.safetensors import write_safetensors

    model, g = tiny_dit(), torch.Generator().manual_seed(4)
    tensors = {}
    for name, m in model.named_modules():
        if name.startswith("transformer_blocks.") and isinstance(m, torch.nn.Linear) and ".attn." in name:
            tensors[f"transformer.{name}.lora_A.weight"] = torch.randn(2, m.in_features, generator=g) * 0.2
            tensors[f"transformer.{name}.lora_B.weight"] = torch.randn(m.out_features, 2, generator=g) * 0.2
    path = tmp_path / "lora.safetensors"
    write_safetensors(path, tensors)
    entries = (LoraEntry("x", str(path), sha256_file(path)),)
    req = dataclasses.replace(dit_request(), lora="x", lora_scale=0.8)
    ref_engine = DiTEngine({"transformer": model}, device=torch.device("cpu"), profile="base")
    ref_engine.use_loras(entries)
    ref = ref_engine.generate(req)
    plain = ref_engine.generate(dit_request())
    got = stage2.call("generate_lora", (plan, req, entries))
    assert maxdiff((got.video, got.audio), (ref.video, ref.audio)) <= TOL
    assert maxdiff((ref.video, ref.audio), (plain.video, plain.audio)) > 100 * TOL   # the LoRA mattered
    assert stage2.last_outcomes == {1: "ok"}


# -- encoder TP -------------------------------------------------------------------------------------------------------

def test_encoder_tp2_matches_tp1(stage2, tiny_checkpoint):
    """The tiny checkpoint's encoder: 2 heads / 1 KV head, so TP 2 replicates the KV head on both ranks."""
    from h3serve.models.encoder.model import TextEncoder

    prompt = "a kite over the sea at dusk"
    ref = TextEncoder.load(tiny_checkpoint, dtype=torch.float32).encode(prompt).states
    out = stage2.call("encode", prompt)
    assert out.shape == ref.shape and (out - ref).abs().max().item() <= TOL


def test_qwen_text_tp2_shards_kv_heads(stage2):
    """A 4-head / 2-KV-head Qwen3-VL text decoder: TP 2 shards the KV heads too."""
    ref = qwen_text_states(tiny_qwen_text())
    out = stage2.call("qwen_text")
    assert (out - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item())


# -- VAE patch parallel -----------------------------------------------------------------------------------------------

def test_vae_pp2_frames_equal_pp1(stage2, vae_reference):
    latents, ref = vae_reference
    assert torch.equal(stage2.call("vae_decode", (2, latents)), ref)
