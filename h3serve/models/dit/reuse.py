"""Step reuse (`quality=high`): skip the middle of the block stack on denoising steps where it would change little.

A DBCache-style policy over the packed sequence, per forward (= per denoising step):

    front blocks [0, F) always run; their residual p = x_F - x_0 is the probe;
    if the probe moved little since the last step whose middle ran,
        rel = sum|p - p_last| / sum|p_last| < threshold,
    the middle blocks [F, L - B) are replaced by that step's middle residual (x_{L-B} = x_F + m_last);
    else they run and m_last, p_last are refreshed;
    back blocks [L - B, L) always run.

The first `warmup_steps` and the last `final_steps` always run the middle, and at most `max_reuse_run` steps in a
row reuse it, so a reused residual is never older than that. With sequence parallelism the two sums are all-reduced
over the group, so every rank takes the same decision. The counts (`forwards_computed`: steps whose middle ran,
`block_evaluations`) are reported per request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ReuseConfig:
    front_blocks: int = 2
    back_blocks: int = 1
    threshold: float = 0.10
    warmup_steps: int = 4
    final_steps: int = 2
    max_reuse_run: int = 3

    def check(self, num_layers: int) -> "ReuseConfig":
        if self.front_blocks < 1 or self.back_blocks < 0 or self.front_blocks + self.back_blocks >= num_layers:
            raise ValueError(f"step reuse needs 1 <= front blocks ({self.front_blocks}) and front + back "
                             f"({self.front_blocks} + {self.back_blocks}) < the {num_layers} layers")
        if not self.threshold >= 0 or self.max_reuse_run < 0 or self.warmup_steps < 1 or self.final_steps < 0:
            raise ValueError(f"step reuse: threshold >= 0, max_reuse_run >= 0, warmup_steps >= 1, final_steps >= 0; "
                             f"got {self}")
        return self

    def fitted(self, num_layers: int) -> "ReuseConfig":
        """The same policy on a stack too shallow for its front + back blocks (small test models): back, then front,
        shrunk so that one middle block remains to skip. Deep enough stacks get the config unchanged."""
        back = min(self.back_blocks, max(0, num_layers - 2))
        front = min(self.front_blocks, max(1, num_layers - 1 - back))
        return self if (front, back) == (self.front_blocks, self.back_blocks) else dataclasses.replace(
            self, front_blocks=front, back_blocks=back)


class StepReuse:
    """The per-request state of the policy; `begin(num_steps)` before the first forward of a request."""

    def __init__(self, num_layers: int, config: ReuseConfig = ReuseConfig(), *, group=None):
        self.num_layers, self.config, self.group = num_layers, config.check(num_layers), group
        self.begin(0)

    def begin(self, num_steps: int) -> None:
        self.num_steps = num_steps
        self.step = 0
        self.run_length = 0
        self.forwards_computed = 0
        self.block_evaluations = 0
        self.changes: list[float | None] = []  # per step: the probe's relative change (None: not measured)
        self._probe: torch.Tensor | None = None  # p_last (B, S, D)
        self._middle: torch.Tensor | None = None  # m_last (B, S, D)

    def end(self) -> None:
        """Drop the cached residuals (two activations' worth of memory)."""
        self._probe = self._middle = None

    def _relative_change(self, probe: torch.Tensor) -> float:
        d = torch.stack([(probe - self._probe).abs().float().sum(), self._probe.abs().float().sum()])
        if self.group is not None:
            dist.all_reduce(d, group=self.group)
        num, den = d.tolist()  # the one host sync of a step
        return num / den if den > 0 else float("inf")

    def run(self, model, x: torch.Tensor, ctx) -> torch.Tensor:
        """`H3DiT.run_blocks` for one step: x (B, S, D) in, updated in place, out."""
        c, n = self.config, self.num_layers
        f, b = c.front_blocks, n - c.back_blocks
        i = self.step
        self.step += 1
        x_in = x.clone()
        x = model.run_blocks(x, ctx, 0, f)
        probe = x - x_in  # (B, S, D) front residual
        del x_in
        may_reuse = (self._middle is not None and i >= c.warmup_steps and self.run_length < c.max_reuse_run
                     and (self.num_steps == 0 or i < self.num_steps - c.final_steps))
        change = self._relative_change(probe) if may_reuse else None
        self.changes.append(change)
        evaluated = f + c.back_blocks  # a reused step runs the front and back only
        if change is not None and change < c.threshold:
            x.add_(self._middle)
            self.run_length += 1
        else:
            h = x.clone()
            x = model.run_blocks(x, ctx, f, b)
            self._middle = x - h
            self._probe = probe
            self.run_length = 0
            self.forwards_computed += 1
            evaluated = n
        x = model.run_blocks(x, ctx, b, n)
        self.block_evaluations += evaluated
        return x

    def report(self) -> dict:
        return {"forwards": self.step, "forwards_computed": self.forwards_computed,
                "block_evaluations": self.block_evaluations, "num_layers": self.num_layers,
                "changes": [None if v is None else round(v, 5) for v in self.changes]}
