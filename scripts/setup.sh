#!/usr/bin/env bash
# Create the virtualenv and install h3serve into it (idempotent; re-runs pip only when pyproject.toml or the
# constraints changed).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${H3SERVE_VENV:-.venv}
# The versions the suite last passed with (see its header); H3SERVE_CONSTRAINTS= (empty) resolves afresh instead.
CONSTRAINTS=${H3SERVE_CONSTRAINTS-scripts/constraints.txt}
pins=(); [ -n "$CONSTRAINTS" ] && pins=(-c "$CONSTRAINTS")
say() { printf 'setup: %s\n' "$*" >&2; }
if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtualenv $VENV"
  python3 -m venv "$VENV"
fi
stamp="$VENV/.h3serve-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || { [ -n "$CONSTRAINTS" ] && [ "$CONSTRAINTS" -nt "$stamp" ]; }; then
  quiet=-q; [ -t 2 ] && quiet=   # a terminal sees pip's progress bars; a log gets these lines only
  say "1/2 torch 2.13.0 (the CUDA build; it runs on the CPU too). The venv comes to about 6 GB: 2-3 min with" \
      "pip's cache warm, about 12 min downloading"
  "$VENV/bin/pip" install $quiet ${pins[@]+"${pins[@]}"} "torch==2.13.0" "torchvision==0.28.0"   # pinned first and alone: resolving the rest never moves it
  say "2/2 h3serve and its test dependencies (editable)"
  "$VENV/bin/pip" install $quiet ${pins[@]+"${pins[@]}"} -e ".[test]"
  touch "$stamp"
  say "ready in ${SECONDS} s: source $VENV/bin/activate (or call $VENV/bin/h3serve)"
fi
