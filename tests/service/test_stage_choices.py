"""Every stage's Status says which transport it chose and why; the DiT's (and the encoder's) which attention kernel
it runs and why."""

from __future__ import annotations

import json

import torch

from .conftest import STAGES


def test_status_names_attention_kernel_and_transport_with_reasons(stack):
    infos = {stage: json.loads(stack.status(stage).info_json) for stage in STAGES}
    for stage, info in infos.items():   # --transport grpc (the default): every stage on gRPC, as requested
        t = info["transport"]
        assert (t["requested"], t["chosen"], t["reason"]) == ("grpc", "grpc", "requested"), (stage, t)
    assert infos["vae"]["latents_transport"]["chosen"] == "grpc"
    dit = infos["dit"]["attention"]
    if torch.cuda.is_available():
        assert dit["kernel"] in ("fa3", "cudnn") and dit["reason"].startswith("auto: "), dit
    else:
        assert dit == {"kernel": "sdpa", "reason": "auto: no CUDA device"}, dit
    assert infos["encoder"]["attention"] == {
        "kernel": "sdpa", "reason": "fixed: the Qwen3-VL encoder runs transformers' 'sdpa' attention"}
    assert "attention" not in infos["vae"] and "attention" not in infos["muxer"]   # no attention in them
