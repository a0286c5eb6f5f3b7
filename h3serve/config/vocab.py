"""The one vocabulary of h3serve: stages, tasks, profiles, dtypes, ports, gRPC service names and the model facts
the parallel layout must respect. Everything else imports these names."""

from __future__ import annotations

# ---- stages ---------------------------------------------------------------------------------------------------
PIPELINE_STAGES = ("encoder", "dit", "vae", "muxer")  # the stages a request flows through, in order
MODEL_STAGES = ("encoder", "dit", "vae")               # the ones that load weights and run on GPUs
STAGES = (*PIPELINE_STAGES, "gateway")                 # every process `h3serve serve` can run
START_ORDER = ("muxer", "vae", "dit", "encoder", "gateway")
# A FastH3 DiT pool beside a base deployment (`--fasth3-dit` of the gateway; `h3serve serve --fasth3-adapter`
# runs it on the same host, on the base port + its offset)
FASTH3_DIT = "dit-fasth3"
# The extra gang a rolling update starts before it rolls the old ones (`<name>-<component>-s`, dit.rollout.maxSurge):
# one letter, never longer than a gang's index, so the name length checks of the gangs cover it.
SURGE_GANG = "s"
# The stage each one streams its output to, at the address a request names (`Sink.address`): the DiT sends its
# latents to a VAE session, the VAE its frames to a muxer session (a FastH3 DiT is a DiT). Each may dial only these.
SINKS = {"dit": "vae", "vae": "muxer"}
SERVICE_NAMES = {"encoder": "h3serve.v1.Encoder", "dit": "h3serve.v1.DiT", "vae": "h3serve.v1.VAE",
                 "muxer": "h3serve.v1.Muxer", "gateway": "h3serve.v1.Gateway"}

# ---- what a request may ask for, and how the engines run ------------------------------------------------------
TASKS = ("t2va", "fl2va", "ref2va")
PROFILES = ("base", "fasth3")
PROFILE_TASKS = {"base": TASKS, "fasth3": ("t2va",)}   # FastH3 is distilled for t2va only
# Which checkpoint partition serves which task (H3_REFERENCE §1.1).
COMPONENT_FOR_TASK = {"t2va": "transformer", "fl2va": "transformer", "ref2va": "transformer_ref"}
# What a deployment serves unless told (--tasks): ref2va needs the DiT's second partition (transformer_ref/, as
# large as the first), so it is loaded only where asked for.
DEFAULT_TASKS = "t2va,fl2va"
TASKS_PATTERN = f"^({'|'.join(TASKS)})(,({'|'.join(TASKS)}))*$"  # a comma list of tasks, as --tasks takes it
ENCODER_CACHE_BYTES = 512 << 20  # encodings kept for repeated prompts / references (0: no cache)
MAX_ENCODER_CACHE_BYTES = 1 << 40
# The engines' dtypes by the name a request, a flag or a spec gives, and the torch dtype each one is
# (runtime.device.TORCH_DTYPES maps them; config imports no torch).
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}
DTYPES = tuple(TORCH_DTYPE_NAMES)
# The engines' dtype when nobody names one (the embedded pipeline, `h3serve serve`, `h3serve generate`, a request
# without dtype): fp32, what the pipeline and the services have always run in; the operator's GPU pods set bf16.
DEFAULT_DTYPE = "fp32"
# A deployment's device (spec.device) and the dtype its model stages run in there.
DEVICE_DTYPES = {"cuda": "bf16", "cpu": "fp32"}
DEVICES = tuple(DEVICE_DTYPES)

# ---- how tensors move between stages (h3serve.transport.choice) ------------------------------------------------
GRPC, NIXL = "grpc", "nixl"   # gRPC byte streams (always work); NIXL over UCX: RDMA, shared memory or TCP
TRANSPORTS = (GRPC, NIXL)

# ---- exit codes (the CLI's and the launcher's; docs/services.md lists them all) ---------------------------------
EXIT_USER_ERROR = 2   # a bad flag, request, file or port: one line on stderr; restarting cannot fix it

# ---- ports ----------------------------------------------------------------------------------------------------
GRPC_PORT = 50051
HTTP_PORT = 8000
DIST_PORT = 29500  # torch.distributed rendezvous (MASTER_PORT)
# One host running several stages (`h3serve serve --stages all`, a colocated replica pod) puts the gateway on the
# base gRPC port and each stage on the base port + its offset.
PORT_OFFSETS = {"gateway": 0, "encoder": 1, "dit": 2, "vae": 3, "muxer": 4, FASTH3_DIT: 5}
# grpc.health.v1 service the probes check: "" = the whole server, SERVING once the weights are loaded and one
# warm-up pass ran, NOT_SERVING again while it drains.
HEALTH_SERVICE = ""
# Previews (preview_every) one request may ask for unless the deployment says otherwise (--max-previews,
# spec.gateway.maxPreviews): each is a small render on the DiT.
MAX_PREVIEWS = 10

# ---- model facts (release checkpoint) the parallel degrees must respect ---------------------------------------
ENCODER_HEADS = 64     # Qwen3-VL text model: query heads
ENCODER_KV_HEADS = 8   # ... and key/value heads (GQA)
DIT_HEADS = 56         # H3 DiT: 56 heads x 128

# ---- capacity and speed levers (h3serve.config.levers), every one off by default ------------------------------
QUALITIES = ("lossless", "high")  # lossless: every block of every step; high: step reuse (base profile)
DEFAULT_QUALITY = "lossless"
OFFLOAD_MODES = ("local", "allgather")  # DiT layerwise offload over several ranks: each rank's own host copy / shards
SPARSE_DENSITIES = ("off", "50", "25", "12.5")  # block-sparse DiT attention: percent of key blocks kept (the measured ones)
DIT_LAYERS = 50        # H3 DiT blocks: the bound of the resident-block window
MIN_RESIDENT_BLOCKS = 2  # a copy one block ahead needs a second slot
ENCODER_LAYERS = 50    # Qwen3-VL decoder layers H3 reads (hidden_states[50]): the bound of the encoder's window
