"""A random MiniMax H3 checkpoint at the RELEASED geometry and storage dtypes, written by streaming.

For benchmarks on machines without the real weights: the time of a forward does not depend on the values, so a
folder with the release's layout, shapes and stored dtypes stands in for `MiniMaxAI/MiniMax-H3`:

    modular_model_index.json   as the release has it (`transformer_ref` declared empty unless `with_ref=True`)
    text_encoder/              Qwen3-VL-32B, bfloat16                      model-0000i-of-0000n.safetensors
    tokenizer/, processor/     the small byte-level BPE tokenizer of `h3serve.testing.tiny`
    transformer/               MiniMaxH3Transformer3DModel, bfloat16 + 12 float32 tensors
    transformer_ref/           (only with `with_ref=True`: it adds another 66 GB) same class, other weights
    vae/, audio_vae/           float32                                       diffusion_pytorch_model-0000i-of-...
    scheduler/, audio_scheduler/
    h3serve_full.json          recipe version, seed, geometry

Nothing ever holds a component in memory: each model is built with its diffusers / transformers class with the
parameters on the `meta` device (buffers are built for real: they are small), the shards are planned from the
shapes, and each shard's safetensors header is written first, then every tensor is generated in fixed-size chunks
and appended. Peak memory is a few chunks per thread, whatever the model size.

Values: weights N(0, 0.02); norm weights, Snake alpha/beta and weight-norm magnitudes 1; norm biases 0; persistent
buffers (the audio VAE's filters, its zero key bias) keep the values the class computes. Each tensor has its own
generator, seeded from (seed, component, tensor name, chunk), so the bytes are identical for a seed whatever the
shard size or thread count. Non-persistent buffers are not written (the classes recompute them).

Tokenizer: there is no Qwen tokenizer offline. The checkpoint reuses the small BPE tokenizer of `h3serve.testing.tiny`
(special tokens at ids 0-13), while the text encoder keeps the release's 151,936 embedding rows: every id the small
tokenizer produces is below that, so prompts work. The Qwen3-VL config's image / video / vision_start / vision_end
token ids are therefore the tokenizer's actual ids (as in the tiny checkpoint), not the release's 151652-151656.

`geometry="tiny"` (or "tiny8") writes the tiny model through this same code path (tests); `layers_override` replaces
config fields per component, e.g. `{"transformer": {"num_layers": 1}}` (keys: transformer, text_encoder (the text
config), vision (the vision config), vae, audio_vae); `components` restricts which weight components are written
(the others, and the configs, tokenizer and schedulers, are still written unless restricted too).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from accelerate import init_empty_weights
from diffusers import (
    AutoencoderKLMiniMaxH3,
    AutoencoderKLMiniMaxH3Audio,
    MiniMaxH3Scheduler,
    MiniMaxH3Transformer3DModel,
)
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from h3serve.errors import CheckpointError
from h3serve.testing import presets
from h3serve.testing.tiny import (
    HUB_REPO,
    SPECIAL_TOKENS,
    build_tokenizer,
    image_processor_config,
    modular_index,
    quiet,
    release_storage_dtype,
    video_processor_config,
    write_json,
)
from h3serve.weights.folder import INDEX_FILE
from h3serve.weights.safetensors import encode_header
from h3serve.weights.synthetic import SYNTHETIC_META, synthetic_metadata

FULL_RECIPE_VERSION = 1
STAMP_FILE = "h3serve_full.json"
WEIGHT_COMPONENTS = ("text_encoder", "transformer", "transformer_ref", "vae", "audio_vae")
OTHER_COMPONENTS = ("tokenizer", "processor", "scheduler", "audio_scheduler")

STD = 0.02
CHUNK_ELEMENTS = 1 << 24          # elements per generated chunk (64 MiB in float32); fixed: it is part of the bytes
_ONES_LEAVES = ("alpha", "beta", "weight_g", "original0")


# ------------------------------------------------------------------------------------------------------------------
# Models on meta


@contextlib.contextmanager
def _params_on_meta():
    """Build modules with every parameter on `meta` and buffers on the CPU (their values are kept)."""
    with init_empty_weights(include_buffers=False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*weight_norm.*", category=FutureWarning)
        yield


def _merged(base: dict, override: dict | None) -> dict:
    out = dict(base)
    out.update(override or {})
    return out


def build_meta_model(component: str, geometry: str = "full", overrides: dict | None = None, tokenizer=None):
    """The component's diffusers / transformers model with its parameters on `meta`."""
    overrides = overrides or {}
    with _params_on_meta():
        if component in ("transformer", "transformer_ref"):
            return MiniMaxH3Transformer3DModel(**_merged(presets.transformer_config(geometry),
                                                         overrides.get("transformer")))
        if component == "vae":
            return AutoencoderKLMiniMaxH3(**_merged(presets.video_vae_config(geometry), overrides.get("vae")))
        if component == "audio_vae":
            return AutoencoderKLMiniMaxH3Audio(**_merged(presets.audio_vae_config(geometry),
                                                         overrides.get("audio_vae")))
        if component == "text_encoder":
            tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
            ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
            text = presets.text_encoder_text_config(geometry)
            text.setdefault("vocab_size", len(tokenizer))   # tiny: the tokenizer's size; full: 151,936
            text = _merged(text, overrides.get("text_encoder"))
            if text["vocab_size"] < len(tokenizer):
                raise CheckpointError(f"text encoder vocab_size {text['vocab_size']} < tokenizer size {len(tokenizer)}")
            config = Qwen3VLConfig(
                text_config=text, vision_config=_merged(presets.text_encoder_vision_config(geometry),
                                                        overrides.get("vision")),
                image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                tie_word_embeddings=False,
            )
            config.dtype = torch.bfloat16
            return Qwen3VLForConditionalGeneration(config).eval()
    raise ValueError(f"no model for component '{component}'")


