"""Per-caller share and limits of the gateway's fair queue (`--caller-limits`, CRD `gateway.callers`), checked
once here for both; the queue itself is services/gateway/scheduling.py."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

from h3serve.errors import H3Error

ANY_CALLER = "*"
# CRD gateway.callers[] item <-> CallerLimits field
SPEC_NAMES = {"share": "share", "maxRunning": "max_running", "maxQueued": "max_queued",
              "videoSecondsPerHour": "video_seconds_per_hour"}


@dataclass(frozen=True)
class CallerLimits:
    share: float = 1.0
    max_running: int | None = None
    max_queued: int | None = None
    video_seconds_per_hour: float | None = None


_BOUNDS = {"share": (0.01, 1000.0), "max_running": (1, 10_000), "max_queued": (1, 100_000),
           "video_seconds_per_hour": (1.0, 1e9)}


def parse_caller_limits(text: str | None) -> dict[str, CallerLimits]:
    """`--caller-limits`: a JSON object, caller name (or `*`) -> {share, max_running, max_queued,
    video_seconds_per_hour}; H3Error naming the caller, the key and the allowed range."""
    if not text:
        return {}
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise H3Error(f"--caller-limits: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise H3Error("--caller-limits: a JSON object of caller name -> limits")
    known = {f.name for f in fields(CallerLimits)}
    out = {}
    for name, limits in doc.items():
        if not isinstance(limits, dict):
            raise H3Error(f"--caller-limits: {name}: an object of {', '.join(sorted(known))}")
        for key, value in limits.items():
            if key not in known:
                raise H3Error(f"--caller-limits: {name}.{key}: unknown; allowed: {', '.join(sorted(known))}")
            lo, hi = _BOUNDS[key]
            integral = isinstance(lo, int)
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                  and lo <= value <= hi and (not integral or float(value).is_integer()))
            if not ok:
                raise H3Error(f"--caller-limits: {name}.{key}={value!r}: {'an integer' if integral else 'a number'} "
                              f"in [{lo}, {hi}]")
        out[name] = CallerLimits(**{k: (int(v) if isinstance(_BOUNDS[k][0], int) else float(v))
                                    for k, v in limits.items()})
    return out


def callers_json(callers: list[dict] | None) -> str | None:
    """CRD `gateway.callers` as `--caller-limits` JSON."""
    if not callers:
        return None
    return json.dumps({c.get("name"): {SPEC_NAMES.get(k, k): v for k, v in c.items() if k != "name"}
                       for c in callers}, sort_keys=True)
