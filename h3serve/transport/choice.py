"""The transport of a stage's edges, decided once per process: the name a deployment asks for (`grpc` | `nixl`,
`config.vocab.TRANSPORTS`), the one it gets here and why (`TransportChoice`). `nixl` falls back to `grpc` with the
reason when NIXL cannot be used in this process; the reason goes to the logs, the Status details and the metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from h3serve.config.vocab import GRPC, NIXL, TRANSPORTS
from h3serve.transport.nixl.probe import count, nixl_available

log = logging.getLogger("h3serve.transport.nixl.probe")   # the fallback is NIXL news: logged beside the probe's


def validate_transport(name: str) -> None:
    if name not in TRANSPORTS:
        raise ValueError(f"transport={name!r} is invalid: use one of {', '.join(TRANSPORTS)}")


def select_transport(requested: str, *, probe=None) -> tuple[str, str]:
    """The transport a deployment asked for and the one it gets, with the reason.

    `nixl` falls back to `grpc` with a warning when NIXL cannot be loaded here or `probe()` (optional: e.g. a test
    connection to the peer) raises.
    """
    validate_transport(requested)
    if requested == GRPC:
        return GRPC, "requested"
    ok, reason = nixl_available()
    if ok and probe is not None:
        try:
            probe()
        except Exception as e:
            ok, reason = False, f"peer cannot connect: {e}"
    if not ok:
        log.warning("transport nixl requested, using grpc: %s", reason)
        count("fallbacks_total")
        return GRPC, reason
    log.info("transport nixl: %s", reason)
    return NIXL, reason


@dataclass(frozen=True)
class TransportChoice:
    """The transport of a stage's edges: configured (`requested`), usable in this process (`chosen`), and why."""

    requested: str
    chosen: str = GRPC
    reason: str = "requested"

    @classmethod
    def undecided(cls, requested: str) -> "TransportChoice":
        """Before load: gRPC until `decide` ran."""
        return cls(requested, GRPC, "requested" if requested == GRPC else "not decided yet (at load)")

    @classmethod
    def decide(cls, requested: str, stage: str, *, probe: bool = True) -> "TransportChoice":
        """`nixl` when NIXL works in this process, else `grpc` with the reason (logged). `probe=False`: a stage
        that moves no tensor by NIXL itself (the encoder, the gateway) checks the name and uses gRPC."""
        if probe:
            return cls(requested, *select_transport(requested))
        validate_transport(requested)
        return cls(requested, GRPC, "requested" if requested == GRPC else
                   f"the {stage} has no NIXL edge: its tensors travel by gRPC")

    def summary(self) -> dict:
        """The Status details' `transport` of every stage: {requested, chosen, reason}."""
        return {"requested": self.requested, "chosen": self.chosen, "reason": self.reason}

    def details(self, edge: str, last_stream: dict | None) -> dict:
        """An edge's entry in the Status details: this process's choice and what the edge's last stream used."""
        return {"edge": edge, **self.summary(), "last_stream": last_stream}
