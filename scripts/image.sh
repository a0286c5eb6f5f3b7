#!/usr/bin/env bash
# Build the project's container image here, with no registry and no container engine, for the test cluster
# (containerd imports the archives with `ctr -n k8s.io images import ARCHIVE`). Users build the Dockerfile instead.
#
#   scripts/image.sh        build what changed; the LAST stdout line is JSON:
#                           {"image": "h3serve.local/h3serve:<hash12>", "archive": ".../h3serve-<hash12>.tar",
#                            "pause": "h3serve.local/pause:<hash12>", "pause_archive": ".../pause-<hash12>.tar"}
#                           (logs, one line per step with its time, go to stderr)
#
# The image, bottom layer first (an OCI layout assembled with umoci from Debian's packages; each layer is cached by
# the hash of its inputs in $H3SERVE_TOOLS_CACHE/image, default $HOME/.cache/h3serve-k8s/image, and rebuilt only
# when they change; a re-run that changed nothing is a no-op):
#   1. base          Debian bookworm from mmdebstrap: the Essential set and the shared libraries that the
#                    interpreter and the wheels link (BASE_PACKAGES; key: that list, the suite, the mirror).
#   2. /opt/python   the CPython that scripts/setup.sh built the venv from (`home =` of .venv/pyvenv.cfg), trimmed
#                    (no test suite, idle, tkinter, headers, static library) and its run path made relative
#                    (key: the files' names, sizes and mtimes).
#   3. site-packages /opt/h3serve/lib/python3.X/site-packages: the venv's distributions that h3serve[operator]
#                    needs, by their metadata (no test-only packages, no editable-install hooks of h3serve), with
#                    CPU torch: see DROP in scripts/image_layers.py for what of CUDA is kept and why
#                    (key: each distribution's name, version and RECORD).
#   4. h3serve       the wheel built from this checkout (--no-deps --no-build-isolation), installed into the venv
#                    skeleton /opt/h3serve (bin/python -> /opt/python, pyvenv.cfg, the `h3serve` console script)
#                    (key: h3serve/**, pyproject.toml, README.md and scripts/image_layers.py).
# Config: user 65532:65532, workdir /tmp, HOME=/tmp, PATH starting with /opt/h3serve/bin, the Dockerfile's EXPOSE
# ports, cmd ["h3serve", "--help"]. Pods run it with a read-only root file system and /tmp an emptyDir.
#
# The sandbox image h3serve.local/pause: scripts/pause.c, static, as /pause, user 65535.
#
# Measured on 2 busy cores: cold 104 s (base 31, interpreter 3, site-packages 63, h3serve 2, archive 4), plus about
# 15 s of apt-get the first time; a changed Python file rebuilds only the h3serve layer and the archive (about 10 s);
# nothing changed: about 1 s. The archive is 2.2 GB (gzip layers; 4 GB unpacked: torch 1.1 GB, the CUDA libraries that
# `import torch` needs 1.9 GB); `ctr images import` takes about 90 s. Old layers go by image_layers.py gc (umoci gc
# re-hashes every blob: a minute).
#
# Needs root (mmdebstrap --mode=unshare, umoci), and installs mmdebstrap, umoci, patchelf, gcc and libc6-dev with
# apt-get where missing. Build times are appended to $H3SERVE_TOOLS_CACHE/build-times.tsv, like tests/operator/tools.sh.
set -euo pipefail
exec 3>&1 1>&2  # stdout is for the result line only

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${H3SERVE_TOOLS_CACHE:-$HOME/.cache/h3serve-k8s}
IMG=$CACHE/image
VENV=${H3SERVE_VENV:-$ROOT/.venv}
NICE=${H3SERVE_TOOLS_NICE:-10}
SUITE=bookworm
MIRROR=${H3SERVE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${H3SERVE_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
EXTRAS=operator
NAME=h3serve.local/h3serve
PAUSE_NAME=h3serve.local/pause
# What the interpreter's extension modules and the wheels' shared objects link beyond glibc (tests/realcluster checks
# that nothing is missing: `image_layers.py check-libs ROOTFS`). ca-certificates for TLS to S3 and to the API server.
BASE_PACKAGES=(ca-certificates libbz2-1.0 libcrypt1 libffi8 libgcc-s1 liblzma5 libncursesw6 libnsl2 libreadline8
  libsqlite3-0 libssl3 libstdc++6 libtinfo6 libtirpc3 libuuid1 zlib1g)

mkdir -p "$IMG"
exec 9> "$IMG/.lock"
flock 9  # one build at a time

T0=$SECONDS
log() { printf '[image %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
timed() { # timed NAME CMD...: run, log and record its seconds
  local name=$1 t0=$SECONDS; shift
  "$@"
  printf '%s\t%s\t%ss\n' "$(date -u +%FT%TZ)" "image:$name" "$((SECONDS - t0))" >> "$CACHE/build-times.tsv"
  log "$name: $((SECONDS - t0))s"
}
sha() { sha256sum | cut -c1-64; }
n() { nice -n "$NICE" "$@"; }

# --- tools ---------------------------------------------------------------------------------------------------------
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends "$@" > "$IMG/apt.log" 2>&1; then
    apt-get update -q >> "$IMG/apt.log" 2>&1
    apt-get install -y -q --no-install-recommends "$@" >> "$IMG/apt.log" 2>&1 || { tail -20 "$IMG/apt.log"; exit 1; }
  fi
}
want=()
command -v mmdebstrap >/dev/null || want+=(mmdebstrap)
command -v umoci >/dev/null || want+=(umoci)
command -v patchelf >/dev/null || want+=(patchelf)
command -v gcc >/dev/null || want+=(gcc)
[[ -e /usr/lib/$(uname -m)-linux-gnu/libc.a ]] || want+=(libc6-dev)
if (( ${#want[@]} )); then
  log "apt-get install ${want[*]}"
  timed apt-get apt_install "${want[@]}"
fi

[[ -x $VENV/bin/python && -f $VENV/.h3serve-installed ]] || {
  echo "no installed venv at $VENV: run scripts/setup.sh"; exit 1; }
PY=$VENV/bin/python
LAYERS=$ROOT/scripts/image_layers.py
HOME_BIN=$(sed -n 's/^home *= *//p' "$VENV/pyvenv.cfg")
PYVER=$(sed -n 's/^version\(_info\)\? *= *//p' "$VENV/pyvenv.cfg" | head -1)
PYMM=${PYVER%.*}
[[ -x $HOME_BIN/python$PYMM ]] || { echo "the venv's interpreter $HOME_BIN/python$PYMM is gone"; exit 1; }

# --- keys: each layer's, and the chain's (a layer's tag names all the layers below it) -------------------------------
EXPOSE=$(sed -n 's/^EXPOSE //p' "$ROOT/Dockerfile")
K_BASE=$(printf '%s\n' "$SUITE" "$MIRROR" "$SECURITY_MIRROR" "${BASE_PACKAGES[@]}" "$(mmdebstrap --version)" \
  "$(sed -n '/^build_base()/,/^}/p' "$0")" | sha)
K_PY=$(printf '%s\n' "$K_BASE" "$("$PY" "$LAYERS" python-key "$HOME_BIN")" | sha)
K_SITE=$(printf '%s\n' "$K_PY" "$("$PY" "$LAYERS" site-key "$VENV" "$EXTRAS")" | sha)
K_APP=$(printf '%s\n' "$K_SITE" "$("$PY" "$LAYERS" app-key "$ROOT")" | sha)
K_IMG=$(printf '%s\n' "$K_APP" "$EXPOSE" "$(sed -n '/^configure()/,/^}/p' "$0")" | sha)
K_PAUSE=$(cat "$ROOT/scripts/pause.c" <(gcc --version | head -1) <(sed -n '/^build_pause()/,/^}/p' "$0") | sha)
TAG_BASE=base-${K_BASE:0:16} TAG_PY=python-${K_PY:0:16} TAG_SITE=site-${K_SITE:0:16} TAG_APP=app-${K_APP:0:16}
TAG_IMG=img-${K_IMG:0:12} TAG_PAUSE=pause-${K_PAUSE:0:12}
ARCHIVE=$IMG/h3serve-${K_IMG:0:12}.tar
PAUSE_ARCHIVE=$IMG/pause-${K_PAUSE:0:12}.tar

result() {
  printf '{"image": "%s:%s", "archive": "%s", "pause": "%s:%s", "pause_archive": "%s"}\n' \
    "$NAME" "${K_IMG:0:12}" "$ARCHIVE" "$PAUSE_NAME" "${K_PAUSE:0:12}" "$PAUSE_ARCHIVE" >&3
}
if [[ -s $ARCHIVE && -s $PAUSE_ARCHIVE ]]; then
  log "up to date: $NAME:${K_IMG:0:12} ($((SECONDS - T0))s)"
  result
  exit 0
fi

L=$IMG/oci
W=$IMG/work
rm -rf "$W"; mkdir -p "$W"
trap 'rm -rf "$W"' EXIT
[[ -f $L/index.json ]] || umoci init --layout "$L"
has() { "$PY" -c 'import json,sys; sys.exit(all(m.get("annotations",{}).get("org.opencontainers.image.ref.name")
  != sys.argv[2] for m in json.load(open(sys.argv[1]))["manifests"] or []))' "$L/index.json" "$1"; }

# --- layers ----------------------------------------------------------------------------------------------------------
build_base() {
  # minbase would add apt, and usrmerge (which the Essential set pulls in on bookworm) would add perl: the merged-usr
  # hook sets the /usr symlinks up instead. No docs, man pages or locales (copyright files stay).
  n mmdebstrap --quiet --variant=essential --mode=unshare --format=tar \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --include="$(IFS=,; echo "${BASE_PACKAGES[*]}")" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/cache/debconf/*-old "$1"/var/lib/dpkg/*-old "$1"/var/log/*' \
    --customize-hook='echo "nonroot:x:65532:65532:nonroot:/tmp:/usr/sbin/nologin" >> "$1/etc/passwd"' \
    --customize-hook='echo "nonroot:x:65532:" >> "$1/etc/group"' \
    --skip=output/dev \
    "$SUITE" "$W/base.tar" \
    "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" "deb $SECURITY_MIRROR $SUITE-security main" \
    > "$IMG/mmdebstrap.log" 2>&1 || { tail -30 "$IMG/mmdebstrap.log"; exit 1; }
  umoci new --image "$L:$TAG_BASE"
  n umoci raw add-layer --image "$L:$TAG_BASE" --history.created_by "mmdebstrap $SUITE" "$W/base.tar"
  rm -f "$W/base.tar"
}

build_python() {
  mkdir -p "$W/python/opt"
  "$PY" "$LAYERS" stage-python "$HOME_BIN" "$W/python/opt/python"
  patchelf --set-rpath '$ORIGIN/../lib' "$W/python/opt/python/bin/python$PYMM"  # its own copy, not a link
  n umoci insert --image "$L:$TAG_BASE" --tag "$TAG_PY" --history.created_by "CPython $PYVER at /opt/python" \
    "$W/python/opt" /opt
}

build_site() {
  n "$PY" "$LAYERS" stage-site "$VENV" "$EXTRAS" "$W/site"
  n umoci insert --image "$L:$TAG_PY" --tag "$TAG_SITE" --history.created_by "site-packages of h3serve[$EXTRAS]" \
    "$W/site/opt" /opt
}

build_app() {
  # Build from a copy, so that the checkout gets no build/ folder.
  mkdir -p "$W/src" "$W/wheel"
  cp -r "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/h3serve" "$W/src/"
  find "$W/src" -name __pycache__ -prune -exec rm -rf {} +
  PIP_DISABLE_PIP_VERSION_CHECK=1 n "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index \
    --wheel-dir "$W/wheel" "$W/src" > "$W/wheel.log" 2>&1 || { cat "$W/wheel.log"; exit 1; }
  "$PY" "$LAYERS" stage-app "$W"/wheel/h3serve-*.whl "$PYVER" "$W/app"
  n "$PY" -m compileall -q -j 2 --invalidation-mode checked-hash -s "$W/app" -p / \
    "$W/app/opt/h3serve/lib/python$PYMM/site-packages/h3serve"
  n umoci insert --image "$L:$TAG_SITE" --tag "$TAG_APP" --history.created_by "h3serve (wheel) and /opt/h3serve" \
    "$W/app/opt" /opt
}

configure() {
  local args=() p
  for p in $EXPOSE; do args+=(--config.exposedports "$p/tcp"); done
  umoci config --image "$L:$TAG_APP" --tag "$TAG_IMG" --no-history \
    --clear=config.env --clear=config.cmd --clear=config.entrypoint --clear=config.exposedports \
    --config.user 65532:65532 --config.workingdir /tmp \
    --config.env PATH=/opt/h3serve/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --config.env PYTHONDONTWRITEBYTECODE=1 --config.env PYTHONUNBUFFERED=1 --config.env HF_HUB_OFFLINE=1 \
    --config.env HOME=/tmp \
    --config.cmd h3serve --config.cmd --help "${args[@]}"
}

build_pause() {
  mkdir -p "$W/pause"
  n gcc -static -O2 -Wall -Wextra -o "$W/pause/pause" "$ROOT/scripts/pause.c"
  strip -s "$W/pause/pause"
  umoci new --image "$L:$TAG_PAUSE"
  umoci insert --image "$L:$TAG_PAUSE" --history.created_by "scripts/pause.c" "$W/pause/pause" /pause
  umoci config --image "$L:$TAG_PAUSE" --no-history --clear=config.env --clear=config.cmd \
    --config.user 65535:65535 --config.workingdir / --config.entrypoint /pause
}

has "$TAG_BASE" || timed base build_base
has "$TAG_PY" || timed python build_python
has "$TAG_SITE" || timed site-packages build_site
has "$TAG_APP" || timed h3serve build_app
has "$TAG_IMG" || configure
has "$TAG_PAUSE" || timed pause build_pause
[[ -s $ARCHIVE ]] || timed export n "$PY" "$LAYERS" export "$L" "$TAG_IMG" "$NAME:${K_IMG:0:12}" "$ARCHIVE"
[[ -s $PAUSE_ARCHIVE ]] || "$PY" "$LAYERS" export "$L" "$TAG_PAUSE" "$PAUSE_NAME:${K_PAUSE:0:12}" "$PAUSE_ARCHIVE"

# --- keep the last three builds' layers and the last two archives (2+ GB each), drop the rest ---------------------
echo "$TAG_BASE $TAG_PY $TAG_SITE $TAG_APP $TAG_IMG $TAG_PAUSE $(basename "$ARCHIVE") $(basename "$PAUSE_ARCHIVE")" \
  >> "$IMG/builds"
tail -3 "$IMG/builds" > "$IMG/builds.tmp" && mv "$IMG/builds.tmp" "$IMG/builds"
keep=" $(tr '\n' ' ' < "$IMG/builds") "
for t in $(umoci ls --layout "$L"); do
  [[ $keep == *" $t "* ]] || umoci rm --image "$L:$t"
done
keep_archives=" $(tail -2 "$IMG/builds" | tr '\n' ' ') "
for f in "$IMG"/h3serve-*.tar "$IMG"/pause-*.tar; do
  if [[ -e $f && $keep_archives != *" $(basename "$f") "* ]]; then rm -f "$f"; fi
done
"$PY" "$LAYERS" gc "$L"
printf '%s\t%s\t%ss\n' "$(date -u +%FT%TZ)" "image" "$((SECONDS - T0))" >> "$CACHE/build-times.tsv"
log "built $NAME:${K_IMG:0:12} in $((SECONDS - T0))s: $(du -h "$ARCHIVE" | cut -f1) ($ARCHIVE)"
result
