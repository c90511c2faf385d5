"""Far copies: the bases a model can only predict well by retrieving far context (numpy only).

A fact of the sequence alone (never of a model's loss), used to split the held-out loss: the target base j of
a window is a far copy when the K bases before it and the base itself (a (K+1)-mer of A/C/G/T) occur earlier
in the window, ending more than D bases before j. Where that holds, a model that retrieves the earlier copy
can predict the base from it; a model limited to nearer context sees nothing that says which base follows.
The defaults (K = 20, D = 2,000) are those the demo's measurements used: a given 21-mer recurs by chance
about once in 4^21 = 4.4e12 positions, so nearly every match is a real repeat.
"""

from __future__ import annotations

import numpy as np

from genomelm.data.vocab import A, T
from genomelm.data.windows import Window

FAR_COPY_K = 20  # bases before the target that must match
FAR_COPY_DISTANCE = 2000  # the earlier copy ends more than this many bases before the target


def far_copy_targets(codes: np.ndarray, k: int = FAR_COPY_K, distance: int = FAR_COPY_DISTANCE) -> np.ndarray:
    """bool [S]: True at each index j of `codes` (uint8 [S], base codes A=1 .. T=4; N and padding never
    match) whose (k+1)-mer codes[j-k .. j] also ends at some i < j - distance."""
    codes = np.asarray(codes)
    out = np.zeros(len(codes), dtype=bool)
    ends = len(codes) - k  # (k+1)-mers, the m-th ending at index m + k
    if ends <= 0:
        return out
    is_base = (codes >= A) & (codes <= T)
    two_bits = (codes.astype(np.int64) - A) & 3
    key = np.zeros(ends, dtype=np.int64)
    whole = np.ones(ends, dtype=bool)
    for i in range(k + 1):  # 2 bits a base: 2 (k + 1) <= 63 bits for k <= 30
        key = (key << 2) | two_bits[i : i + ends]
        whole &= is_base[i : i + ends]
    end = np.arange(k, len(codes))[whole]
    _, first, inverse = np.unique(key[whole], return_index=True, return_inverse=True)
    far = end - end[first][inverse] > distance  # the earliest copy ends far enough before
    out[end[far]] = True
    return out


def predicted_far_copy(window: Window, k: int = FAR_COPY_K, distance: int = FAR_COPY_DISTANCE) -> np.ndarray:
    """bool [L] over the positions the model reads: True where the predicted (next) base is a far copy in the
    window (as `far_copy_targets` on the whole window's bases); False at the last position."""
    if not 0 < k <= 30:
        raise ValueError(f"k={k}: 1..30 bases (2 bits each in one 64-bit key)")
    ids = window.ids.numpy()
    codes = np.zeros(len(ids), dtype=np.uint8)
    for code in range(A, T + 1):
        codes[ids == window.vocab.code_to_id[code]] = code
    target = far_copy_targets(codes, k, distance)
    predicted = np.zeros(len(ids), dtype=bool)
    predicted[:-1] = target[1:]  # position t predicts base t + 1
    return predicted[window.span]


def plant_copies(
    codes: np.ndarray,
    rng: np.random.Generator,
    rate: float,
    min_length: int,
    max_length: int,
    min_distance: int,
    k: int = FAR_COPY_K,
) -> tuple[np.ndarray, np.ndarray]:
    """Re-insert spans of a window later in it: (codes, copied) with codes uint8 [S] (a copy, the input is
    kept) and copied bool [S], True at each planted base after the copy's first min(k, length // 3) bases
    (from there its preceding bases say which earlier span it repeats).

    The number of copies is geometric: another one is planted while a draw is below `rate` (mean
    rate / (1 - rate)). Each copies [src, src + m) over [dst, dst + m), m uniform in [min_length, max_length),
    dst >= src + m + min_distance. Sources and copies never overlap one another (a draw that would is redrawn,
    up to 20 times, then that copy is skipped), so every marked base repeats its source exactly.
    """
    if not 0 <= rate < 1:
        raise ValueError(f"rate={rate}: give a probability in [0, 1)")
    if not 0 < min_length < max_length:
        raise ValueError(f"lengths [{min_length}, {max_length}): give 0 < min_length < max_length")
    out = np.array(codes, dtype=np.uint8, copy=True)
    copied = np.zeros(len(out), dtype=bool)
    if len(out) < 2 * max_length + min_distance:
        raise ValueError(
            f"a window of {len(out)} bases has no room for copies of up to {max_length} bases "
            f"{min_distance} bases apart; give a longer window or shorter copies"
        )
    used = np.zeros(len(out), dtype=bool)  # bases already a source or a copy
    while rng.random() < rate:
        for _ in range(20):
            m = int(rng.integers(min_length, max_length))
            src = int(rng.integers(0, len(out) - min_distance - 2 * m + 1))
            dst = int(rng.integers(src + m + min_distance, len(out) - m + 1))
            if not used[src : src + m].any() and not used[dst : dst + m].any():
                out[dst : dst + m] = out[src : src + m]
                used[src : src + m] = used[dst : dst + m] = True
                copied[dst + min(k, m // 3) : dst + m] = True
                break
    return out, copied
