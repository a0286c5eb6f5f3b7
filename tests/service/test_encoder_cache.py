"""The encoder's cache: a hit returns the bytes a miss sent; the key changes with everything that changes the output
(prompt, task, condition images, canvas, checkpoint); hits / misses in the stage Status and the gateway's metrics;
the byte bound evicts the least recently used."""

from __future__ import annotations

import json

import grpc
import httpx
import numpy as np
import torch

from h3serve._proto import common_pb2, encoder_pb2, encoder_pb2_grpc
from h3serve.models.encoder.cache import EncodeCache, cache_key, checkpoint_identity
from h3serve.transport.grpc import iter_tensor_chunks

from .conftest import REQUEST


def _encode(stub, prompt: str, rid: str) -> tuple[list[bytes], bool]:
    events = list(stub.Encode(encoder_pb2.EncodeRequest(request_id=rid, prompt=prompt, task="t2va"), timeout=60))
    chunks = [e.chunk.SerializeToString() for e in events if e.WhichOneof("event") == "chunk"]
    return chunks, events[-1].done.cache_hit


def _conditioned(stub, image: np.ndarray, rid: str, width: int = 320) -> tuple[list[bytes], bool]:
    params = encoder_pb2.EncodeParams(request_id=rid, prompt="a kite", task="fl2va", width=width, height=256,
                                      kinds=["first"])
    inputs = [encoder_pb2.EncodeInput(params=params),
              *(encoder_pb2.EncodeInput(chunk=c) for c in iter_tensor_chunks("condition.0", torch.from_numpy(image))),
              encoder_pb2.EncodeInput(end=common_pb2.StreamEnd(tensors=1))]
    events = list(stub.EncodeConditioned(iter(inputs), timeout=60))
    return [e.chunk.SerializeToString() for e in events if e.WhichOneof("event") == "chunk"], \
        events[-1].done.cache_hit


def test_hit_is_byte_identical_and_counted(stack):
    with grpc.insecure_channel(stack.addresses["encoder"]) as ch:
        stub = encoder_pb2_grpc.EncoderStub(ch)
        before = json.loads(stack.status("encoder").info_json)["cache"]
        miss, hit0 = _encode(stub, "a prompt only this test sends", "cache-1")
        again, hit1 = _encode(stub, "a prompt only this test sends", "cache-2")
        other, hit2 = _encode(stub, "a prompt only this test sends!", "cache-3")
        assert (hit0, hit1, hit2) == (False, True, False)
        assert again == miss and other != miss
        rng = np.random.default_rng(0)
        image = rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)
        a, h_a = _conditioned(stub, image, "cache-4")
        b, h_b = _conditioned(stub, image.copy(), "cache-5")
        image2 = image.copy()
        image2[0, 0, 0] ^= 1
        c, h_c = _conditioned(stub, image2, "cache-6")            # one pixel differs
        d, h_d = _conditioned(stub, image, "cache-7", width=352)  # another canvas
        assert (h_a, h_b, h_c, h_d) == (False, True, False, False)
        assert a == b and a != c
        after = json.loads(stack.status("encoder").info_json)["cache"]
    assert after["hits"] - before["hits"] == 2 and after["misses"] - before["misses"] == 5
    assert 0 < after["bytes"] <= after["capacity_bytes"]


def test_gateway_metrics_count_hits(stack):
    from h3serve.client import Client

    def counts():
        text = httpx.get(f"{stack.http}/metrics", timeout=10).text
        return {r: float(next(line.split()[-1] for line in text.splitlines()
                              if line.startswith(f'h3serve_encoder_cache_total{{result="{r}"}}')))
                for r in ("hit", "miss")}

    with Client(stack.grpc, timeout=120) as client:
        client.generate_sync(**dict(REQUEST, prompt="metrics: the first time"))
        before = counts()
        client.generate_sync(**dict(REQUEST, prompt="metrics: the first time"))
    after = counts()
    assert after["hit"] - before["hit"] == 1 and after["miss"] == before["miss"]


def test_byte_bound_evicts_least_recently_used():
    cache = EncodeCache(capacity_bytes=3 * 400)
    t = lambda v: (torch.full((1, 10, 10), float(v)), torch.ones(0, dtype=torch.long))  # noqa: E731 - 400 B each
    for k in "abc":
        cache.put(k, *t(ord(k)))
    assert cache.get("a") is not None           # a is now the most recent
    cache.put("d", *t(4))                       # evicts b
    assert cache.get("b") is None and cache.get("c") is not None and cache.get("d") is not None
    snap = cache.snapshot()
    assert snap["entries"] == 3 and snap["bytes"] == 1200 and snap["evictions"] == 1
    cache.put("huge", torch.zeros(1, 100, 100), torch.ones(0, dtype=torch.long))   # larger than the cache: kept out
    assert cache.get("huge") is None and cache.snapshot()["entries"] == 3


def test_key_covers_checkpoint_and_dtype(copy_checkpoint):
    ck = copy_checkpoint()
    ident = checkpoint_identity(ck)
    base = dict(identity=ident, dtype="fp32", layer=50, short_edge=2048, task="t2va", prompt="p")
    key = cache_key(**base)
    assert cache_key(**base) == key
    assert cache_key(**dict(base, dtype="bf16")) != key
    assert cache_key(**dict(base, task="fl2va")) != key
    cfg = ck / "text_encoder" / "config.json"
    cfg.write_text(cfg.read_text() + " ")
    assert checkpoint_identity(ck) != ident
