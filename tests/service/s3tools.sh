#!/usr/bin/env bash
# Build, once, the real S3-compatible server the job-store tests run against: versitygw (posix backend).
# It lands in $H3SERVE_S3_CACHE (default $HOME/.cache/h3serve-s3), outside the repo, and is reused on later runs:
# rebuilt only if its binary or its version stamp is missing. Build times are logged in build-times.tsv there.
#
#   tests/service/s3tools.sh           build what is missing, print the binary's path
#   tests/service/s3tools.sh --check   exit 1 if it is missing (builds nothing)
set -euo pipefail

CACHE=${H3SERVE_S3_CACHE:-$HOME/.cache/h3serve-s3}
VERSITYGW_VERSION=${VERSITYGW_VERSION:-v1.8.0}
NICE=${H3SERVE_TOOLS_NICE:-15}
BIN=$CACHE/bin
STAMP=$CACHE/stamps/versitygw
mkdir -p "$BIN" "$CACHE/stamps"

if [[ -x $BIN/versitygw && -f $STAMP && $(cat "$STAMP") == "$VERSITYGW_VERSION" ]]; then
  echo "$BIN/versitygw"; exit 0
fi
[[ ${1:-} == --check ]] && { echo "versitygw $VERSITYGW_VERSION missing in $BIN" >&2; exit 1; }

t0=$SECONDS
echo "[s3tools] building versitygw $VERSITYGW_VERSION (about 1 minute on 2 cores)" >&2
CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local GOBIN=$BIN nice -n "$NICE" \
  go install -trimpath -ldflags "-s -w" "github.com/versity/versitygw/cmd/versitygw@$VERSITYGW_VERSION"
echo "$VERSITYGW_VERSION" > "$STAMP"
printf '%s\t%s\t%ss\n' "$(date -u +%FT%TZ)" "versitygw-$VERSITYGW_VERSION" "$((SECONDS - t0))" >> "$CACHE/build-times.tsv"
echo "$BIN/versitygw"
