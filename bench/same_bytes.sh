#!/usr/bin/env bash
# Same request, same seed, two trees: the MP4 bytes of `h3serve generate` from this tree and from REF (a folder whose
# h3serve/ is importable, e.g. an older commit exported with `git archive`). Prints one JSON line per request with
# both sha256s and whether they are equal; exits 1 if any differ. DEVICE=cuda on a GPU machine (wheels from .whl/
# are unpacked into /tmp/site as bench/gpu_suite.sh does).
#
#   REF=/path/to/old-tree DEVICE=cpu bash bench/same_bytes.sh
set -u
REPO=$PWD
REF=${REF:?set REF to a folder holding the reference h3serve/}
DEVICE=${DEVICE:-cpu}
WORK=$(mktemp -d)
for t in .whl/*.tar.xz; do [ -e "$t" ] && mkdir -p /tmp/site && tar -C /tmp/site -xJf "$t"; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PYTHON:-python3}
h3() { (cd "$WORK" && PYTHONPATH=$1:/tmp/site "$PY" -m h3serve.cli "${@:2}"); }
h3 "$REPO" checkpoint init --preset tiny "$WORK/ck" >/dev/null || exit 2
SHA=$(h3 "$REPO" checkpoint init-adapter --checkpoint "$WORK/ck" -o "$WORK/ad.safetensors" | awk '/sha256/{print $2}')
(cd "$WORK" && "$PY" - <<'PYEOF'
from PIL import Image
import numpy as np
r = np.random.default_rng(0)
for n in "ab":
    Image.fromarray(r.integers(0, 255, (256, 320, 3), dtype=np.uint8)).save(f"{n}.png")
PYEOF
)
G="--checkpoint $WORK/ck --device $DEVICE --size 320x256 --seconds 5 --seed 7 --prompt a_kite_over_the_sea --no-progress"
REQUESTS=(
  "t2va_bf16|--dtype bf16 --steps 5"
  "t2va_fp32|--dtype fp32 --steps 5"
  "fasth3|--dtype bf16 --profile fasth3 --adapter $WORK/ad.safetensors --adapter-sha256 $SHA"
  "fl2va|--dtype bf16 --steps 5 --task fl2va --first-image $WORK/a.png --last-image $WORK/b.png"
)
bad=0
for r in "${REQUESTS[@]}"; do
  name=${r%%|*} args=${r#*|}
  for side in ref ours; do
    tree=$REPO; [ $side = ref ] && tree=$REF
    h3 "$tree" generate $G $args -o "$WORK/$side.$name.mp4" >/dev/null 2>"$WORK/$side.$name.err" \
      || { echo "{\"request\": \"$name\", \"side\": \"$side\", \"error\": \"$(tail -1 "$WORK/$side.$name.err")\"}"; bad=1; }
  done
  a=$(sha256sum "$WORK/ref.$name.mp4" 2>/dev/null | cut -c1-64) b=$(sha256sum "$WORK/ours.$name.mp4" 2>/dev/null | cut -c1-64)
  [ -n "$a" ] && [ "$a" = "$b" ] && same=true || { same=false; bad=1; }
  echo "{\"request\": \"$name\", \"device\": \"$DEVICE\", \"ref_sha256\": \"$a\", \"ours_sha256\": \"$b\", \"same\": $same}"
done
rm -rf "$WORK"
exit $bad
