"""The one degree rule: how the stages of one replica may be split over GPUs.

Encoder tensor parallel splits the text encoder's attention heads: it divides the query heads, and divides the KV
heads or is a multiple of them (each rank then holds a replica of the one KV head its query heads read: exact, at
the cost of recomputing that KV projection on several ranks). DiT Ulysses gives each rank whole heads, so it
divides the DiT's heads; Ring is free, and Ulysses x Ring = the DiT's GPUs. VAE patch parallel is 1 or the whole DiT
group. The runtime checks degrees with `ParallelDegrees.validate` (against the checkpoint's head counts); the spec's
rules and the CRD's CEL take their allowed values from the functions below.

Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from h3serve.config.vocab import DIT_HEADS, ENCODER_HEADS, ENCODER_KV_HEADS
from h3serve.errors import H3Error

T = TypeVar("T")


class DegreeError(H3Error, ValueError):
    """A parallel degree cannot work with this model or this number of ranks; the message says what to change."""


# The degree rules' messages, written once for the runtime and the spec: `{encoder_tp}`, `{ulysses}`, `{ring}` and
# `{vae_pp}` are how the caller spells each degree (FLAG_NAMES for `h3serve generate / serve`, the CRD field paths
# for the spec), the other placeholders the values.
ENCODER_TP_MESSAGE = ("{encoder_tp}={tp:d} cannot split the encoder's {heads} query heads / {kv} KV heads (it must "
                      "divide the heads, and divide the KV heads or be a multiple of them): use {choices}")
ULYSSES_MESSAGE = ("{ulysses}={u:d} must divide the DiT's {heads} attention heads (Ulysses gives each rank whole "
                   "heads): use {choices} and put the rest of the DiT's GPUs into {ring} ({ulysses} x {ring} = GPUs "
                   "of the DiT)")
VAE_PP_MESSAGE = "{vae_pp}={pp:d} must be 1 or the whole DiT group ({ulysses} x {ring} = {sp:d})"
FLAG_NAMES = {"encoder_tp": "encoder_tp", "ulysses": "ulysses", "ring": "ring", "vae_pp": "vae_pp"}


def join_choices(xs) -> str:
    """1, 2, 4 or 8."""
    xs = [str(x) for x in xs]
    return ", ".join(xs[:-1]) + " or " + xs[-1] if len(xs) > 1 else xs[0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def encoder_tp_choices(heads: int = ENCODER_HEADS, kv_heads: int = ENCODER_KV_HEADS) -> list[int]:
    """Encoder TP degrees: divide the query heads, and divide the KV heads or are a multiple of them."""
    return [d for d in _divisors(heads) if kv_heads % d == 0 or d % kv_heads == 0]


def ulysses_choices(heads: int = DIT_HEADS) -> list[int]:
    """Ulysses degrees: each rank takes whole heads."""
    return _divisors(heads)


def vae_pp_choices(dit_world: T) -> tuple[int, T]:
    """VAE patch-parallel degrees: off, or the whole DiT group (`dit_world` may be a number or a spec expression)."""
    return (1, dit_world)


@dataclass(frozen=True)
class ParallelDegrees:
    """How the stages of one replica are split: encoder TP, DiT Ulysses x Ring, VAE patch parallel.

    Every stage uses ranks [0, degree) of one world of `world_size` = max of the stage sizes processes.
    """

    encoder_tp: int = 1
    ulysses: int = 1
    ring: int = 1
    vae_pp: int = 1

    @property
    def dit_world(self) -> int:
        return self.ulysses * self.ring

    @property
    def world_size(self) -> int:
        return max(self.encoder_tp, self.dit_world, self.vae_pp)

    @property
    def trivial(self) -> bool:
        return self.world_size == 1

    def check_devices(self, count: int, stages=("encoder", "dit", "vae")) -> "ParallelDegrees":
        """Rank r of a stage runs on cuda:r: the largest of `stages`' degrees must not exceed the `count` CUDA
        devices this process sees (checked before any rank starts: an extra rank fails to find its device)."""
        sizes = {"encoder": (self.encoder_tp, f"--encoder-tp {self.encoder_tp}"),
                 "dit": (self.dit_world, f"--ulysses {self.ulysses} x --ring {self.ring}"),
                 "vae": (self.vae_pp, f"--vae-pp {self.vae_pp}")}
        n, what = max((sizes[s] for s in stages if s in sizes), default=(1, ""))
        if n > count:
            raise DegreeError(f"{what} = {n} ranks, one per CUDA device, but {count} CUDA device"
                              f"{'' if count == 1 else 's'} visible: lower the degree to at most {max(count, 1)}, "
                              "or use --device cpu")
        return self

    def validate(self, *, dit_heads: int = DIT_HEADS, encoder_heads: int = ENCODER_HEADS,
                 encoder_kv_heads: int = ENCODER_KV_HEADS, encoder_intermediate: int | None = None,
                 world_size: int | None = None) -> "ParallelDegrees":
        """Check every degree against the model's head counts (release defaults) and, if given, the world size.

        Raises `DegreeError` with the allowed values.
        """
        for name in ("encoder_tp", "ulysses", "ring", "vae_pp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise DegreeError(f"{name}={v!r} is invalid: a parallel degree is a positive integer (1 = off)")
        if self.ulysses not in ulysses_choices(dit_heads):
            raise DegreeError(ULYSSES_MESSAGE.format(**FLAG_NAMES, u=self.ulysses, heads=dit_heads,
                                                     choices=join_choices(ulysses_choices(dit_heads))))
        tp, h, kv = self.encoder_tp, encoder_heads, encoder_kv_heads
        if tp not in encoder_tp_choices(h, kv):
            raise DegreeError(ENCODER_TP_MESSAGE.format(**FLAG_NAMES, tp=tp, heads=h, kv=kv,
                                                        choices=join_choices(encoder_tp_choices(h, kv))))
        if encoder_intermediate is not None and encoder_intermediate % tp:
            raise DegreeError(f"encoder_tp={tp} does not divide the encoder MLP width {encoder_intermediate}; "
                              f"use a divisor of it")
        if self.vae_pp not in vae_pp_choices(self.dit_world):
            raise DegreeError(VAE_PP_MESSAGE.format(**FLAG_NAMES, pp=self.vae_pp, sp=self.dit_world))
        if world_size is not None and world_size != self.world_size:
            raise DegreeError(
                f"WORLD_SIZE={world_size} but these degrees (encoder_tp={self.encoder_tp}, ulysses={self.ulysses}, "
                f"ring={self.ring}, vae_pp={self.vae_pp}) need max(encoder_tp, ulysses x ring, vae_pp) = "
                f"{self.world_size} ranks; start that many ranks or change the degrees.")
        return self
