"""Images in: a keyframe or image reference decoded to (H, W, 3) uint8 RGB with Pillow, refusing corrupt files.

Pillow decodes what it can of a damaged file: a PNG chunk with a wrong CRC is read anyway, and a PNG whose
compressed IDAT stream ends early, or holds fewer scanlines than the header says, is filled in silently. Callers'
files are not trusted that far: `decode_rgb` verifies a PNG first (`Image.verify()`, then `check_png`: every
chunk's CRC, and image data that is exactly the scanlines its header announces), then decodes all of any image
(`load()`, truncated data refused), then checks a JPEG's scans against what was decoded (`check_jpeg`).

libjpeg fills in a scan whose data ends before its last block (the rest of the image mid-gray) and skips scan data
left over after it, each with a warning that Pillow never reports. So `check_jpeg` asks the decoder itself, by
decoding the file twice more with its scans edited: once with JPEG_FILLER put after every scan's data (a whole
scan never reads it, so the pixels must not change), once with the last JPEG_UNREAD_SCAN_BYTES of every scan's data
replaced by it (a scan that reads its own data to the end must change).
"""

from __future__ import annotations

import io
import re
import struct
import zlib

import numpy as np
from PIL import Image, ImageChops, ImageFile

from h3serve.config.request import MAX_IMAGE_PIXELS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}   # colour type -> samples per pixel
ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))

# Scan bytes of no particular meaning and without 0xFF (so no marker and no stuffing): what a scan that lacks data
# reads in place of the marker it hit (check_jpeg).
JPEG_FILLER = bytes((i * 167 + 89) % 255 for i in range(32))
JPEG_MARKER = re.compile(rb"\xff\xff*([^\x00\xff])")   # a marker's code after its FF (and fill FFs); FF 00 is data
JPEG_MAX_SPANS = MAX_IMAGE_PIXELS // 64        # scans and restart intervals: one per 8x8 block of the largest image
# Scan data a decoder may leave unread. An encoder pads a few bytes at most (libjpeg warns "extraneous bytes");
# random bytes in place of a scan's data leave about 60 % of it unread.
JPEG_UNREAD_SCAN_BYTES = 64


class CorruptImage(ValueError):
    """The file is damaged (what is wrong in `str()`)."""


