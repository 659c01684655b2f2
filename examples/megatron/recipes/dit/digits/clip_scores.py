"""Scores of moving-digit clips: what digit (per frame, by majority), does it stay the same digit, and
where does it move (the intensity centre of mass over time).

The classifier looks at the 8x8 window around each frame's centre of mass. It is trained on the same
windows cut from real digits (``centred_crops``), so the window rule is part of what its held-out
accuracy measures, and a digit reads the same wherever it sits on the canvas.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from digits.clips import MOTIONS
from digits.data import DIGIT_SIZE


def centres_of_mass(frames: np.ndarray) -> np.ndarray:
    """frames [..., H, W] (>= 0) -> (row, column) [..., 2]; a blank frame gives the canvas centre."""
    frames = np.asarray(frames, dtype=np.float64)
    h, w = frames.shape[-2:]
    total = frames.sum(axis=(-2, -1))
    safe = np.where(total > 0, total, 1.0)
    rows = (frames.sum(axis=-1) * np.arange(h)).sum(axis=-1) / safe
    cols = (frames.sum(axis=-2) * np.arange(w)).sum(axis=-1) / safe
    centre = np.stack([rows, cols], axis=-1)
    return np.where((total > 0)[..., None], centre, [(h - 1) / 2, (w - 1) / 2])


def centred_crops(frames: np.ndarray) -> np.ndarray:
    """frames [N, H, W] -> the 8x8 windows [N, 8, 8] around their centres of mass (kept on the canvas)."""
    frames = np.asarray(frames)
    h, w = frames.shape[-2:]
    if min(h, w) < DIGIT_SIZE:
        raise ValueError(f"frames of {h}x{w} are smaller than one {DIGIT_SIZE}x{DIGIT_SIZE} digit")
    half = (DIGIT_SIZE - 1) / 2
    corners = np.rint(centres_of_mass(frames) - half).astype(int)
    tops, lefts = np.clip(corners[:, 0], 0, h - DIGIT_SIZE), np.clip(corners[:, 1], 0, w - DIGIT_SIZE)
    return np.stack([f[t : t + DIGIT_SIZE, s : s + DIGIT_SIZE] for f, t, s in zip(frames, tops, lefts)])


def pad_to_canvas(images: np.ndarray, canvas: int = 2 * DIGIT_SIZE) -> np.ndarray:
    """images [N, 8, 8] -> [N, canvas, canvas], centred on a blank canvas."""
    before = (canvas - DIGIT_SIZE) // 2
    return np.pad(images, ((0, 0), (before, canvas - DIGIT_SIZE - before), (before, canvas - DIGIT_SIZE - before)))


def motion_of(clips: np.ndarray, still_below: float) -> list[str]:
    """clips [N, T, H, W] -> the motion name of each: the centre of mass's least-squares displacement
    over the clip, "standing still" when shorter than ``still_below`` pixels, else its main direction."""
    centres = centres_of_mass(clips)  # [N, T, 2]
    t = np.arange(clips.shape[1], dtype=np.float64)
    t_centred = t - t.mean()
    slope = (centres * t_centred[None, :, None]).sum(axis=1) / max((t_centred**2).sum(), 1e-9)
    displacement = slope * (t[-1] - t[0])  # [N, 2] (rows, columns)
    names = []
    for dy, dx in displacement:
        if max(abs(dy), abs(dx)) < still_below:
            names.append("standing still")
        else:
            step = (int(np.sign(dy)), 0) if abs(dy) > abs(dx) else (0, int(np.sign(dx)))
            names.append(next(name for name, move in MOTIONS.items() if move == step))
    return names


@dataclass
class ClipVerdicts:
    digits: np.ndarray  # [N] majority digit of each clip
    consistency: np.ndarray  # [N] fraction of its frames agreeing with that majority
    motions: list[str]  # [N]


def judge_clips(clips: np.ndarray, classify, still_below: float) -> ClipVerdicts:
    """clips [N, T, H, W] in 0..16; ``classify(crops [M, 8, 8]) -> digits [M]``."""
    n, t = clips.shape[:2]
    per_frame = np.asarray(classify(centred_crops(clips.reshape(n * t, *clips.shape[2:])))).reshape(n, t)
    counts = np.stack([np.bincount(row, minlength=10) for row in per_frame])
    majority = counts.argmax(axis=1)
    return ClipVerdicts(majority, counts.max(axis=1) / t, motion_of(clips, still_below))


def motion_accuracy(motions: list[str], prompted: list[str]) -> float:
    return float(np.mean([m == p for m, p in zip(motions, prompted, strict=True)]))
