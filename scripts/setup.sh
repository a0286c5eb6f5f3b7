#!/usr/bin/env bash
# Create the virtualenv and install h3serve into it (idempotent; re-runs pip only when pyproject.toml changed).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${H3SERVE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
stamp="$VENV/.h3serve-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # torch is pinned first and alone, so that resolving the other packages can never move it.
  "$VENV/bin/pip" install -q "torch==2.13.0"
  "$VENV/bin/pip" install -q -e ".[test]"
  touch "$stamp"
fi
