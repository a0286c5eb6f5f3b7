"""Whether NIXL can be used in this process (`nixl_available`), and the process-wide NIXL counters (for the metrics
and the leak checks). The transport a stage gets: `h3serve.transport.choice`."""

from __future__ import annotations

import collections
import logging
import os
import threading
import uuid
from importlib.metadata import PackageNotFoundError, version

log = logging.getLogger(__name__)

DISABLE_ENV = "H3SERVE_NIXL_DISABLE"


def import_nixl():
    """`nixl._api` (the CUDA-variant wheel the meta package picks), with its INFO chatter turned down."""
    # lazy: optional package (pip install 'h3serve[nixl]'); without it every stream falls back to grpc
    import nixl  # noqa: F401  (selects nixl_cu12 / nixl_cu13 and aliases it as nixl._api)
    from nixl import _api

    if not os.environ.get("NIXL_LOG_LEVEL"):
        # nixl configures its logger at import (INFO on stdout, one line per agent); keep warnings and errors.
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return _api


_available: tuple[bool, str] | None = None
_available_lock = threading.Lock()


def nixl_available() -> tuple[bool, str]:
    """(True, description) when NIXL imports and a UCX backend can be created here, else (False, reason).

    The probe (one throwaway agent) runs once per process; `H3SERVE_NIXL_DISABLE=1` is checked on every call.
    """
    global _available
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return False, f"NIXL disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    with _available_lock:
        if _available is None:
            _available = _probe_nixl()
        return _available


def _probe_nixl() -> tuple[bool, str]:
    try:
        api = import_nixl()
    except Exception as e:  # ImportError, missing shared libraries, CUDA variant mismatch
        return False, f"cannot import nixl: {type(e).__name__}: {e}"
    try:
        agent = api.nixl_agent(f"h3-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                               api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in agent.backends:
            return False, f"NIXL has no UCX backend (plugins: {', '.join(agent.get_plugin_list()) or 'none'})"
        mems = agent.get_backend_mem_types("UCX")
        del agent
    except Exception as e:
        return False, f"NIXL UCX backend cannot start: {type(e).__name__}: {e}"
    return True, f"NIXL {nixl_version()} with UCX ({'/'.join(m.replace('_SEG', '') for m in mems)})"


def nixl_version() -> str:
    try:
        return version("nixl")
    except PackageNotFoundError:
        return "?"


# Counters: process-wide, so that a leak (an agent or a region never released) shows in the metrics.

_counters_lock = threading.Lock()
_counters: dict[str, int] = collections.defaultdict(int)


def count(name: str, n: int = 1) -> None:
    with _counters_lock:
        _counters[name] += n


def counters() -> dict[str, int]:
    """Process-wide counts: agents_live, regions_registered, bytes_registered, fallbacks_total,
    streams_failed_total, xfers_leaked (handles NIXL refused to release; should stay 0)."""
    with _counters_lock:
        keys = ("agents_live", "regions_registered", "bytes_registered", "fallbacks_total",
                "streams_failed_total", "xfers_leaked")
        return {k: int(_counters[k]) for k in keys}

