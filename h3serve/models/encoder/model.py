"""H3 text encoder: Qwen3-VL, read at ``hidden_states[50]`` (H3_REFERENCE §1.6).

H3 conditions on the output of decoder layer 50 (index 49 counted from 0), taken before the final norm, of the
Qwen3-VL-32B conditioner. So we build the model with only the first ``layer`` decoder layers (50 of 64), replace the
final RMSNorm by an identity, never build the LM head, and stream only the weights those modules need: the last
hidden state of the truncated stack *is* ``hidden_states[50]`` of the full one. The vision tower is kept (fl2va
keyframes and ref2va image / video references go through it; its deepstack features are added after the first
decoder layers).

Call arguments match the reference: input_ids [1, L], an all-ones attention mask, ``mm_token_type_ids`` (0 text,
1 image pad, 2 video pad), no cache, vision tensors when present; position ids are left to the model (M-RoPE).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from h3serve.config.vocab import ENCODER_LAYERS, TASKS
from h3serve.errors import CheckpointError
from h3serve.models.checkpoint import checked_folder
from h3serve.models.encoder.fp8 import quantize_text_decoder
from h3serve.models.offload import OffloadPlan, offload_layers
from h3serve.weights.load import iter_tensors

from . import presentation as pres
from .processor import load_processor

__all__ = ["TextEncoder", "EncodedText", "DEFAULT_LAYER"]

log = logging.getLogger("h3serve.encoder")

DEFAULT_LAYER = ENCODER_LAYERS  # hidden_states[50]: output of decoder layer index 49
ATTENTION = "sdpa"  # transformers' attention implementation, fixed (the encoder stage reports it)


@dataclass
class EncodedText:
    """``states`` (1, L, D) in the encoder dtype; ``tags`` (L,) int64, 1 = text, 0 = vision-block token."""

    states: torch.Tensor
    tags: torch.Tensor
    token_ids: list[int]


def _module_key(checkpoint_key: str) -> str | None:
    """Checkpoint key of a ``Qwen3VLForConditionalGeneration`` → key in our ``Qwen3VLModel``, or None to skip."""
    if checkpoint_key.startswith("lm_head."):
        return None
    if checkpoint_key.startswith("model."):
        checkpoint_key = checkpoint_key[len("model."):]
    if checkpoint_key.startswith("visual."):
        return checkpoint_key
    if checkpoint_key.startswith("language_model."):
        return checkpoint_key
    if checkpoint_key.startswith(("layers.", "embed_tokens.", "norm.")):  # older flat text layout
        return "language_model." + checkpoint_key
    return None


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if attr in owner._parameters:
        owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
    elif attr in owner._buffers:
        owner._buffers[attr] = value
    else:
        raise CheckpointError(f"checkpoint tensor {name} has no place in the model")


class TextEncoder:
    """Qwen3-VL truncated to the layers H3 reads, with its tokenizer and image processor."""

    def __init__(self, model, tokenizer, image_processor, *, layer: int = DEFAULT_LAYER, video_processor=None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.video_processor = video_processor
        self.layer = layer
        ids = tokenizer.convert_tokens_to_ids([pres.IMAGE_PAD, pres.VIDEO_PAD])
        self.image_pad_id, self.video_pad_id = int(ids[0]), int(ids[1])

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, checkpoint_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16,
             device: str | torch.device = "cpu", layer: int = DEFAULT_LAYER,
             host_layers: Sequence[int] = ()) -> "TextEncoder":
        """Load ``text_encoder/`` (first ``layer`` decoder layers + vision tower), ``tokenizer/`` and the image
        processor config in ``processor/``. Refuses an encoder with ``layer`` or fewer decoder layers.

        ``host_layers``: decoder layers read into host memory instead of onto ``device`` (the ones a layerwise
        offload streams: they never take device memory, not even while loading)."""
        # lazy: transformers' Qwen3-VL classes take seconds to import; only loading needs them
        from accelerate import init_empty_weights
        from transformers import Qwen2TokenizerFast, Qwen3VLConfig, Qwen3VLModel

        root = Path(checkpoint_dir)
        ck = checked_folder(root, ["text_encoder", "tokenizer"])  # refuses what we cannot serve, before any weight
        te_dir = ck.component_path("text_encoder")
        config = Qwen3VLConfig.from_pretrained(te_dir)
        total = int(config.text_config.num_hidden_layers)
        if total <= layer:
            raise CheckpointError(
                f"H3 reads hidden_states[{layer}] of its Qwen3-VL text encoder, the output of decoder layer {layer} "
                f"before the final norm, so the encoder needs more than {layer} decoder layers; {te_dir} has {total}. "
                f"(A stack of exactly {layer} layers ends in the final norm, which is not what H3 was trained on.)")
        config.text_config.num_hidden_layers = layer
        if getattr(config.text_config, "layer_types", None):
            config.text_config.layer_types = list(config.text_config.layer_types)[:layer]
        config._attn_implementation = ATTENTION
        config.text_config._attn_implementation = ATTENTION
        config.vision_config._attn_implementation = ATTENTION

        with init_empty_weights(include_buffers=False):
            model = Qwen3VLModel(config)
        model.language_model.norm = nn.Identity()  # hidden_states[layer] is taken before the final norm

        # Stream only what the truncated model holds: skip decoder layers >= layer, the final norm, the LM head.
        wanted = {name for name, _ in model.named_parameters()}
        selected: dict[str, str] = {}
        for key in ck.weight_map("text_encoder"):
            name = _module_key(key)
            if name in wanted:
                selected[key] = name
        missing = sorted(wanted - set(selected.values()))
        if missing:
            raise CheckpointError(f"{te_dir} lacks {len(missing)} tensors the encoder needs, e.g. {missing[:3]}")
        on_host = tuple(f"language_model.layers.{j}." for j in host_layers)
        device = torch.device(device)
        for key, tensor in iter_tensors(ck, "text_encoder", names=selected, dtype_policy=dtype):
            name = selected[key]
            _set_tensor(model, name, tensor.to("cpu" if name.startswith(on_host) else device))
        for name, buf in list(model.named_buffers()):  # non-persistent ones (rotary inv_freq, float32) follow
            if not name.startswith(on_host):
                _set_tensor(model, name, buf.to(device))
        skipped = len(ck.weight_map("text_encoder")) - len(selected)
        log.info("loaded %d of %d decoder layers (+ vision tower) from %s; skipped %d checkpoint tensors "
                 "(decoder layers >= %d, final norm, LM head)", layer, total, te_dir, skipped, layer)

        tokenizer = Qwen2TokenizerFast.from_pretrained(root / "tokenizer")
        processor = load_processor(root)  # PIL image processor + Qwen3-VL's video processor (processor/)
        if processor.video_processor is None:
            log.info("no video processor (no torchvision or no video_preprocessor_config.json): ref2va video "
                     "references are refused")
        return cls(model, tokenizer, processor.image_processor, layer=layer, video_processor=processor.video_processor)

    # ------------------------------------------------------------------ properties
    @property
    def dtype(self) -> torch.dtype:
        return self.model.language_model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.language_model.embed_tokens.weight.device

    def offload(self, resident_layers: int):
        """Layerwise offload of the text decoder (lever --encoder-resident-layers): `resident_layers` slots on the
        device, the other layers streamed from pinned host memory one ahead; embeddings and vision tower stay."""
        return offload_layers(self.model.language_model.layers, resident_layers, self.device)

    @classmethod
    def load_with_levers(cls, checkpoint_dir: str | Path, *, dtype: torch.dtype, device: str | torch.device,
                         fp8: bool = False, resident_layers: int | None = None) -> "TextEncoder":
        """`load`, then `apply_levers`. With --encoder-resident-layers the streamed layers are read straight into
        host memory, so the device never holds the whole decoder (FP8 quantizes on the device first: then they
        are offloaded after)."""
        host = () if fp8 or resident_layers is None else OffloadPlan(DEFAULT_LAYER, resident_layers).streamed
        return cls.load(checkpoint_dir, dtype=dtype, device=device, host_layers=host).apply_levers(
            fp8=fp8, resident_layers=resident_layers)

    def apply_levers(self, *, fp8: bool = False, resident_layers: int | None = None,
                     row_parallel: tuple[type, ...] = ()) -> "TextEncoder":
        """The encoder's levers on the loaded (and, with TP, sharded: `row_parallel` names its row-shard class, each
        rank quantizes and streams its own shards) model: the decoder's projections in FP8 (--fp8), then layerwise
        offload (--encoder-resident-layers)."""
        if fp8:
            quantize_text_decoder(self.model, row_parallel=row_parallel)
        if resident_layers is not None:
            self.offload(resident_layers)
        return self

    @property
    def num_layers(self) -> int:
        return len(self.model.language_model.layers)

    # ------------------------------------------------------------------ presentation
    def present(self, prompt: str, *, images: Sequence = (), task: str = "t2va",
                references: Sequence[pres.Reference] | None = None) -> pres.Presentation:
        """Tokenize the presentation of a request and gather its vision inputs (no model call)."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a single str, got {type(prompt).__name__}")
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        if task == "t2va":
            if images or references:
                raise ValueError("t2va takes neither images nor references")
            return pres.build_t2va(self.tokenizer, prompt)
        if task == "fl2va":
            if references:
                raise ValueError("fl2va takes keyframes as `images`, not references")
            vision, counts = pres.preprocess_images(self.image_processor, list(images))
            p = pres.build_fl2va(self.tokenizer, prompt, counts)
            p.vision_inputs = vision
            return p
        # ref2va
        if images:
            raise ValueError("ref2va takes image references as `references`, not `images`")
        refs = list(references or [])
        vision, image_counts = pres.preprocess_images(self.image_processor,
                                                      [r.image for r in refs if r.kind == "image"])
        block_tokens, block_ts = [], []
        videos = [r for r in refs if r.kind == "video"]
        if videos:
            if self.video_processor is None:
                raise ValueError("ref2va video references need Qwen3-VL's video processor, which needs torchvision; "
                                 "it is not available here")
            temporal = self.video_processor.temporal_patch_size
            merge = self.video_processor.merge_size ** 2
            sampled = []
            for r in videos:
                frames = np.asarray(r.frames)
                idx, ts = pres.sample_video_frames(frames.shape[0], temporal_patch=temporal)
                sampled.append(np.stack([frames[i] for i in idx]))
                block_ts.append(ts)
            feats = self.video_processor(videos=sampled, do_sample_frames=False, return_tensors="pt")
            vision["pixel_values_videos"] = feats["pixel_values_videos"]
            vision["video_grid_thw"] = feats["video_grid_thw"]
            for grid, ts in zip(feats["video_grid_thw"], block_ts):
                if int(grid[0]) != len(ts):
                    raise ValueError(f"the video processor made {int(grid[0])} blocks for {len(ts)} timestamps")
                block_tokens.append(int(grid[1]) * int(grid[2]) // merge)
        p = pres.build_ref2va(self.tokenizer, prompt, refs, image_counts, block_tokens, block_ts)
        p.vision_inputs = vision
        return p

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward_presentation(self, p: pres.Presentation) -> torch.Tensor:
        """Run the truncated Qwen3-VL over a presentation → (1, L, D) in the encoder dtype."""
        dev = self.device
        input_ids = torch.tensor([p.token_ids], dtype=torch.long, device=dev)
        mm = torch.tensor([pres.mm_token_type_ids(p.token_ids, self.image_pad_id, self.video_pad_id)],
                          dtype=torch.long, device=dev)
        vision = {k: (v.to(dev, self.dtype) if k.startswith("pixel_") else v.to(dev))
                  for k, v in p.vision_inputs.items()}
        self.model.rope_deltas = None  # no state carried between requests
        out = self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=mm,
                         use_cache=False, **vision)
        return out.last_hidden_state.to(self.dtype)

    def encode(self, prompt: str, *, images: Sequence = (), task: str = "t2va",
               references: Sequence[pres.Reference] | None = None) -> EncodedText:
        """Encode one request: ``images`` are the fl2va keyframes in packed order (already on the canvas);
        ``references`` the ref2va references in request order (already normalized)."""
        p = self.present(prompt, images=images, task=task, references=references)
        states = self.forward_presentation(p)
        return EncodedText(states=states, tags=torch.tensor(p.tags, dtype=torch.long), token_ids=list(p.token_ids))
