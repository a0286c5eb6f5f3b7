"""The packed sequence the H3 DiT runs over, and the per-step row timesteps.

One request is one 1-D sequence of rows, with no padding and no mask (H3_REFERENCE §2.2):

    t2va / fl2va : [text (L) | keyframe condition rows | target audio (2A) | target video (T*h/2*w/2)]
    ref2va       : [text (L) | reference blocks, request order | target audio | target video]

Every row carries a modality tag (0 video, 1 text, 2 audio), a float64 (t, h, w) rotary coordinate and, per step, a
timestep index. The sequence is a handful of contiguous `Segment`s; inside one segment the tag and the timestep are
the same for every row, which is what lets the model modulate a whole segment with one broadcast instead of a per-row
gather.

The rotary coordinates reproduce the reference grid bit for bit (§2.3): numpy `linspace(endpoint=False)` for the
spatial axes, a numpy pairwise sum for the "last" keyframe and a sequential float64 sum for the ref2va clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Sequence

import numpy as np

from h3serve.config.geometry import AUDIO_CHANNELS
import torch

# Modality tags. A vision token inside the text stream is tagged video.
TAG_VIDEO, TAG_TEXT, TAG_AUDIO = 0, 1, 2
NUM_TAGS = 3

# AUDIO_CHANNELS (stereo) rows are packed channel-major: all left-channel rows, then all right-channel rows
PATCH_SIZE = (1, 2, 2)

# Rotary clock: one unit = one audio latent (1/40 s). A latent frame spans 5/3 * (1, 4, 4, 4, 4)[i % 5] units,
# mirroring the VAE's 17 pixel frames -> 5 latents grouping. Spatial axes are aspect-normalized and scaled by 32.
_FRAME_UNIT = 5.0 / 3.0
_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
_SPATIAL_SCALE = 32

SegmentKind = Literal["text", "condition_video", "reference_audio", "audio", "video"]
VIDEO_KINDS = ("condition_video", "video")
AUDIO_KINDS = ("reference_audio", "audio")


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of the packed sequence: one modality tag, one kind (hence one timestep per step)."""

    start: int
    stop: int
    tag: int
    kind: SegmentKind

    def __len__(self) -> int:
        return self.stop - self.start


# ---------------------------------------------------------------------------------------------------------------------
# ref2va references (geometry only: the layout needs nothing else)


@dataclass(frozen=True)
class ImageRef:
    """An image reference: one latent frame at its own latent resolution."""

    latent_h: int
    latent_w: int
    kind: str = field(default="image", init=False)


@dataclass(frozen=True)
class AudioRef:
    """A standalone audio reference: 2 * audio_latents clean rows."""

    audio_latents: int
    kind: str = field(default="audio", init=False)


@dataclass(frozen=True)
class VideoRef:
    """A video reference: its soundtrack rows (2 * audio_latents, 0 without one), then its latent frames."""

    latent_frames: int
    latent_h: int
    latent_w: int
    audio_latents: int = 0
    kind: str = field(default="video", init=False)


Reference = ImageRef | AudioRef | VideoRef


# ---------------------------------------------------------------------------------------------------------------------
# The layout


