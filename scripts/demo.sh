#!/usr/bin/env bash
# The main job on the embedded default: a tiny random H3 checkpoint (made if missing), one 5 s 256x256 T2VA MP4.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${H3SERVE_VENV:-.venv}   # the one setup.sh made
export HF_HUB_OFFLINE=1
CKPT=${H3SERVE_DEMO_CHECKPOINT:-.cache/tiny-ckpt}
OUT=${H3SERVE_DEMO_OUTPUT:-out/demo.mp4}
mkdir -p "$(dirname "$OUT")"
if [ ! -f "$CKPT/modular_model_index.json" ]; then
  "$VENV"/bin/h3serve checkpoint init --preset tiny "$CKPT"
fi
"$VENV"/bin/h3serve generate --checkpoint "$CKPT" --prompt "a red kite over a windy beach, waves and gulls" \
  --seconds 5 --size 256x256 --seed 0 --steps 5 -o "$OUT" "$@"
