"""Far copies: a (K+1)-mer ending at a base that also ends more than D bases earlier in the window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genomelm.data.far_copy import far_copy_targets, plant_copies, predicted_far_copy
from genomelm.data.vocab import BUILTIN, N, Vocabulary
from genomelm.data.windows import Window


def random_bases(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 5, n).astype(np.uint8)  # A C G T codes


def test_a_planted_copy_is_far_from_its_kth_base_on() -> None:
    codes = random_bases(10_000)
    codes[6000:6100] = codes[1000:1100]
    far = far_copy_targets(codes)
    # the 21-mer ending at 6020 is the first whole one inside the copy; the copy ends at 6099
    assert np.flatnonzero(far).tolist() == list(range(6020, 6100))


def test_distance_is_strict_and_n_breaks_a_match() -> None:
    codes = random_bases(400, seed=1)
    codes[300:330] = codes[100:130]  # copies 200 bases apart
    assert far_copy_targets(codes, k=20, distance=199)[320:330].all()
    assert not far_copy_targets(codes, k=20, distance=200).any()  # 200 is not more than 200
    codes[310] = N
    far = far_copy_targets(codes, k=20, distance=199)
    assert not far[310:330].any()  # every 21-mer ending there spans the N


def test_short_or_copy_free_sequences_have_none() -> None:
    assert not far_copy_targets(random_bases(15)).any()
    assert not far_copy_targets(random_bases(20_000, seed=2)).any()  # 21-mers recur by chance ~never


def test_predicted_far_copy_reads_ids_of_any_vocabulary_and_shifts_to_the_predicting_position() -> None:
    codes = random_bases(5_000, seed=3)
    codes[4000:4050] = codes[500:550]
    target = far_copy_targets(codes)
    soft = torch.zeros(len(codes), dtype=torch.bool)
    builtin = Window("t", 0, "chrT", 0, len(codes), torch.from_numpy(codes.astype(np.int64)), soft, BUILTIN)
    predicted = predicted_far_copy(builtin)
    assert np.array_equal(predicted[:-1], target[1:]) and not predicted[-1]
    remapped = Vocabulary(code_to_id=(0, 7, 9, 11, 13, 2), vocab_size=16)  # a tokenizer's own ids
    ids = torch.tensor(remapped.code_to_id)[torch.from_numpy(codes.astype(np.int64))]
    window = Window("t", 0, "chrT", 0, len(codes), ids, soft, remapped)
    assert np.array_equal(predicted_far_copy(window), predicted)


def test_planted_copies_repeat_their_sources_far_back_and_mark_only_real_far_copies() -> None:
    rng = np.random.default_rng(3)
    with_copies = 0
    for _ in range(50):
        codes = random_bases(1024, seed=int(rng.integers(1 << 30)))
        planted, copied = plant_copies(
            codes, rng, rate=0.9, min_length=30, max_length=90, min_distance=256, k=8
        )
        assert planted.dtype == np.uint8 and len(planted) == 1024
        # every marked base ends a 9-mer that also ends more than 256 bases earlier: a far copy by definition
        assert far_copy_targets(planted, k=8, distance=256)[copied].all()
        with_copies += bool(copied.any())
    assert with_copies >= 40  # a first copy is planted with probability 0.9
    unchanged, none = plant_copies(
        random_bases(1024), rng, rate=0.0, min_length=30, max_length=90, min_distance=256
    )
    assert (unchanged == random_bases(1024)).all() and not none.any()
    with pytest.raises(ValueError, match="no room"):
        plant_copies(random_bases(300), rng, 0.5, 30, 90, 256)
