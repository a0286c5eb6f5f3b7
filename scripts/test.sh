#!/usr/bin/env bash
# The test suite: installs what it needs (venv, ffprobe), then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests' tools are Go builds (CPU) and the venv is mostly a download (network): on a machine with nothing cached
# they run side by side. The operator tests run a real control plane and the real-cluster tests a real node; their
# binaries are built from source once and cached outside the repo (cold: about 25-37 minutes on 2 cores, see
# docs/operator-dev.md; afterwards a no-op). The job-store tests run a real S3-compatible server (versitygw), built
# once the same way (about 2 minutes cold).
(bash tests/operator/tools.sh >/dev/null && bash tests/service/s3tools.sh >/dev/null) &
tools=$!
trap 'kill "$tools" 2>/dev/null || true' EXIT   # a failed set-up stops the builds too
bash scripts/setup.sh
VENV=${H3SERVE_VENV:-.venv}   # the one setup.sh made
if ! command -v ffprobe >/dev/null 2>&1; then
  # The media tests check every MP4 with an independent decoder, Debian's ffprobe.
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ffmpeg >/dev/null) \
    || { echo "test.sh: could not install ffmpeg (ffprobe) with apt-get" >&2; exit 1; }
fi
wait "$tools" || { echo "test.sh: building the test tools failed (tests/operator/tools.sh, tests/service/s3tools.sh)" >&2; exit 1; }
trap - EXIT
# The layers of DESIGN §4 (contracts in pyproject.toml): a crossed boundary fails before any test runs.
"$VENV"/bin/lint-imports --no-cache
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec "$VENV"/bin/python -m pytest "$@"
