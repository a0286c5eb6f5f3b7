"""A tiny random MiniMax H3 checkpoint in the published diffusers modular layout, for CPU tests and demos.

`init_tiny_checkpoint(dir, seed)` builds every component with diffusers' and transformers' own classes at the
`tiny` geometry of `h3serve.testing.presets` (H3_REFERENCE §6.2) and saves them the way the release is laid out:

    modular_model_index.json   MiniMaxH3ModularPipeline / MiniMaxH3Blocks, canvas config values
    text_encoder/              Qwen3VLForConditionalGeneration (51 text layers: hidden_states[50] is read)
    tokenizer/                 byte-level BPE trained here with `tokenizers`, saved as Qwen2Tokenizer
    processor/                 tokenizer + preprocessor_config.json + video_preprocessor_config.json
    transformer/               MiniMaxH3Transformer3DModel (t2va / fl2va partition)
    transformer_ref/           same class, different random weights (ref2va partition)
    vae/                       AutoencoderKLMiniMaxH3
    audio_vae/                 AutoencoderKLMiniMaxH3Audio
    scheduler/                 MiniMaxH3Scheduler, shift 12 (video)
    audio_scheduler/           MiniMaxH3Scheduler, shift 3 (audio)
    h3serve_tiny.json          recipe version + seed (lets a test cache decide whether a folder is reusable)

Storage dtype: everything is stored **float32**. The release stores the text encoder and the DiT in bfloat16 (the
DiT keeping 12 float32 tensors) and both VAEs in float32 (H3_REFERENCE §1.1); the reference runs of the tiny model
are float32, so the tiny checkpoint keeps full precision and `write_release_dtype_copy` derives a copy with the
release's bf16/fp32 mix (optionally sharded) to exercise that path.

The build is deterministic for a seed (same bytes in every file) and atomic: it is assembled in a temporary folder
beside the target and renamed into place, so an interrupted build never leaves a folder that looks complete.

`h3serve.models.encoder.processor.load_processor` builds the processor from the folder (the PIL image processor our
encoder uses, and Qwen3-VL's own video processor), and `reference_pipeline` loads the diffusers pipeline (our
numerical oracle) with that processor injected, so both sides read images and videos through the same processors.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import diffusers
import torch
from diffusers import (
    AutoencoderKLMiniMaxH3,
    AutoencoderKLMiniMaxH3Audio,
    MiniMaxH3Scheduler,
    MiniMaxH3Transformer3DModel,
    ModularPipeline,
)
from diffusers.utils import logging as diffusers_logging
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    Qwen2TokenizerFast,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.utils import logging as transformers_logging

from h3serve.errors import CheckpointError
from h3serve.models.encoder.processor import load_processor
from h3serve.testing import presets
from h3serve.weights.folder import INDEX_FILE, CheckpointFolder
from h3serve.weights.load import iter_tensors, name_matches
from h3serve.weights.safetensors import write_safetensors

TINY_RECIPE_VERSION = 1
STAMP_FILE = "h3serve_tiny.json"
HUB_REPO = "MiniMaxAI/MiniMax-H3"

COMPONENTS = ("text_encoder", "tokenizer", "processor", "transformer", "transformer_ref", "vae", "audio_vae",
              "scheduler", "audio_scheduler")

# (library, class) of each component, as modular_model_index.json records it.
COMPONENT_CLASSES = {
    "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "processor": ("transformers", "Qwen3VLProcessor"),
    "vae": ("diffusers", "AutoencoderKLMiniMaxH3"),
    "audio_vae": ("diffusers", "AutoencoderKLMiniMaxH3Audio"),
    "scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "audio_scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "transformer_ref": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "transformer": ("diffusers", "MiniMaxH3Transformer3DModel"),
}

# Pipeline config values (the blocks' ConfigSpecs), released values.
PIPELINE_CONFIG = {"canvas_short_edge": 768, "canvas_max_pixels": 768 * 1344, "reference_image_short_edge": 2048}

# Qwen2 special tokens in their release order (ids 151643.. in the release, 0.. here).
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
)
# The Qwen2 pre-tokenizer split.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TOKENIZER_VOCAB = 400

CORPUS = (
    "A red fox runs across a snowy field at dawn.",
    "Waves crash against black rocks under a grey sky.",
    "A woman in a yellow coat walks her dog through the park.",
    "The camera slowly pans over a quiet mountain lake.",
    "Rain falls on a busy city street at night.",
    "A chef chops onions in a bright kitchen.",
    "Two children laugh while flying a kite on the beach.",
    "An old man plays the violin in a subway station.",
    "A cat sleeps on a sunny windowsill.",
    "Birds sing in the tall trees of a green forest.",
    "A car drives along a winding coastal road.",
    "Fireworks burst over the river as the crowd cheers.",
    "A small boat drifts on calm blue water.",
    "The wind blows through a field of golden wheat.",
    "A train rushes past a small country station.",
    "A dancer spins on a wooden stage under warm lights.",
    "Snow falls softly on a sleeping village.",
    "A barista pours milk into a cup of coffee.",
    "Thunder rolls as lightning splits the dark clouds.",
    "A horse gallops along the shore at sunset.",
    "The crowd claps as the band starts to play.",
    "A girl reads a book under an oak tree.",
    "Steam rises from a bowl of hot noodle soup.",
    "A drone shot of a city skyline in the morning.",
    "A dog catches a red ball in the air.",
    "Leaves fall from the trees in a quiet autumn park.",
    "A man whistles while he paints a white fence.",
    "The ocean glows under a full moon.",
    "A baby giggles at a puppy licking her hand.",
    "A guitarist tunes his guitar before the show.",
    "Candles flicker on a table set for dinner.",
    "A skateboarder jumps over a railing in slow motion.",
    "Clouds race across the sky in a time lapse.",
    "A waterfall pours into a deep green pool.",
    "People talk and laugh in a crowded cafe.",
    "A robot arm assembles parts in a clean factory.",
    "The fire crackles in a stone fireplace.",
    "A bee lands on a purple flower.",
    "A runner crosses the finish line with her arms raised.",
    "An owl turns its head in the dark forest.",
    "A street market is full of colorful fruit.",
    "The teacher writes on the board while students listen.",
    "A kettle whistles on the stove.",
    "A surfer rides a large wave toward the beach.",
    "Hot air balloons float over the valley at sunrise.",
    "A pianist plays a soft melody in an empty hall.",
    "A cyclist rides through the rain with a bright jacket.",
    "Frogs croak near the pond on a summer night.",
    "A lighthouse beam sweeps across the foggy sea.",
    "Two friends share a pizza and talk about their day.",
    "A jet takes off from the runway with a loud roar.",
    "The clock tower rings at noon.",
    "A squirrel gathers nuts at the foot of a tree.",
    "A singer says: we will meet again tomorrow.",
    "<Picture 1>: <Picture 2>: <Audio 1>: <Video 1>: <0.2 seconds>",
    "<d>[English] Hello there, how are you today?</d>",
    "integrated_multimodal_description overall_soundscape non_diegetic_music",
    "subject_definitions summary retention_analysis detailed_description",
    "Numbers 0 1 2 3 4 5 6 7 8 9, 10 seconds, 24 fps, 32000 Hz.",
    "Punctuation: commas, periods. Questions? Exclamations! (Brackets) [and] {braces}.",
)


# ------------------------------------------------------------------------------------------------------------------
# Components


def build_tokenizer():
    """A deterministic byte-level BPE with the Qwen2 pre-tokenizer, NFC normalizer and special tokens (ids 0-13)."""
    bpe = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(list(CORPUS), trainer)
    return Qwen2TokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None,
        model_max_length=262144, clean_up_tokenization_spaces=False,
    )


def image_processor_config() -> dict:
    """Qwen3-VL image-processor settings (patch 16, merge 2, temporal 2, mean/std 0.5, Qwen3-VL pixel bounds)."""
    return {
        "do_resize": True, "resample": 3, "size": {"shortest_edge": 65536, "longest_edge": 16777216},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    }


def video_processor_config() -> dict:
    """Qwen3-VL video-processor settings (ref2va video references; loading them needs torchvision)."""
    return {
        "processor_class": "Qwen3VLProcessor", "video_processor_type": "Qwen3VLVideoProcessor",
        "do_resize": True, "resample": 3, "size": {"shortest_edge": 4096, "longest_edge": 25165824},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "do_sample_frames": True, "fps": 2,
        "min_frames": 4, "max_frames": 768,
    }


def build_text_encoder(tokenizer, seed: int, preset: str = "tiny"):
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(presets.text_encoder_text_config(preset), vocab_size=len(tokenizer))
    config = Qwen3VLConfig(
        text_config=text, vision_config=dict(presets.TINY_TEXT_ENCODER_VISION),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(config).eval()


def _perturb(module: torch.nn.Module, gen: torch.Generator, std: float, names=None) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if names is None or name_matches(name, names):
                p.add_(torch.randn(p.shape, generator=gen) * std)


def build_transformer(seed: int, preset: str = "tiny"):
    """The tiny DiT; every parameter perturbed by N(0, 0.02) so no zero-init path stays trivial."""
    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(**presets.transformer_config(preset)).eval()
    _perturb(model, torch.Generator().manual_seed(seed), 0.02)
    return model


def build_video_vae(seed: int, config: dict | None = None):
    """The tiny video VAE; the zero-initialised layer scales and register tokens set to N(0, 0.1)."""
    torch.manual_seed(seed)
    model = AutoencoderKLMiniMaxH3(**(config or presets.TINY_VIDEO_VAE)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name_matches(name, ("scale1", "scale2", "register_tokens")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def build_audio_vae(seed: int, config: dict | None = None):
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # torch's deprecation notice for the weight_norm diffusers uses
        warnings.filterwarnings("ignore", message=".*weight_norm.*", category=FutureWarning)
        return AutoencoderKLMiniMaxH3Audio(**(config or presets.TINY_AUDIO_VAE)).eval()


# ------------------------------------------------------------------------------------------------------------------
# Writing


def modular_index(repo: str = HUB_REPO) -> dict:
    """`modular_model_index.json` as the release has it: entries point at the Hub repo; diffusers loads the
    components of a local copy from the copy (any component whose files are present in the folder)."""
    index: dict = {"_class_name": "MiniMaxH3ModularPipeline", "_diffusers_version": diffusers.__version__,
                   "_blocks_class_name": "MiniMaxH3Blocks"}
    index.update(PIPELINE_CONFIG)
    for name in COMPONENTS:
        library, cls = COMPONENT_CLASSES[name]
        index[name] = [library, cls, {"type_hint": [library, cls], "pretrained_model_name_or_path": repo,
                                      "subfolder": name, "variant": None, "revision": None}]
    return index


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def quiet():
    """Silence the progress bars / info logs of transformers and diffusers while saving."""
    d_level, t_level = diffusers_logging.get_verbosity(), transformers_logging.get_verbosity()
    t_bar = transformers_logging.is_progress_bar_enabled()
    diffusers_logging.set_verbosity_error()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(d_level)
        transformers_logging.set_verbosity(t_level)
        if t_bar:
            transformers_logging.enable_progress_bar()


def _build_into(root: Path, seed: int, preset: str = "tiny") -> None:
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(root / "tokenizer"))

    proc = root / "processor"
    tokenizer.save_pretrained(str(proc))
    image_cfg = dict(image_processor_config(), image_processor_type="Qwen2VLImageProcessor",
                     processor_class="Qwen3VLProcessor")
    Qwen2VLImageProcessorPil(**image_processor_config())  # the settings must build the processor we load
    write_json(proc / "preprocessor_config.json", image_cfg)
    write_json(proc / "video_preprocessor_config.json", video_processor_config())

    # Independent seeds per component; the two transformer partitions get different weights.
    text_encoder = build_text_encoder(tokenizer, seed * 10 + 1, preset)
    text_encoder.save_pretrained(str(root / "text_encoder"))
    del text_encoder
    for offset, name in ((2, "transformer"), (3, "transformer_ref")):
        build_transformer(seed * 10 + offset, preset).save_pretrained(str(root / name))
    build_video_vae(seed * 10 + 4).save_pretrained(str(root / "vae"))
    build_audio_vae(seed * 10 + 5).save_pretrained(str(root / "audio_vae"))
    for name, shift in presets.SCHEDULER_SHIFTS.items():
        MiniMaxH3Scheduler(shift=shift).save_pretrained(str(root / name))

    write_json(root / INDEX_FILE, modular_index())
    stamp = {"recipe": TINY_RECIPE_VERSION, "seed": seed, "storage": "float32"}
    if preset != "tiny":   # the default preset's files stay exactly as they were
        stamp["preset"] = preset
    write_json(root / STAMP_FILE, stamp)


def is_tiny_checkpoint(path: str | os.PathLike, seed: int | None = None, preset: str = "tiny") -> bool:
    """Whether `path` is a complete tiny checkpoint of the current recipe and `preset` (and of `seed`, if given)."""
    path = Path(path)
    try:
        stamp = json.loads((path / STAMP_FILE).read_text())
        CheckpointFolder(path)
    except (OSError, ValueError, CheckpointError):
        return False
    return (stamp.get("recipe") == TINY_RECIPE_VERSION and stamp.get("preset", "tiny") == preset
            and (seed is None or stamp.get("seed") == seed))


def _atomic_install(tmp: Path, target: Path, *, overwrite: bool) -> None:
    """Rename a finished build into place. A concurrent builder that got there first wins."""
    if target.exists() and overwrite:
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rename(target, trash / target.name)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.exists():
            raise
        if not overwrite and not (target / INDEX_FILE).is_file():
            raise CheckpointError(f"{target}: exists and is not a checkpoint; refusing to replace it") from None


def init_tiny_checkpoint(dir: str | os.PathLike, seed: int = 0, *, overwrite: bool = False,
                         preset: str = "tiny") -> Path:
    """Write a random tiny H3 checkpoint (diffusers modular layout, float32) to `dir` and return its path.

    `preset`: "tiny", or "tiny8" (8 DiT heads, 8 encoder heads / 8 KV heads: every degree 8 is valid).

    Deterministic for a seed. Built in a temporary folder beside `dir` and renamed into place. An existing `dir`
    is an error unless `overwrite=True` (then it is replaced); an existing complete tiny checkpoint of the same
    seed is returned as is.
    """
    target = Path(dir).absolute()
    if target.exists() and not overwrite:
        if is_tiny_checkpoint(target, seed, preset):
            return target
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        else:
            raise CheckpointError(f"{target}: already exists; pass overwrite=True to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with quiet(), torch.no_grad():
            _build_into(tmp, seed, preset)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _atomic_install(tmp, target, overwrite=overwrite)
    return target


# ------------------------------------------------------------------------------------------------------------------
# Release dtype mix


def release_storage_dtype(component: str, name: str) -> torch.dtype:
    """The dtype the release stores a tensor in (H3_REFERENCE §1.1)."""
    if component in ("transformer", "transformer_ref"):
        fp32 = ("proj_in", "audio_proj_in", "time_embedder.linear_1", "time_embedder.linear_2", "proj_out",
                "audio_proj_out")
        return torch.float32 if name_matches(name, fp32) else torch.bfloat16
    if component == "text_encoder":
        return torch.bfloat16
    return torch.float32


def _save_shards(tensors: dict[str, torch.Tensor], folder: Path, stem: str, max_shard_bytes: int | None) -> None:
    names = sorted(tensors)
    if max_shard_bytes is None:
        write_safetensors(folder / f"{stem}.safetensors", tensors, {"format": "pt"})
        return
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = tensors[n].numel() * tensors[n].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / fname, {n: tensors[n] for n in shard}, {"format": "pt"})
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(folder / f"{stem}.safetensors.index.json", {"metadata": {"total_size": total},
                                                            "weight_map": weight_map})


def write_release_dtype_copy(src: str | os.PathLike, dst: str | os.PathLike, *,
                             max_shard_bytes: int | None = None) -> Path:
    """Copy a checkpoint with the release's storage dtypes: text encoder bf16, DiTs bf16 + 12 fp32 tensors, VAEs
    fp32. Configs get `"torch_dtype"`/`"dtype"` untouched (loaders decide the runtime dtype). With
    `max_shard_bytes`, weights are split into `*-0000i-of-0000n.safetensors` shards plus a `.index.json`.
    """
    src_ck = CheckpointFolder(src)
    dst = Path(dst)
    if dst.exists():
        raise CheckpointError(f"{dst}: already exists")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        for item in src_ck.path.iterdir():
            if item.is_file():
                shutil.copy2(item, tmp / item.name)
        for name in src_ck.components:
            folder = src_ck.component_path(name)
            out = tmp / folder.name
            out.mkdir()
            weights = set(src_ck.weight_files(name)) if src_ck.has_weights(name) else set()
            index_file = src_ck._weight_index_file(name) if weights else None
            for item in folder.iterdir():
                if item not in weights and item != index_file:
                    shutil.copy2(item, out / item.name)
            if not weights:
                continue
            stem = sorted(weights)[0].name.split("-0")[0].removesuffix(".safetensors")
            tensors = {n: t.to(release_storage_dtype(name, n)) if t.is_floating_point() else t
                       for n, t in iter_tensors(src_ck, name)}
            _save_shards(tensors, out, stem, max_shard_bytes)
            del tensors
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


# ------------------------------------------------------------------------------------------------------------------
# diffusers oracle


def reference_pipeline(path: str | os.PathLike, workflow: str = "t2va", dtype: torch.dtype = torch.float32):
    """diffusers' MiniMax H3 modular pipeline on a checkpoint folder, ready to call (CPU).

    `ModularPipeline.from_pretrained(path, workflow=...)`, then `load_components(dtype=...)` for every component of
    the workflow except the processor, then the processor built by `h3serve.models.encoder.processor.load_processor`
    (PIL image processor, Qwen3-VL's video processor) is injected with `update_components`.
    """
    pipe = ModularPipeline.from_pretrained(str(path), workflow=workflow)
    names = [n for n, spec in pipe._component_specs.items()
             if spec.default_creation_method == "from_pretrained" and n != "processor"]
    with quiet(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*weight_norm.*", category=FutureWarning)
        pipe.load_components(names=names, dtype=dtype)
    if "processor" in pipe._component_specs:
        pipe.update_components(processor=load_processor(path))
    missing = [n for n in names if getattr(pipe, n, None) is None]
    if missing:
        raise CheckpointError(f"{path}: diffusers could not load {', '.join(missing)}")
    return pipe


# ------------------------------------------------------------------------------------------------------------------
# Checkpoint variants (values a diffusers H3 checkpoint may legally vary)


def write_checkpoint_variant(src: str | os.PathLike, dst: str | os.PathLike, *, seed: int = 0,
                             transformer: dict | None = None, vae: dict | None = None, audio_vae: dict | None = None,
                             shifts: dict | None = None, index: dict | None = None) -> Path:
    """A copy of the tiny checkpoint `src` with some components rebuilt by diffusers' own classes at the tiny
    geometry updated by the given config values (random weights, perturbed as `init_tiny_checkpoint` does).

    transformer: both partitions; vae / audio_vae: their configs (`latent_channels` resizes latents_mean / std);
    shifts: {"scheduler": s, "audio_scheduler": s}; index: pipeline config values of modular_model_index.json.
    """
    dst = Path(dst)
    shutil.copytree(src, dst)
    with quiet(), torch.no_grad():
        if transformer is not None:
            for offset, name in ((2, "transformer"), (3, "transformer_ref")):
                torch.manual_seed(seed * 10 + offset)
                model = MiniMaxH3Transformer3DModel(**dict(presets.transformer_config("tiny"), **transformer)).eval()
                _perturb(model, torch.Generator().manual_seed(seed * 10 + offset), 0.02)
                shutil.rmtree(dst / name)
                model.save_pretrained(str(dst / name))
        for name, base, override in (("vae", presets.TINY_VIDEO_VAE, vae),
                                     ("audio_vae", presets.TINY_AUDIO_VAE, audio_vae)):
            if override is None:
                continue
            config = dict(base, **override)
            c = config["latent_channels"]
            if c != base["latent_channels"]:
                config.update(latents_mean=[config["latents_mean"][i % len(config["latents_mean"])] for i in range(c)],
                              latents_std=[config["latents_std"][i % len(config["latents_std"])] for i in range(c)])
            model = build_video_vae(seed * 10 + 4, config) if name == "vae" else build_audio_vae(seed * 10 + 5, config)
            shutil.rmtree(dst / name)
            model.save_pretrained(str(dst / name))
        for name, shift in (shifts or {}).items():
            shutil.rmtree(dst / name)
            MiniMaxH3Scheduler(shift=shift).save_pretrained(str(dst / name))
    if index:
        path = dst / INDEX_FILE
        write_json(path, dict(json.loads(path.read_text()), **index))
    (dst / STAMP_FILE).unlink(missing_ok=True)   # not the tiny recipe any more
    return dst
