"""What the JPEG scan check (h3serve.media.image.check_jpeg) costs an upload's validation: for 4096x4096 JPEGs
(the largest image an upload may have), the seconds of Pillow's decode alone and of `decode_rgb` (decode, the two
edited decodes of the check, RGB conversion) with and without the check, each the fastest of `--repeat`. Prints
one JSON object. The 4:4:4 file with a restart marker after every block (262,144 of them, the most the check
takes) is larger than an upload may be (20 MiB): the check's own worst case.

    python bench/jpeg_check.py [--repeat 3] [--side 4096]
"""

from __future__ import annotations

import argparse
import io
import json
import time

import numpy as np
from PIL import Image

from h3serve.media import image as media_image
from h3serve.media.image import decode_rgb, jpeg_scan_data


def fastest(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--side", type=int, default=4096)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:args.side, 0:args.side]
    arr = np.stack([(x // 16) % 256, (y // 16) % 256, ((x + y) // 32) % 256], -1)
    arr = np.clip(arr + rng.integers(-40, 40, arr.shape), 0, 255).astype(np.uint8)
    out = {}
    for name, save in (("baseline", {}), ("progressive", {"progressive": True}),
                       ("restart marker after every block, 4:4:4", {"restart_marker_blocks": 1, "subsampling": 0})):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, "JPEG", quality=95, **save)
        data = buf.getvalue()

        def pillow():
            with Image.open(io.BytesIO(data)) as image:
                image.load()

        checked = fastest(lambda: decode_rgb(data), args.repeat)
        check, media_image.check_jpeg = media_image.check_jpeg, lambda data, image: None
        try:
            unchecked = fastest(lambda: decode_rgb(data), args.repeat)
        finally:
            media_image.check_jpeg = check
        out[name] = {"mb": round(len(data) / 1e6, 1), "spans": len(jpeg_scan_data(data)),
                     "pillow_decode_s": round(fastest(pillow, args.repeat), 3),
                     "decode_rgb_without_check_s": round(unchecked, 3), "decode_rgb_s": round(checked, 3)}
    print(json.dumps({"side": args.side, **out}))


if __name__ == "__main__":
    main()