@dataclass(eq=False)
class PackedLayout:
    """Structure of one packed sequence; every batch item shares it.

    `video_indices` lists condition rows first (keyframes / visual references, in order) then the target rows, and is
    strictly increasing; likewise `audio_indices` (reference audio first). `segments` tile [0, S) in order.
    """

    token_tags: torch.Tensor  # (S,) int64
    position_ids: torch.Tensor  # (S, 3) float64, (t, h, w)
    video_indices: torch.Tensor  # (Nv,) int64
    audio_indices: torch.Tensor  # (Na,) int64
    text_indices: torch.Tensor  # (L,) int64
    segments: tuple[Segment, ...]
    num_condition_video_rows: int = 0
    num_condition_audio_rows: int = 0
    # Target geometry (latent units), for unpatchify and bookkeeping.
    latent_frames: int = 0
    latent_h: int = 0
    latent_w: int = 0
    audio_latents: int = 0
    patch_size: tuple[int, int, int] = PATCH_SIZE

    @property
    def seq_len(self) -> int:
        return int(self.token_tags.shape[0])

    @property
    def text_len(self) -> int:
        return int(self.text_indices.shape[0])

    @property
    def num_video_rows(self) -> int:
        return int(self.video_indices.shape[0])

    @property
    def num_audio_rows(self) -> int:
        return int(self.audio_indices.shape[0])

    @property
    def device(self) -> torch.device:
        return self.token_tags.device

    def to(self, device: torch.device | str) -> "PackedLayout":
        """A copy with the tensors on `device` (position ids stay float64; the model casts them to fp32)."""
        device = torch.device(device)
        if self.token_tags.device == device:
            return self
        return replace(
            self,
            token_tags=self.token_tags.to(device),
            position_ids=self.position_ids.to(device),
            video_indices=self.video_indices.to(device),
            audio_indices=self.audio_indices.to(device),
            text_indices=self.text_indices.to(device),
        )

    def validate(self) -> "PackedLayout":
        """Check the invariants the model relies on; raise ValueError naming the broken one."""
        s = self.seq_len
        if self.position_ids.shape != (s, 3):
            raise ValueError(f"position_ids must be ({s}, 3), got {tuple(self.position_ids.shape)}")
        if self.text_len + self.num_video_rows + self.num_audio_rows != s:
            raise ValueError(
                f"text ({self.text_len}) + video ({self.num_video_rows}) + audio ({self.num_audio_rows}) rows "
                f"must equal the sequence length {s}"
            )
        cursor = 0
        for seg in self.segments:
            if seg.start != cursor or seg.stop <= seg.start:
                raise ValueError(f"segments must tile [0, {s}) in order without gaps; bad segment {seg}")
            cursor = seg.stop
        if cursor != s:
            raise ValueError(f"segments end at {cursor}, the sequence at {s}")
        checks = (("video", VIDEO_KINDS, self.video_indices), ("audio", AUDIO_KINDS, self.audio_indices))
        for name, kinds, idx in checks:
            count = sum(len(seg) for seg in self.segments if seg.kind in kinds)
            if count != idx.shape[0]:
                raise ValueError(f"{name} segments hold {count} rows, {name}_indices {idx.shape[0]}")
            if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
                raise ValueError(f"{name}_indices must be strictly increasing")
        return self

    @classmethod
    def from_indices(
        cls,
        token_tags: torch.Tensor,
        position_ids: torch.Tensor,
        video_indices: torch.Tensor,
        audio_indices: torch.Tensor,
        text_indices: torch.Tensor,
        num_condition_video_rows: int = 0,
        num_condition_audio_rows: int = 0,
        **geometry,
    ) -> "PackedLayout":
        """Wrap diffusers-style layout tensors, deriving the segments from them (runs of equal (kind, tag))."""
        s = int(token_tags.shape[0])
        kind_code = torch.empty(s, dtype=torch.long)
        kinds: tuple[SegmentKind, ...] = ("text", "condition_video", "video", "reference_audio", "audio")
        kind_code[text_indices.cpu()] = 0
        vi, ai = video_indices.cpu(), audio_indices.cpu()
        kind_code[vi[:num_condition_video_rows]] = 1
        kind_code[vi[num_condition_video_rows:]] = 2
        kind_code[ai[:num_condition_audio_rows]] = 3
        kind_code[ai[num_condition_audio_rows:]] = 4
        tags = token_tags.cpu().long()
        key = kind_code * NUM_TAGS + tags
        segments = tuple(Segment(a, b, int(tags[a]), kinds[int(kind_code[a])]) for a, b in _runs(key))
        return cls(
            token_tags=token_tags.long(),
            position_ids=position_ids,
            video_indices=video_indices.long(),
            audio_indices=audio_indices.long(),
            text_indices=text_indices.long(),
            segments=segments,
            num_condition_video_rows=num_condition_video_rows,
            num_condition_audio_rows=num_condition_audio_rows,
            **geometry,
        ).validate()


@dataclass(frozen=True)
class RowShard:
    """Rows [start, stop) of a packed sequence, held in a buffer of `rows` rows (the tail past stop is padding).

    `text` / `video` / `audio` are the [j0, j1) ranges of the shard's rows in the layout's text / video / audio
    indices (each strictly increasing, so a modality's rows of one shard are contiguous in it).
    """

    seq_len: int
    rows: int
    start: int
    stop: int
    text: tuple[int, int]
    video: tuple[int, int]
    audio: tuple[int, int]

    @classmethod
    def whole(cls, layout: PackedLayout) -> "RowShard":
        """Every row, no padding (shapes only: no device sync)."""
        s = layout.seq_len
        return cls(s, s, 0, s, (0, layout.text_len), (0, layout.num_video_rows), (0, layout.num_audio_rows))


