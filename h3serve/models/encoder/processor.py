"""The Qwen3-VL processor (tokenizer + PIL image processor + video processor) of an H3 checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

from h3serve.errors import CheckpointError


def load_processor(path: str | os.PathLike, *, subfolder: str = "processor", tokenizer_subfolder: str = "tokenizer"):
    """Build the Qwen3-VL processor of a checkpoint without torchvision.

    `Qwen3VLProcessor.from_pretrained` needs `Qwen3VLVideoProcessor`, which needs torchvision; this builds the
    processor from the folder's files instead: the tokenizer (`processor/` if it has one, else `tokenizer/`) and a
    `Qwen2VLImageProcessorPil` with the patch / merge / temporal sizes, mean / std and pixel bounds of
    `processor/preprocessor_config.json`, and Qwen3-VL's video processor (`load_video_processor`; None without
    torchvision or its config file, and then video references cannot be encoded); everything the image and text paths use (`image_processor`, `create_mm_token_type_ids`, the pad token ids)
    works. Pass the result to diffusers with `pipe.update_components(processor=...)`.
    """
    # lazy: transformers' processor classes take seconds to import; only loading needs them
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor

    root = Path(path)
    proc_dir = root / subfolder
    cfg_path = proc_dir / "preprocessor_config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{subfolder}/preprocessor_config.json: missing in {root}")
    cfg = json.loads(cfg_path.read_text())
    if "image_processor" in cfg and isinstance(cfg["image_processor"], dict):  # nested processor_config layout
        cfg = cfg["image_processor"]
    keys = ("do_resize", "resample", "size", "do_rescale", "rescale_factor", "do_normalize", "image_mean",
            "image_std", "do_convert_rgb", "patch_size", "temporal_patch_size", "merge_size")
    kwargs = {k: cfg[k] for k in keys if k in cfg}
    if "size" not in kwargs and ("min_pixels" in cfg or "max_pixels" in cfg):
        kwargs["size"] = {"shortest_edge": cfg.get("min_pixels"), "longest_edge": cfg.get("max_pixels")}
    image_processor = Qwen2VLImageProcessorPil(**kwargs)

    tok_dir = proc_dir if (proc_dir / "tokenizer.json").is_file() else root / tokenizer_subfolder
    if not (tok_dir / "tokenizer.json").is_file() and not (tok_dir / "vocab.json").is_file():
        raise CheckpointError(f"{tokenizer_subfolder}/tokenizer.json: missing in {root}")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))

    video_processor = load_video_processor(proc_dir)
    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    check = processor.check_argument_for_proper_class

    def _check(argument_name, argument):  # only `video_processor=None` is let through
        if argument_name == "video_processor" and argument is None:
            return None
        return check(argument_name, argument)

    processor.check_argument_for_proper_class = _check
    try:
        processor.__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor)
    finally:
        del processor.check_argument_for_proper_class
    return processor


def load_video_processor(proc_dir: str | os.PathLike):
    """Qwen3-VL's own video processor from `video_preprocessor_config.json` (ref2va video references), or None when
    the folder has none or torchvision cannot be imported (then video references are refused where they arrive)."""
    if not (Path(proc_dir) / "video_preprocessor_config.json").is_file():
        return None
    try:  # lazy: needs torchvision
        from transformers import AutoVideoProcessor

        return AutoVideoProcessor.from_pretrained(str(proc_dir))
    except ImportError:
        return None
