import threading

import pytest
import torch

from h3serve.errors import TransportError
from h3serve.transport.base import TensorHeader, tensor_bytes, tensor_from_bytes
from h3serve.transport.inproc import InProcChannel


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_bytes_round_trip(dtype):
    t = (torch.randn(3, 5, 7) * 50).to(dtype)
    h = TensorHeader.of("x", t)
    back = tensor_from_bytes(h, bytes(tensor_bytes(t)))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_empty_tensor_round_trip():
    t = torch.empty(0, 3, dtype=torch.float32)
    h = TensorHeader.of("e", t)
    assert len(tensor_bytes(t)) == 0
    assert tensor_from_bytes(h, b"").shape == (0, 3)


def test_wrong_byte_count_is_refused():
    h = TensorHeader("x", "float32", (4,))
    with pytest.raises(TransportError, match="15 bytes"):
        tensor_from_bytes(h, b"\0" * 15)


def test_inproc_order_and_backpressure():
    ch = InProcChannel(depth=2, edge="vae->muxer")
    got = []

    def consume():
        for msg in ch.receiver:
            got.append((msg.header.name, int(msg.tensor.sum())))

    t = threading.Thread(target=consume)
    t.start()
    for i in range(10):
        ch.sender.send(f"clip{i}", torch.full((4,), i, dtype=torch.uint8))
    ch.sender.close()
    t.join(5)
    assert got == [(f"clip{i}", 4 * i) for i in range(10)]


def test_inproc_full_queue_times_out_with_edge_name():
    ch = InProcChannel(depth=1, edge="dit->vae")
    ch.sender.send("a", torch.zeros(1))
    with pytest.raises(TransportError, match="dit->vae"):
        ch.sender.send("b", torch.zeros(1), timeout=0.05)