def row_shards(layout: PackedLayout, world: int) -> list[RowShard]:
    """`world` equal shards of ceil(S / world) rows, in order; the last ones pad (pure; the same on every rank)."""
    s = layout.seq_len
    n = -(-s // world)
    idx = {k: getattr(layout, f"{k}_indices").to("cpu") for k in ("text", "video", "audio")}
    out = []
    for d in range(world):
        a, b = min(d * n, s), min(d * n + n, s)
        rng = {k: (int(torch.searchsorted(v, a)), int(torch.searchsorted(v, b))) for k, v in idx.items()}
        out.append(RowShard(s, n, a, b, rng["text"], rng["video"], rng["audio"]))
    return out


def _runs(key: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs [a, b) of equal values in a 1-D CPU tensor."""
    n = int(key.shape[0])
    if n == 0:
        return []
    cuts = (torch.nonzero(key[1:] != key[:-1]).flatten() + 1).tolist()
    bounds = [0, *cuts, n]
    return list(zip(bounds[:-1], bounds[1:]))


# ---------------------------------------------------------------------------------------------------------------------
# Rotary coordinates (§2.3), float64


def spatial_axis(size: int, patch: int, sqrt_area: float) -> np.ndarray:
    """One aspect-normalized spatial axis: size // patch coordinates centred on [0, 1), times 32."""
    ratio = size / sqrt_area
    left = (1.0 - ratio) / 2.0
    # numpy's endpoint=False linspace (start + i*step) is the reference formula; torch.linspace differs in the last ulp.
    return np.linspace(left, left + ratio, size // patch, endpoint=False) * _SPATIAL_SCALE


def frame_grid(latent_h: int, latent_w: int, patch_size=PATCH_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """(h, w) coordinates of one latent frame's patches, row-major ((h/2*w/2, 2)), and the w axis they came from."""
    sqrt_area = np.sqrt(latent_h * latent_w)
    hs = spatial_axis(latent_h, patch_size[1], sqrt_area)
    ws = spatial_axis(latent_w, patch_size[2], sqrt_area)
    hh, ww = np.meshgrid(hs, ws, indexing="ij")
    return np.stack([hh.reshape(-1), ww.reshape(-1)], axis=-1), ws


def _frame_spans(num_latent_frames: int) -> list[float]:
    return [_FRAME_UNIT * _FRAMES_PER_LATENT[i % len(_FRAMES_PER_LATENT)] for i in range(num_latent_frames)]


def frame_times(num_latent_frames: int, origin: float) -> np.ndarray:
    """Rotary time of each latent frame: origin + running (sequential) sum of the spans before it."""
    spans = np.asarray(_frame_spans(num_latent_frames), dtype=np.float64)
    return origin + np.concatenate([np.zeros(1), np.cumsum(spans[:-1])]) if num_latent_frames else np.zeros(0)


def _last_keyframe_time(num_latent_frames: int, origin: float) -> float:
    # Time of the last *pixel* frame, (F-1)*5/3. numpy's pairwise sum is the reference's; a sequential sum differs in
    # the last ulp from 16 latent frames on.
    spans = np.ones(num_latent_frames, dtype=np.float64) * _FRAME_UNIT
    for k, p in enumerate(_FRAMES_PER_LATENT):
        spans[k :: len(_FRAMES_PER_LATENT)] *= p
    return origin + float(spans.sum()) - _FRAME_UNIT


def _sequential_span(num_latent_frames: int) -> float:
    # The ref2va clock advance: a left-to-right float64 sum (the reference's; not pairwise, not compensated).
    total = 0.0
    for span in _frame_spans(num_latent_frames):
        total += span
    return total


def _audio_positions(num_latents: int, time0: float, w_axis: np.ndarray) -> np.ndarray:
    """(2A, 3) channel-major audio coordinates: time0 + k, h = 0, w = first / last value of the w axis."""
    pos = np.zeros((AUDIO_CHANNELS * num_latents, 3), dtype=np.float64)
    pos[:, 0] = np.tile(time0 + np.arange(num_latents, dtype=np.float64), AUDIO_CHANNELS)
    pos[:num_latents, 2] = w_axis[0]
    pos[num_latents:, 2] = w_axis[-1]
    return pos


def _video_positions(num_latent_frames: int, time0: float, grid: np.ndarray) -> np.ndarray:
    """(T * rows_per_frame, 3) frame-major video coordinates."""
    times = frame_times(num_latent_frames, time0)
    pos = np.empty((num_latent_frames, grid.shape[0], 3), dtype=np.float64)
    pos[:, :, 0] = times[:, None]
    pos[:, :, 1:] = grid[None]
    return pos.reshape(-1, 3)


# ---------------------------------------------------------------------------------------------------------------------
# Builders


class _Packer:
    """Appends blocks of rows in sequence order and records segments, tags, positions and index lists."""

    def __init__(self, text_token_tags: torch.Tensor):
        tags = text_token_tags.to(torch.long).cpu()
        n = int(tags.shape[0])
        self.positions: list[np.ndarray] = []
        self.tags: list[torch.Tensor] = []
        self.segments: list[Segment] = []
        self.video: list[tuple[int, int]] = []
        self.audio: list[tuple[int, int]] = []
        self.cursor = 0
        if n:
            text_pos = np.zeros((n, 3), dtype=np.float64)
            text_pos[:, 0] = np.arange(n, dtype=np.float64)
            self.positions.append(text_pos)
            self.tags.append(tags)
            # Vision tokens inside the text are tagged video: split the text into runs of equal tag.
            for a, b in _runs(tags):
                self.segments.append(Segment(a, b, int(tags[a]), "text"))
            self.cursor = n
        self.text_len = n

    def add(self, positions: np.ndarray, kind: SegmentKind) -> None:
        n = positions.shape[0]
        if n == 0:
            return
        tag = TAG_VIDEO if kind in VIDEO_KINDS else TAG_AUDIO
        seg = Segment(self.cursor, self.cursor + n, tag, kind)
        self.positions.append(positions)
        self.tags.append(torch.full((n,), tag, dtype=torch.long))
        (self.video if tag == TAG_VIDEO else self.audio).append((seg.start, seg.stop))
        # Adjacent blocks of one kind (two keyframes, two image refs) stay separate segments; that is harmless.
        self.segments.append(seg)
        self.cursor = seg.stop

    def build(self, num_condition_video_rows: int, num_condition_audio_rows: int, **geometry) -> PackedLayout:
        def cat_ranges(ranges):
            if not ranges:
                return torch.zeros(0, dtype=torch.long)
            return torch.cat([torch.arange(a, b, dtype=torch.long) for a, b in ranges])

        positions = np.concatenate(self.positions) if self.positions else np.zeros((0, 3))
        return PackedLayout(
            token_tags=torch.cat(self.tags) if self.tags else torch.zeros(0, dtype=torch.long),
            position_ids=torch.from_numpy(np.ascontiguousarray(positions, dtype=np.float64)),
            video_indices=cat_ranges(self.video),
            audio_indices=cat_ranges(self.audio),
            text_indices=torch.arange(self.text_len, dtype=torch.long),
            segments=tuple(self.segments),
            num_condition_video_rows=num_condition_video_rows,
            num_condition_audio_rows=num_condition_audio_rows,
            **geometry,
        ).validate()


def _text_tags(text_len: int, text_token_tags: torch.Tensor | None) -> torch.Tensor:
    if text_token_tags is None:
        return torch.full((text_len,), TAG_TEXT, dtype=torch.long)
    if int(text_token_tags.shape[0]) != text_len:
        raise ValueError(f"text_token_tags has {text_token_tags.shape[0]} entries, text_len is {text_len}")
    return text_token_tags


def _check_latent(name: str, latent_h: int, latent_w: int, patch_size) -> None:
    if latent_h <= 0 or latent_w <= 0 or latent_h % patch_size[1] or latent_w % patch_size[2]:
        raise ValueError(
            f"{name} latent size {latent_h}x{latent_w} must be positive multiples of the patch "
            f"{patch_size[1]}x{patch_size[2]} (pixel sides multiples of 32)"
        )


def build_t2va_layout(
    text_len: int,
    latent_frames: int,
    latent_h: int,
    latent_w: int,
    audio_latents: int,
    anchors: Sequence[Literal["first", "last"]] = (),
    *,
    text_token_tags: torch.Tensor | None = None,
    patch_size: tuple[int, int, int] = PATCH_SIZE,
) -> PackedLayout:
    """[text | keyframe rows (one latent frame per anchor, packed order) | target audio | target video].

    `anchors` empty is t2va; ("first",), ("last",) or ("first", "last") is fl2va. `text_token_tags` (L,) marks vision
    tokens inside the text as video (0); default all text (1).
    """
    _check_latent("target", latent_h, latent_w, patch_size)
    if patch_size[0] != 1:
        raise ValueError(f"only a temporal patch of 1 is supported, got {patch_size}")
    packer = _Packer(_text_tags(text_len, text_token_tags))
    origin = float(text_len)  # media time starts where the text ends
    grid, w_axis = frame_grid(latent_h, latent_w, patch_size)
    for anchor in anchors:
        if anchor == "first":
            t0 = origin
        elif anchor == "last":
            t0 = _last_keyframe_time(latent_frames, origin)
        else:
            raise ValueError(f"a keyframe anchor must be 'first' or 'last', got {anchor!r}")
        pos = np.empty((grid.shape[0], 3), dtype=np.float64)
        pos[:, 0] = t0
        pos[:, 1:] = grid
        packer.add(pos, "condition_video")
    packer.add(_audio_positions(audio_latents, origin, w_axis), "audio")
    packer.add(_video_positions(latent_frames, origin, grid), "video")
    return packer.build(
        num_condition_video_rows=len(anchors) * grid.shape[0],
        num_condition_audio_rows=0,
        latent_frames=latent_frames, latent_h=latent_h, latent_w=latent_w, audio_latents=audio_latents,
        patch_size=tuple(patch_size),
    )


def build_ref2va_layout(
    text_len: int,
    references: Sequence[Reference],
    latent_frames: int,
    latent_h: int,
    latent_w: int,
    audio_latents: int,
    *,
    text_token_tags: torch.Tensor | None = None,
    patch_size: tuple[int, int, int] = PATCH_SIZE,
) -> PackedLayout:
    """[text | reference blocks in request order | target audio | target video].

    A shared rotary clock starts at L: an image takes one unit, an audio reference A_ref units, a video reference
    max(A_ref, sum of its frame spans); its soundtrack rows come right before its frames and share their origin.
    Visual reference rows are condition rows (held at 0.999); reference audio rows are clean (1.0).
    """
    _check_latent("target", latent_h, latent_w, patch_size)
    packer = _Packer(_text_tags(text_len, text_token_tags))
    _, target_w_axis = frame_grid(latent_h, latent_w, patch_size)
    clock = float(text_len)
    n_cond_video = n_cond_audio = 0
    for ref in references:
        if isinstance(ref, ImageRef):
            _check_latent("image reference", ref.latent_h, ref.latent_w, patch_size)
            grid, _ = frame_grid(ref.latent_h, ref.latent_w, patch_size)
            pos = np.empty((grid.shape[0], 3), dtype=np.float64)
            pos[:, 0] = clock
            pos[:, 1:] = grid
            packer.add(pos, "condition_video")
            n_cond_video += grid.shape[0]
            clock += 1.0  # one integer slot, not a latent frame's 5/3 units
        elif isinstance(ref, AudioRef):
            packer.add(_audio_positions(ref.audio_latents, clock, target_w_axis), "reference_audio")
            n_cond_audio += AUDIO_CHANNELS * ref.audio_latents
            clock += float(ref.audio_latents)
        elif isinstance(ref, VideoRef):
            _check_latent("video reference", ref.latent_h, ref.latent_w, patch_size)
            grid, w_axis = frame_grid(ref.latent_h, ref.latent_w, patch_size)
            # The soundtrack is pinned to the video reference's own w axis, not the target's.
            packer.add(_audio_positions(ref.audio_latents, clock, w_axis), "reference_audio")
            packer.add(_video_positions(ref.latent_frames, clock, grid), "condition_video")
            n_cond_audio += AUDIO_CHANNELS * ref.audio_latents
            n_cond_video += ref.latent_frames * grid.shape[0]
            clock += max(float(ref.audio_latents), _sequential_span(ref.latent_frames))
        else:
            raise ValueError(f"a reference must be an ImageRef, AudioRef or VideoRef, got {type(ref).__name__}")
    grid, _ = frame_grid(latent_h, latent_w, patch_size)
    packer.add(_audio_positions(audio_latents, clock, target_w_axis), "audio")
    packer.add(_video_positions(latent_frames, clock, grid), "video")
    return packer.build(
        num_condition_video_rows=n_cond_video,
        num_condition_audio_rows=n_cond_audio,
        latent_frames=latent_frames, latent_h=latent_h, latent_w=latent_w, audio_latents=audio_latents,
        patch_size=tuple(patch_size),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Per-step row timesteps (§2.5)


CONDITION_ROW_TIMESTEP = 0.999  # visual conditions are held just short of clean
REFERENCE_AUDIO_TIMESTEP = 1.0  # clean reference audio rows


def kind_timesteps(
    video_t: float,
    audio_t: float,
    *,
    condition_t: float = CONDITION_ROW_TIMESTEP,
    reference_audio_t: float = REFERENCE_AUDIO_TIMESTEP,
) -> dict[str, float]:
    """The clean time each segment kind is fed at one step: text and target video `video_t`, target audio `audio_t`,
    visual condition rows max(video_t, condition_t), reference audio rows `reference_audio_t`."""
    return {
        "text": video_t,
        "video": video_t,
        "condition_video": max(float(video_t), float(condition_t)),
        "audio": audio_t,
        "reference_audio": reference_audio_t,
    }


def distinct_timesteps(kinds: Sequence[str], video_t: float, audio_t: float, **times: float) -> torch.Tensor:
    """The model's timesteps (n_t,) float32 sorted for a layout holding segments of `kinds`: what `row_timesteps`
    returns for any such layout (the AdaLN table enumerates a schedule's forward inputs with it)."""
    value_of = kind_timesteps(video_t, audio_t, **times)
    return torch.unique(torch.tensor([float(value_of[k]) for k in kinds], dtype=torch.float32), sorted=True)


def row_timesteps(
    layout: PackedLayout,
    video_t: float,
    audio_t: float,
    *,
    condition_t: float = CONDITION_ROW_TIMESTEP,
    reference_audio_t: float = REFERENCE_AUDIO_TIMESTEP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's (timesteps (n_t,) float32 sorted, timestep_indices (S,) int64) for one step, on CPU.

    Each row takes its segment kind's time (`kind_timesteps`). Values are rounded to float32 first and then made
    unique, exactly as torch.unique(sorted=True, return_inverse=True) over the per-row float32 vector would do; the
    work here is per segment, not per row.
    """
    value_of = kind_timesteps(video_t, audio_t, condition_t=condition_t, reference_audio_t=reference_audio_t)
    seg_values = torch.tensor([float(value_of[seg.kind]) for seg in layout.segments], dtype=torch.float32)
    unique, inverse = torch.unique(seg_values, sorted=True, return_inverse=True)
    lengths = torch.tensor([len(seg) for seg in layout.segments], dtype=torch.long)
    return unique, torch.repeat_interleave(inverse, lengths)


# ---------------------------------------------------------------------------------------------------------------------
# Latents <-> rows


def patchify(latents: torch.Tensor, patch_size: tuple[int, int, int] = PATCH_SIZE) -> torch.Tensor:
    """(B, C, T, h, w) latents -> (B*T*h/2*w/2, C*4) rows: frame-major, row-major patches, channel-major vector."""
    pt, ph, pw = patch_size
    b, c, t, h, w = latents.shape
    if t % pt or h % ph or w % pw:
        raise ValueError(f"latents {tuple(latents.shape)} are not divisible by the patch {patch_size}")
    x = latents.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
    x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)  # (B, T', h', w', C, pt, ph, pw)
    return x.reshape(-1, c * pt * ph * pw).contiguous()


def unpatchify(
    rows: torch.Tensor, latent_frames: int, latent_h: int, latent_w: int,
    patch_size: tuple[int, int, int] = PATCH_SIZE,
) -> torch.Tensor:
    """(B*T*h/2*w/2, C*4) rows -> (B, C, T, h, w) latents; the inverse of `patchify`."""
    pt, ph, pw = patch_size
    c = rows.shape[-1] // (pt * ph * pw)
    x = rows.reshape(-1, latent_frames // pt, latent_h // ph, latent_w // pw, c, pt, ph, pw)
    x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)  # (B, C, T', pt, h', ph, w', pw)
    return x.reshape(-1, c, latent_frames, latent_h, latent_w).contiguous()


def audio_to_rows(audio_latents: torch.Tensor) -> torch.Tensor:
    """(2, 32, A) stereo latents -> (2A, 32) channel-major rows (left channel's A rows first)."""
    ch, c, a = audio_latents.shape
    return audio_latents.permute(0, 2, 1).reshape(ch * a, c).contiguous()


def rows_to_audio(rows: torch.Tensor, channels: int = AUDIO_CHANNELS) -> torch.Tensor:
    """(2A, 32) channel-major rows -> (2, 32, A); the inverse of `audio_to_rows`."""
    n, c = rows.shape
    return rows.reshape(channels, n // channels, c).permute(0, 2, 1).contiguous()