def _png_scanline_bytes(width: int, height: int, depth: int, colour: int, interlace: int) -> int:
    """The bytes a PNG's IDAT stream inflates to: every (pass's) scanline with its filter byte."""
    bits = PNG_CHANNELS[colour] * depth
    if not interlace:
        return height * (1 + (width * bits + 7) // 8)
    total = 0
    for x0, y0, dx, dy in ADAM7:
        w, h = (width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy
        if w > 0 and h > 0:
            total += h * (1 + (w * bits + 7) // 8)
    return total


def check_png(data: bytes) -> None:
    """A PNG's chunks are whole and pass their CRCs (IEND's too, which Pillow's verify() skips), and its IDAT stream
    inflates to exactly the scanlines of its header (a stream that ends early, holds fewer rows or more data is
    refused). Inflates at most one byte past that size."""
    pos, header, idat = len(PNG_SIGNATURE), None, []
    while True:
        if pos + 8 > len(data):
            raise CorruptImage("the PNG ends inside a chunk header (no IEND)")
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if pos + 12 + length > len(data):
            raise CorruptImage(f"the PNG's {kind.decode('latin-1')!r} chunk is cut short")
        body = data[pos + 8:pos + 8 + length]
        if zlib.crc32(kind + body) != struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]:
            raise CorruptImage(f"the PNG's {kind.decode('latin-1')!r} chunk fails its CRC")
        if kind == b"IHDR":
            if length != 13:
                raise CorruptImage("the PNG's IHDR chunk is not 13 bytes")
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        pos += 12 + length
    if header is None or not idat:
        raise CorruptImage("the PNG has no IHDR or no IDAT chunk")
    width, height, depth, colour, _, _, interlace = header
    if colour not in PNG_CHANNELS:
        raise CorruptImage(f"the PNG's colour type {colour} is not one PNG defines")
    expected = _png_scanline_bytes(width, height, depth, colour, interlace)
    inflate = zlib.decompressobj()
    got = 0
    try:
        for chunk in idat:
            got += len(inflate.decompress(chunk, expected + 1 - got))
            if got > expected:
                break
            while inflate.unconsumed_tail and got <= expected:
                got += len(inflate.decompress(inflate.unconsumed_tail, expected + 1 - got))
    except zlib.error as exc:
        raise CorruptImage(f"the PNG's image data does not inflate ({exc})") from None
    if got > expected:
        raise CorruptImage(f"the PNG's image data holds more than the {expected:,} bytes of scanlines its header "
                           "announces")
    if not inflate.eof or got < expected:
        raise CorruptImage(f"the PNG's image data is truncated: {got:,} of the {expected:,} bytes of scanlines its "
                           "header announces")


def jpeg_scan_data(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each stretch of entropy-coded data in a JPEG: a scan's data, or one restart interval of it,
    `end` being where the marker that ends it begins. Bytes outside a marker segment are skipped, as libjpeg
    skips them; the first EOI ends the file (what follows is not decoded). More than JPEG_MAX_SPANS: CorruptImage."""
    spans, i, n, scan = [], 2, len(data), None   # scan: where the data of the scan being read starts
    while (m := JPEG_MARKER.search(data, i)) is not None:
        code, i = m.group(1)[0], m.end()
        if scan is not None:
            spans.append((scan, m.start()))
            if len(spans) > JPEG_MAX_SPANS:   # each one costs the check a Python step and filler bytes
                raise CorruptImage(f"more than {JPEG_MAX_SPANS:,} scans and restart intervals (one per 8x8 block "
                                   "of the largest image)")
            scan = i if 0xD0 <= code <= 0xD7 else None   # after a restart marker the scan goes on
            if scan is not None:
                continue
        if code == 0xD9:
            return spans
        if code not in (0x01, 0xD8) and not 0xD0 <= code <= 0xD7 and i + 2 <= n:   # markers with a length
            i += (data[i] << 8) | data[i + 1]
            if code == 0xDA:
                scan = i
    if scan is not None:
        spans.append((scan, n))
    return spans


def _with_filler(data: bytes, spans: list[tuple[int, int]], replace: int) -> bytes:
    """`data` with JPEG_FILLER in place of the last `replace` bytes of each span (0: put after it)."""
    out, last = [], 0
    for start, end in spans:
        cut = max(start, end - replace)
        while cut > start and data[cut - 1] == 0xFF:   # never split a stuffed FF from its 00
            cut -= 1
        out += [data[last:cut], JPEG_FILLER]
        last = end
    out.append(data[last:])
    return b"".join(out)


def _decodes_alike(image: Image.Image, data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as other:
            other.load()
            return other.mode == image.mode and other.size == image.size \
                and ImageChops.difference(image, other).getbbox() is None
    except Exception:  # noqa: BLE001 - the edited file does not decode: the decoder read the edit
        return False


def check_jpeg(data: bytes, image: Image.Image) -> None:
    """The loaded JPEG `image` (decoded from `data`) owes no pixel to data the file lacks, and its scans are
    image data: refused when the decoder reads JPEG_FILLER put after a scan's data (the scan ends before its last
    block: cut short, an end marker appended) or when every scan leaves its last JPEG_UNREAD_SCAN_BYTES unread
    (the scan data is not the image's)."""
    spans = jpeg_scan_data(data)
    if not spans:
        return
    if not _decodes_alike(image, _with_filler(data, spans, 0)):
        raise CorruptImage("the JPEG's image data ends before its last block (cut short, or damaged); the decoder "
                           "would fill in the rest")
    if _decodes_alike(image, _with_filler(data, spans, JPEG_UNREAD_SCAN_BYTES)):
        raise CorruptImage(f"the JPEG's scan data is not image data: the decoder leaves at least "
                           f"{JPEG_UNREAD_SCAN_BYTES} bytes of it unread (damaged)")


def _bytes(source) -> bytes | None:
    """The file's bytes when it is in memory (an upload), else None (a path: Pillow reads it)."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if isinstance(source, io.BytesIO):
        return source.getvalue()
    return None


def decode_rgb(source) -> np.ndarray:
    """(H, W, 3) uint8 RGB of an image (a path, bytes or a BytesIO); raises CorruptImage, or whatever Pillow
    raises, for a file that is not a whole, intact image."""
    data = _bytes(source)
    opened = (lambda: io.BytesIO(data)) if data is not None else (lambda: source)
    if ImageFile.LOAD_TRUNCATED_IMAGES:   # a library that turned it on for itself does not decide for callers
        raise CorruptImage("Pillow is set to load truncated images (ImageFile.LOAD_TRUNCATED_IMAGES)")
    image = Image.open(opened())
    try:
        if image.format == "PNG":
            try:
                image.verify()   # chunk CRCs (the only format whose verify() checks the data)
            except Exception as exc:  # noqa: BLE001 - Pillow says what is broken: SyntaxError, OSError, ...
                raise CorruptImage(f"{exc}") from None
            image.close()    # verify() leaves the image unusable: opened again
            if data is not None:
                check_png(data)
            image = Image.open(opened())
        try:
            image.load()     # every pixel decoded: truncated data raises
        except (OSError, SyntaxError, ValueError) as exc:
            raise CorruptImage(f"{exc}") from None
        if image.format in ("JPEG", "MPO") and data is not None:
            check_jpeg(data, image)
        return np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8))
    finally:
        image.close()
