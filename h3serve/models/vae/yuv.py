"""RGB -> yuv420p (BT.601 limited range) in exact integer arithmetic, on numpy or on torch where the frames are.

The VAE's frames leave the GPU as yuv420p planes; the muxer (and any caller of `h3serve.media.mux`) takes planes
only, so the colour conversion is written once, here, and never depends on libswscale's CPU-specific SIMD paths.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

# RGB -> yuv420p, BT.601 limited ("TV") range, exact integer arithmetic
#
#   Y = (CY . rgb + (16 << 16) + (1 << 15)) >> 16                      per pixel, 16-bit fixed point
#   C = (CC . sum_2x2(rgb) + (128 << 16) + (1 << 15)) >> 16             per 2x2 block, 14-bit fixed point (/4 -> 16)
#
# The integer coefficients are exact in float32 and every partial sum stays below 2**24, so float32 arithmetic
# (BLAS on numpy, elementwise on torch; any summation order, FMA or not) yields exactly these integers. The torch
# path avoids matmul so that TF32 can never be involved.

_Y_SHIFT, _C_SHIFT = 16, 14


def _fixed(coefficients: Sequence[float], shift: int, total: int) -> tuple[int, int, int]:
    c = [round(x * (1 << shift)) for x in coefficients]
    c[1] += total - sum(c)     # exact sums: white -> Y 235, grey -> C 128
    return c[0], c[1], c[2]


_KR, _KB = 0.299, 0.114
_KG = 1.0 - _KR - _KB
_YS, _CS = 219 / 255, 224 / 255
COEF_Y = _fixed((_KR * _YS, _KG * _YS, _KB * _YS), _Y_SHIFT, round(_YS * (1 << _Y_SHIFT)))
COEF_U = _fixed((-_KR / (2 * (1 - _KB)) * _CS, -_KG / (2 * (1 - _KB)) * _CS, 0.5 * _CS), _C_SHIFT, 0)
COEF_V = _fixed((0.5 * _CS, -_KG / (2 * (1 - _KR)) * _CS, -_KB / (2 * (1 - _KR)) * _CS), _C_SHIFT, 0)
_Y_OFFSET = (16 << _Y_SHIFT) + (1 << (_Y_SHIFT - 1))
_C_OFFSET = (128 << (_C_SHIFT + 2)) + (1 << (_C_SHIFT + 1))
_Y_SCALE, _C_SCALE = 2.0 ** -_Y_SHIFT, 2.0 ** -(_C_SHIFT + 2)
_CY = np.array(COEF_Y, np.float32)                         # (3,)
_CUV = np.array([COEF_U, COEF_V], np.float32).T            # (3, 2)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def rgb_to_yuv420p(frames: Any) -> tuple[Any, Any, Any]:
    """uint8 RGB (n, H, W, 3) -> yuv420p planes Y (n, H, W), U (n, H/2, W/2), V (n, H/2, W/2), uint8.

    BT.601 limited range (Y 16..235, C 16..240), the matrix libswscale uses by default for rgb24 -> yuv420p; chroma
    is the rounded mean of each 2x2 block (centre-sited; within 1 level of libswscale's 'area' scaler). Exact: a
    numpy array gives numpy planes, a torch tensor gives torch planes on its own device (e.g. on the GPU, before
    the D2H copy), and both give the same bytes. H and W must be even.
    """
    if _is_torch(frames):
        if frames.device.type != "cpu":
            return _rgb_to_yuv420p_torch(frames)
        # a CPU tensor: the numpy path (BLAS) is faster than torch's elementwise ops here
        return tuple(torch.from_numpy(p) for p in rgb_to_yuv420p(frames.detach().numpy()))
    frames = np.asarray(frames)
    _check_rgb(frames.shape, frames.dtype)
    f = frames.astype(np.float32)                                            # (n, H, W, 3)
    y = f @ _CY                                                              # (n, H, W), exact integers
    y += _Y_OFFSET
    y *= _Y_SCALE
    np.floor(y, out=y)
    s = f[:, 0::2, 0::2] + f[:, 1::2, 0::2]                                  # (n, H/2, W/2, 3): 2x2 block sums
    s += f[:, 0::2, 1::2]
    s += f[:, 1::2, 1::2]
    uv = s @ _CUV                                                            # (n, H/2, W/2, 2)
    uv += _C_OFFSET
    uv *= _C_SCALE
    np.floor(uv, out=uv)
    return y.astype(np.uint8), uv[..., 0].astype(np.uint8), uv[..., 1].astype(np.uint8)


def _rgb_to_yuv420p_torch(frames: Any) -> tuple[Any, Any, Any]:
    _check_rgb(tuple(frames.shape), frames.dtype)
    f = frames.to(torch.float32)
    r, g, b = f[..., 0], f[..., 1], f[..., 2]
    y = torch.floor((r * COEF_Y[0] + g * COEF_Y[1] + b * COEF_Y[2] + _Y_OFFSET) * _Y_SCALE)
    s = f[:, 0::2, 0::2] + f[:, 1::2, 0::2] + f[:, 0::2, 1::2] + f[:, 1::2, 1::2]
    sr, sg, sb = s[..., 0], s[..., 1], s[..., 2]
    u = torch.floor((sr * COEF_U[0] + sg * COEF_U[1] + sb * COEF_U[2] + _C_OFFSET) * _C_SCALE)
    v = torch.floor((sr * COEF_V[0] + sg * COEF_V[1] + sb * COEF_V[2] + _C_OFFSET) * _C_SCALE)
    return y.to(torch.uint8), u.to(torch.uint8), v.to(torch.uint8)


def _check_rgb(shape: tuple, dtype: Any) -> tuple[int, int, int]:
    if len(shape) != 4 or shape[3] != 3:
        raise ValueError(f"RGB frames must be (n, H, W, 3), got shape {tuple(shape)}")
    if str(dtype) not in ("uint8", "torch.uint8"):
        raise TypeError(f"RGB frames must be uint8, got {dtype}")
    n, h, w = int(shape[0]), int(shape[1]), int(shape[2])
    if h % 2 or w % 2:
        raise ValueError(f"yuv420p needs an even width and height, got {w}x{h}")
    return n, h, w
