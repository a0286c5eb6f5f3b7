"""The Ulysses exchange (h3serve/models/dit/parallel.py) on its own, over 2 gloo ranks: rows <-> heads, exactly."""

from __future__ import annotations

import pytest

from h3serve.distributed.world import launch

from .workers import build_exchange


@pytest.mark.parametrize("batch", [1, 2])
def test_ulysses_exchange_moves_rows_and_heads_exactly(batch):
    with launch(2, build_exchange, device="cpu", timeout_s=60) as handle:
        assert handle.call("exchange", (batch, 4, 5, 3)) is True
        assert all(v == "ok" for v in handle.last_outcomes.values())