# ------------------------------------------------------------------------------------------------------------------
# Planning and values


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: str                  # "normal" | "ones" | "zeros" | "buffer"
    value: torch.Tensor | None = None   # the buffer's own value (fill == "buffer")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def _fill_rule(module: torch.nn.Module, name: str, is_param: bool) -> str:
    if not is_param:
        return "buffer"
    prefix, _, leaf = name.rpartition(".")
    owner = module.get_submodule(prefix) if prefix else module
    if "Norm" in type(owner).__name__ and leaf in ("weight", "bias"):
        return "ones" if leaf == "weight" else "zeros"
    if leaf in _ONES_LEAVES:
        return "ones"
    return "normal"


def plan_tensors(module: torch.nn.Module, component: str) -> list[TensorPlan]:
    """Every parameter and persistent buffer, by state-dict name, in the release's stored dtype."""
    params = {n for n, _ in module.named_parameters()}
    plans = []
    for name, t in module.state_dict(keep_vars=True).items():
        dtype = release_storage_dtype(component, name) if t.dtype.is_floating_point else t.dtype
        fill = _fill_rule(module, name, name in params)
        value = t.detach() if fill == "buffer" else None
        if value is not None and value.is_meta:
            raise CheckpointError(f"{component}: persistent buffer '{name}' has no value")
        plans.append(TensorPlan(name, tuple(int(s) for s in t.shape), dtype, fill, value))
    return plans


def plan_shards(plans: list[TensorPlan], max_shard_bytes: int) -> list[list[TensorPlan]]:
    """Consecutive tensors (state-dict order) grouped into shards of at most `max_shard_bytes` (a larger tensor
    gets a shard of its own)."""
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for p in plans:
        if shards[-1] and size + p.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


