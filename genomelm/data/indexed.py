"""Writer of megatron-core indexed datasets (``.bin`` + ``.idx``, version 1) of uint8 sequences.

Hand-written on purpose: megatron's ``IndexedDatasetBuilder`` needs ``import megatron.core`` (~5 s with
torch, longer than preparing 100 Mb) and copies every item several times (torch tensor -> numpy ->
bytes). Here each sequence's bytes go to the ``.bin`` file straight from the caller's numpy buffer and
the ``.idx`` is written once at the end, byte for byte what ``IndexedDatasetBuilder.finalize`` writes
(``_IndexWriter`` in megatron/core/datasets/indexed_dataset.py; tests/test_data_index.py compares the
two). ``read_windows`` reads them back, also by hand: a prepared folder's windows all have SEQ tokens (its
index is checked at open, ``FolderCheck.check_index``), so a window is a row of a memory map, and megatron's
``IndexedDataset`` would cost every process that reads data ~2 s of CPU to import (``megatron.core``
imports its whole transformer stack); the test reads the same files with it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODE_UINT8 = 1  # megatron's DType.uint8


class Hasher(Protocol):
    """What hashes a file as it is written (``genomelm.data.integrity.BlockHasher``)."""

    def update(self, data) -> None: ...

    def entry(self) -> dict: ...


class IndexedWriter:
    """Appends uint8 sequences (one document each) to ``<prefix>.bin``; ``finalize`` writes
    ``<prefix>.idx``."""

    def __init__(self, bin_path: str | Path, hasher: Callable[[], Hasher] | None = None) -> None:
        self.bin_path = Path(bin_path)
        self.data = open(bin_path, "wb")  # noqa: SIM115 - closed by finalize
        self.lengths: list[int] = []
        self.hasher = hasher
        self.bin_hash = hasher() if hasher else None

    def add(self, values: np.ndarray) -> None:
        """One document of one sequence; ``values`` is a 1-D uint8 array, written without a copy if
        contiguous (and hashed as it is written, when the writer has a ``hasher``)."""
        assert values.dtype == np.uint8, values.dtype
        data = np.ascontiguousarray(values).data
        self.data.write(data)
        if self.bin_hash is not None:
            self.bin_hash.update(data)
        self.lengths.append(values.size)

    def finalize(self, idx_path: str | Path) -> dict[str, dict]:
        """Write ``idx_path``; returns the hasher's entry of each file, by file name (empty without one)."""
        self.data.close()
        lengths = np.asarray(self.lengths, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=pointers[1:])  # byte offsets (itemsize 1)
        documents = np.arange(len(lengths) + 1, dtype=np.int64)  # one sequence per document
        index = b"".join(
            [
                INDEX_HEADER + struct.pack("<QB", INDEX_VERSION, DTYPE_CODE_UINT8),
                struct.pack("<QQ", len(lengths), len(documents)),
                lengths.astype(np.int32).tobytes(),
                pointers.tobytes(),
                documents.tobytes(),
            ]
        )
        with open(idx_path, "wb") as out:
            out.write(index)
        if self.hasher is None:
            return {}
        idx_hash = self.hasher()
        idx_hash.update(index)
        return {self.bin_path.name: self.bin_hash.entry(), Path(idx_path).name: idx_hash.entry()}


def index_lengths(idx_path: str | Path) -> np.ndarray:
    """Sequence lengths (int32 [count]) of a version-1 uint8 ``.idx``; ValueError saying what is wrong when
    the file is not one, or its size is not what its counts need."""
    data = Path(idx_path).read_bytes()  # 20 bytes per sequence
    head = len(INDEX_HEADER) + struct.calcsize("<QB")
    if len(data) < head + 16:
        raise ValueError(f"only {len(data)} bytes, fewer than an index header's {head + 16}")
    if data[: len(INDEX_HEADER)] != INDEX_HEADER:
        raise ValueError(f"starts {data[: len(INDEX_HEADER)]!r}, not megatron-core's {INDEX_HEADER!r}")
    version, dtype = struct.unpack_from("<QB", data, len(INDEX_HEADER))
    if (version, dtype) != (INDEX_VERSION, DTYPE_CODE_UINT8):
        raise ValueError(f"version {version}, dtype code {dtype}; expected version 1 of uint8 (code 1)")
    count, documents = struct.unpack_from("<QQ", data, head)
    needed = head + 16 + 12 * count + 8 * documents
    if len(data) != needed:
        raise ValueError(
            f"{len(data):,} bytes, but {count:,} sequences in {documents:,} documents need {needed:,}"
        )
    return np.frombuffer(data, dtype=np.int32, count=count, offset=head + 16)


def read_windows(bin_path: str | Path, windows: int, seq_len: int) -> np.ndarray:
    """The ``.bin`` of `windows` sequences of `seq_len` uint8 each as a read-only [windows, seq_len] memory
    map (a row is one window, read from disk when used); the caller has checked the file's size."""
    if windows == 0:
        return np.zeros((0, seq_len), dtype=np.uint8)
    return np.memmap(bin_path, dtype=np.uint8, mode="r", shape=(windows, seq_len))
