#!/usr/bin/env bash
# Dry run, on CPU, of the 8-GPU real-time layout (docs/realtime8.md): FastH3 with a synthetic fused adapter,
# encoder TP 8, DiT Ulysses 8 x Ring 1, VAE PP 8, on the tiny8 checkpoint (8 DiT heads, 8 encoder heads / KV heads),
# 8 gloo ranks per parallel stage:
#   1. embedded pipeline, degrees 1        (h3serve generate)
#   2. embedded pipeline, degrees 8        (h3serve generate --encoder-tp 8 --ulysses 8 --vae-pp 8: 8 ranks)
#   3. h3serve serve --stages all, colocated, the same degrees (three worlds of 8 ranks: encoder, DiT, VAE),
#      one request through the gateway
#   4. bench/realtime8_compare.py: check_mp4 on the three MP4s; decoded frames vs degrees 1; embedded latents and
#      float frames at degrees 8 vs 1 within docs/parallelism.md's tolerance.
# Usage: bench/realtime8_dryrun.sh [OUT_DIR]     (about 4 minutes on 2 cores; ~12 GB of RAM for the 27 processes)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-$(mktemp -d -t realtime8-XXXX)}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
H3=("$PY" -m h3serve.cli)
run() { echo "\$ ${*#$PY -m h3serve.cli }" | sed "s|$OUT|\$OUT|g"; "$@"; }

run "${H3[@]}" checkpoint init --preset tiny8 "$OUT/tiny8"
SHA=$("${H3[@]}" checkpoint init-adapter --checkpoint "$OUT/tiny8" -o "$OUT/adapter.safetensors" | awk '/^sha256/{print $2}')
echo "adapter sha256 $SHA"
REQ=(--prompt "a kite over the sea at dusk" --seconds 5 --size 320x256 --seed 7)
FAST=(--profile fasth3 --adapter "$OUT/adapter.safetensors" --adapter-sha256 "$SHA")
DEG=(--encoder-tp 8 --ulysses 8 --ring 1 --vae-pp 8)

echo "== 1. embedded, degrees 1"
run "${H3[@]}" generate --checkpoint "$OUT/tiny8" "${FAST[@]}" --device cpu "${REQ[@]}" --no-progress --json \
    -o "$OUT/embedded-1.mp4"
echo "== 2. embedded, encoder TP 8 + Ulysses 8 x Ring 1 + VAE PP 8 (8 gloo ranks)"
run "${H3[@]}" generate --checkpoint "$OUT/tiny8" "${FAST[@]}" --device cpu "${REQ[@]}" "${DEG[@]}" --no-progress \
    --json -o "$OUT/embedded-8.mp4"

echo "== 3. h3serve serve --stages all (colocated), the same degrees"
echo "\$ h3serve serve --checkpoint \$OUT/tiny8 --stages all ${FAST[*]} --device cpu ${DEG[*]} --port 0 --http-port 0 --json --no-restart" | sed "s|$OUT|\$OUT|g"
t0=$(date +%s.%N)
"${H3[@]}" serve --checkpoint "$OUT/tiny8" --stages all "${FAST[@]}" --device cpu "${DEG[@]}" --port 0 --http-port 0 \
    --json --no-restart > "$OUT/serve.jsonl" 2> "$OUT/serve.err" &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null || true' EXIT
for _ in $(seq 1200); do
  grep -q '"serving"' "$OUT/serve.jsonl" 2>/dev/null && break
  kill -0 $SERVE 2>/dev/null || { cat "$OUT/serve.err"; exit 1; }
  sleep 0.5
done
echo "serving after $(echo "$(date +%s.%N) - $t0" | bc) s"
GW=$("$PY" -c "import json,sys; print(next(json.loads(l) for l in open(sys.argv[1]) if '\"serving\"' in l)['gateway']['grpc'])" "$OUT/serve.jsonl")
run "${H3[@]}" generate --server "$GW" "${REQ[@]}" --no-progress --json -o "$OUT/served-8.mp4"
"$PY" - "$OUT/serve.jsonl" <<'PYEOF'
import json, sys, grpc
from h3serve._proto import common_pb2, dit_pb2_grpc, encoder_pb2_grpc, vae_pb2_grpc
ev = next(json.loads(l) for l in open(sys.argv[1]) if '"serving"' in l)
for stage, stub in (("encoder", encoder_pb2_grpc.EncoderStub), ("dit", dit_pb2_grpc.DiTStub), ("vae", vae_pb2_grpc.VAEStub)):
    with grpc.insecure_channel(ev["stages"][stage]["address"]) as ch:
        info = json.loads(stub(ch).Status(common_pb2.StatusRequest(), timeout=10).info_json)
    print(json.dumps({"stage": stage, "ranks": info.get("ranks"), "ranks_healthy": info.get("ranks_healthy"),
                      "processes": len(info.get("rank_pids", [])), "load_seconds": info.get("load_seconds")}))
PYEOF
kill -TERM $SERVE; wait $SERVE; echo "serve exited $?"; trap - EXIT

echo "== 4. checks"
run "$PY" bench/realtime8_compare.py --checkpoint "$OUT/tiny8" --adapter "$OUT/adapter.safetensors" \
    --adapter-sha256 "$SHA" "$OUT/embedded-1.mp4" "$OUT/embedded-8.mp4" "$OUT/served-8.mp4"