def _seed(seed: int, component: str, name: str, chunk: int) -> int:
    digest = hashlib.sha256(f"{seed}/{component}/{name}/{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _chunk_bytes(plan: TensorPlan, seed: int, component: str, chunk: int) -> bytes:
    start = chunk * CHUNK_ELEMENTS
    n = min(CHUNK_ELEMENTS, plan.numel - start)
    if plan.fill == "buffer":
        t = plan.value.reshape(-1)[start:start + n].to(plan.dtype)
    elif plan.fill == "ones":
        t = torch.ones(n, dtype=plan.dtype)
    elif plan.fill == "zeros":
        t = torch.zeros(n, dtype=plan.dtype)
    else:
        gen = torch.Generator().manual_seed(_seed(seed, component, plan.name, chunk))
        t = torch.randn(n, generator=gen, dtype=torch.float32).mul_(STD).to(plan.dtype)
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _header(shard: list[TensorPlan], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors header of a shard: names sorted, `{"format": "pt"}` metadata (the same bytes as
    `h3serve.weights.safetensors.write_safetensors`) plus `metadata`."""
    return encode_header(((p.name, p.dtype, p.shape) for p in sorted(shard, key=lambda p: p.name)),
                         {"format": "pt", **(metadata or {})})


def _write_shard(path: Path, shard: list[TensorPlan], seed: int, component: str, pool: ThreadPoolExecutor,
                 window: int, synthetic: bool = False) -> None:
    """Write a shard; `synthetic`: its "normal" tensors are a hole, generated when read (h3serve.weights.synthetic)."""
    plans = sorted(shard, key=lambda p: p.name)
    holes = {p.name for p in plans if synthetic and p.fill == "normal"}
    meta = {SYNTHETIC_META: synthetic_metadata(seed, component, STD, holes)} if synthetic else None
    pending: deque = deque()
    with open(path, "wb") as f:
        f.write(_header(shard, meta))
        for p in plans:
            if p.name in holes:
                while pending:
                    f.write(pending.popleft().result())
                f.seek(p.nbytes, os.SEEK_CUR)
                continue
            for c in range(-(-p.numel // CHUNK_ELEMENTS)):
                pending.append(pool.submit(_chunk_bytes, p, seed, component, c))
                if len(pending) >= window:
                    f.write(pending.popleft().result())
        while pending:
            f.write(pending.popleft().result())
        f.truncate()  # a trailing hole still gives the file its length


def write_component(module: torch.nn.Module, component: str, folder: Path, seed: int, *,
                    max_shard_bytes: int = 5 << 30, threads: int | None = None, synthetic: bool = False) -> dict:
    """Write `module`'s random weights to `folder` (single file, or shards + index; `synthetic`: see
    `init_full_checkpoint`). Returns the shard index (also for a single file)."""
    diffusers_style = component != "text_encoder"
    stem = "diffusion_pytorch_model" if diffusers_style else "model"
    plans = plan_tensors(module, component)
    shards = plan_shards(plans, max_shard_bytes)
    threads = threads or max(1, min(8, (os.cpu_count() or 2) // 2))
    weight_map: dict[str, str] = {}
    with ThreadPoolExecutor(threads) as pool:
        for i, shard in enumerate(shards):
            fname = f"{stem}.safetensors" if len(shards) == 1 else \
                f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_shard(folder / fname, shard, seed, component, pool, window=2 * threads, synthetic=synthetic)
            weight_map.update({p.name: fname for p in shard})
    index = {"metadata": {"total_size": sum(p.nbytes for p in plans)},
             "weight_map": {k: weight_map[k] for k in sorted(weight_map)}}
    if len(shards) > 1:
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return index


# ------------------------------------------------------------------------------------------------------------------
# Folder


def _write_config(module: torch.nn.Module, component: str, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if component == "text_encoder":
        module.config.architectures = [type(module).__name__]
        module.config.save_pretrained(str(folder))
    else:
        module.save_config(str(folder))


def _write_small_components(root: Path, tokenizer, names: Iterable[str]) -> None:
    names = set(names)
    if "tokenizer" in names:
        tokenizer.save_pretrained(str(root / "tokenizer"))
    if "processor" in names:
        proc = root / "processor"
        tokenizer.save_pretrained(str(proc))
        write_json(proc / "preprocessor_config.json", dict(image_processor_config(),
                                                            image_processor_type="Qwen2VLImageProcessor",
                                                            processor_class="Qwen3VLProcessor"))
        write_json(proc / "video_preprocessor_config.json", video_processor_config())
    for name, shift in presets.SCHEDULER_SHIFTS.items():
        if name in names:
            MiniMaxH3Scheduler(shift=shift).save_pretrained(str(root / name))


def init_full_checkpoint(dir: str | os.PathLike, seed: int = 0, *, with_ref: bool = False,
                         max_shard_bytes: int = 5 << 30, layers_override: dict | None = None,
                         geometry: str = "full", components: Iterable[str] | None = None,
                         overwrite: bool = False, threads: int | None = None, progress=None,
                         synthetic: bool = False) -> Path:
    """Write a random H3 checkpoint with the release's geometry, stored dtypes and layout to `dir`; return its path.

    `with_ref`: also write `transformer_ref/` (otherwise the index declares it as not shipped, so t2va / fl2va
    load and ref2va does not). `max_shard_bytes`: shard size limit (release-like 5 GiB). `layers_override`,
    `geometry`, `components`: see the module docstring. `progress(component, seconds, bytes)` is called after each
    weight component. Built in a temporary folder beside `dir` and renamed into place; an existing `dir` is an error
    unless `overwrite=True`. Deterministic for a seed. `synthetic`: the N(0, 0.02) tensors are holes generated
    when loaded (`h3serve.weights.synthetic`): the folder takes almost no disk, and its values are not the written
    checkpoint's of the same seed.
    """
    target = Path(dir).absolute()
    if target.exists():
        if not overwrite and not (target.is_dir() and not any(target.iterdir())):
            raise CheckpointError(f"{target}: already exists; pass overwrite=True to replace it")
    wanted = set(components) if components is not None else set(WEIGHT_COMPONENTS + OTHER_COMPONENTS)
    if not with_ref:
        wanted.discard("transformer_ref")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with quiet(), torch.no_grad():
            tokenizer = build_tokenizer()
            _write_small_components(tmp, tokenizer, wanted)
            for offset, component in enumerate(WEIGHT_COMPONENTS, start=1):
                if component not in wanted:
                    continue
                t0 = time.perf_counter()
                model = build_meta_model(component, geometry, layers_override, tokenizer)
                _write_config(model, component, tmp / component)
                index = write_component(model, component, tmp / component, seed * 10 + offset,
                                        max_shard_bytes=max_shard_bytes, threads=threads, synthetic=synthetic)
                del model
                if progress is not None:
                    progress(component, time.perf_counter() - t0, index["metadata"]["total_size"])
            index = modular_index(HUB_REPO)
            for name in WEIGHT_COMPONENTS + OTHER_COMPONENTS:
                if name not in wanted:
                    index[name] = [None, None, {}]
            write_json(tmp / INDEX_FILE, index)
            write_json(tmp / STAMP_FILE, {"recipe": FULL_RECIPE_VERSION, "seed": seed, "geometry": geometry,
                                           "layers_override": layers_override or {},
                                           "storage": "synthetic" if synthetic else "release",
                                           "with_ref": "transformer_ref" in wanted})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rename(target, trash / target.name)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(tmp, target)
    return target
