"""What a stage reports it chose: the DiT's attention kernel and the transport of every stage, each with its reason
(Status details and the h3serve_stage_choice metric)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from h3serve.config.stage import StageConfig
from h3serve.models.dit import kernels
from h3serve.runtime import metrics as SM
from h3serve.runtime.stage import StageBase

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the reasons of a machine without a CUDA device")


@pytest.fixture
def fresh_choice(monkeypatch):
    monkeypatch.delenv("H3SERVE_ATTENTION", raising=False)
    kernels.reset_attention_choice()
    yield
    kernels.reset_attention_choice()


@cpu_only
def test_auto_attention_on_cpu_is_sdpa_because_there_is_no_cuda_device(fresh_choice):
    assert kernels.attention_choice("cpu") == {"kernel": "sdpa", "reason": "auto: no CUDA device"}
    assert kernels.fa3_unavailable() == "no CUDA device" and not kernels.fa3_available()
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))   # the forward runs the kernel reported
    torch.testing.assert_close(kernels.auto_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))


def test_forced_attention_names_the_variable(fresh_choice, monkeypatch):
    monkeypatch.setenv("H3SERVE_ATTENTION", "SDPA")
    assert kernels.attention_choice("cpu") == {"kernel": "sdpa", "reason": "H3SERVE_ATTENTION=SDPA"}


@cpu_only
def test_fp8_lever_reason_says_which_path_runs(fresh_choice):
    kernels.choose_attention("cpu", "fp8", "the fp8_attention lever is on")
    assert kernels.chosen_attention("cpu")[0] == "fp8"
    assert kernels.attention_choice("cpu") == {
        "kernel": "fp8",
        "reason": "the fp8_attention lever is on; SDPA on the dequantized e4m3 operands (no CUDA device)"}


class Encoder(StageBase):
    stage = "encoder"

    def attention(self) -> dict:
        return {"kernel": "sdpa", "reason": "fixed"}


class Muxer(StageBase):
    stage = "muxer"


def test_a_stage_without_nixl_edges_reports_grpc_and_why():
    enc = Encoder(StageConfig.from_knobs(stage="encoder", transport="nixl"))
    try:
        assert enc.info()["transport"] == {"requested": "nixl", "chosen": "grpc",
                                           "reason": "not decided yet (at load)"}
        enc.choose_transport(probe=False)
        info = enc.info()
        assert info["transport"] == {"requested": "nixl", "chosen": "grpc",
                                     "reason": "the encoder has no NIXL edge: its tensors travel by gRPC"}
        assert info["attention"] == {"kernel": "sdpa", "reason": "fixed"}
        with pytest.raises(ValueError, match="transport='rdma' is invalid: use one of grpc, nixl"):
            Encoder(StageConfig.from_knobs(stage="encoder", transport="rdma")).choose_transport(probe=False)
    finally:
        enc.close()


def test_choice_metric_names_kernel_and_transport(monkeypatch):
    monkeypatch.setenv("H3SERVE_NIXL_DISABLE", "1")
    mux, enc = Muxer(StageConfig.from_knobs(stage="muxer", transport="nixl")), Encoder(StageConfig.from_knobs(stage="encoder"))
    try:
        mux.choose_transport()   # NIXL disabled here: grpc, with the reason in the Status
        t = mux.info()["transport"]
        assert (t["requested"], t["chosen"]) == ("nixl", "grpc") and "H3SERVE_NIXL_DISABLE" in t["reason"], t
        assert "attention" not in mux.info()
        samples = {(s.name, tuple(sorted(s.labels.items())), s.value)
                   for st in (mux, enc) for fam in SM.StageCollector(st).collect() for s in fam.samples
                   if s.name == "h3serve_stage_choice"}
        assert samples == {
            ("h3serve_stage_choice", (("attention", "none"), ("stage", "muxer"), ("transport", "grpc")), 1),
            ("h3serve_stage_choice", (("attention", "sdpa"), ("stage", "encoder"), ("transport", "grpc")), 1)}
    finally:
        mux.close()
        enc.close()


def test_dit_reports_attention_once_ready_and_a_bad_forced_name_without_failing_status(fresh_choice, monkeypatch):
    from h3serve.services.dit import DiTServicer

    dit = DiTServicer(StageConfig.from_knobs(stage="dit", device="cpu"))
    try:
        assert "attention" not in dit.info()   # not loaded: nothing chosen yet
        dit.device, dit.ready = torch.device("cpu"), True
        monkeypatch.setenv("H3SERVE_ATTENTION", "nope")
        assert dit.info()["attention"] == {
            "kernel": "none", "reason": "unknown attention implementation 'nope'; choose one of "
                                        "('sdpa', 'cudnn', 'flash', 'fa3', 'fp8') or 'auto'"}
    finally:
        dit.close()
