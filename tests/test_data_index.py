"""The hand-written .bin/.idx writer against megatron-core's IndexedDatasetBuilder, byte for byte, and the
hand-written reader against its IndexedDataset."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from genomelm.data.indexed import IndexedWriter, read_windows


@pytest.mark.parametrize("lengths", [[], [7], [4096, 1, 300, 4096, 0, 12]])
def test_index_matches_megatron_builder(tmp_path: Path, lengths: list[int]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    items = [rng.integers(0, 6, size=n, dtype=np.uint8) for n in lengths]
    theirs = IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint8)
    ours = IndexedWriter(tmp_path / "ours.bin")
    for item in items:
        theirs.add_item(torch.from_numpy(item))
        theirs.end_document()
        ours.add(item)
    theirs.finalize(str(tmp_path / "theirs.idx"))
    ours.finalize(tmp_path / "ours.idx")
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "theirs.idx").read_bytes()
    if any(lengths):
        reread = IndexedDataset(str(tmp_path / "ours"))
        assert len(reread) == len(items)
        assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "theirs.bin").read_bytes()
        for index, item in enumerate(items):
            assert np.array_equal(reread[index], item)


@pytest.mark.parametrize("windows", [0, 1, 5])
def test_read_windows_reads_what_megatrons_reader_reads(tmp_path: Path, windows: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    items = np.random.default_rng(1).integers(0, 6, size=(windows, 64), dtype=np.uint8)
    writer = IndexedWriter(tmp_path / "w.bin")
    for item in items:
        writer.add(item)
    writer.finalize(tmp_path / "w.idx")
    ours = read_windows(tmp_path / "w.bin", windows, 64)
    assert ours.shape == (windows, 64) and np.array_equal(ours, items)
    if windows:  # megatron's reader cannot open an empty .bin
        theirs = IndexedDataset(str(tmp_path / "w"))
        assert len(theirs) == len(ours)
        for index in range(windows):
            assert np.array_equal(ours[index], theirs[index])
