"""`StageConfig`: every knob of every stage process, one dataclass (a stage reads the ones it uses)."""

from __future__ import annotations

from dataclasses import dataclass, field

@dataclass
class StageConfig:
    """Every knob of every stage (a stage reads the ones it uses; see docs/services.md)."""

    stage: str = "gateway"
    checkpoint: str | None = None
    profile: str = "base"
    adapter: str | None = None
    adapter_sha256: str | None = None
    dtype: str = "fp32"
    device: str | None = None
    threads: int = 0                 # torch intra-op threads of the engine (0: torch's default)
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None     # address peers should use for this process (default host:port)
    grace_s: float = 30.0
    rpc_workers: int = 32
    warmup: bool = True
    # gateway
    encoder: str | None = None
    dit: str | None = None
    vae: str | None = None
    muxer: str | None = None
    http_host: str = "127.0.0.1"
    http_port: int | None = None     # None: no HTTP API
    queue_size: int = 8
    max_inflight: int = 1
    request_timeout_s: float = 3600.0
    jobs_dir: str | None = None
    job_ttl_s: float = 3600.0
    max_jobs: int = 1000
    max_sync_bytes: int = 64 << 20
    transport: str = "grpc"
    model_name: str | None = None
    # parallel degrees of the model stages (encoder TP, DiT Ulysses x Ring, VAE patch parallel); see stage_ranks
    encoder_tp: int = 1
    ulysses: int = 1
    ring: int = 1
    vae_pp: int = 1
    # vae
    frame_format: str = "yuv420p"    # what the VAE sends the muxer: yuv420p planes (1.5 B/px) or rgb24 (3 B/px)
    # muxer
    mux_threads: int = 16  # x264 frame threads (fixed: the MP4 bytes depend on it)
    crf: int = 18
    preset: str = "veryfast"
    session_ttl_s: float = 600.0
    tmp_dir: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def address(self) -> str:
        """The address peers use: --advertise, else host:port (loopback when bound to every interface)."""
        return self.advertise or f"{connect_host(self.host)}:{self.port}"


def connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host
