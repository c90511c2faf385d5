"""Writer of megatron-core indexed datasets (``.bin`` + ``.idx``, version 1) of uint8 sequences.

Hand-written on purpose: megatron's ``IndexedDatasetBuilder`` needs ``import megatron.core`` (~5 s with
torch, longer than preparing 100 Mb) and copies every item several times (torch tensor -> numpy ->
bytes). Here each sequence's bytes go to the ``.bin`` file straight from the caller's numpy buffer and
the ``.idx`` is written once at the end, byte for byte what ``IndexedDatasetBuilder.finalize`` writes
(``_IndexWriter`` in megatron/core/datasets/indexed_dataset.py; tests/test_data_index.py compares the
two). Readers still use megatron's ``IndexedDataset``.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODE_UINT8 = 1  # megatron's DType.uint8


class IndexedWriter:
    """Appends uint8 sequences (one document each) to ``<prefix>.bin``; ``finalize`` writes
    ``<prefix>.idx``."""

    def __init__(self, bin_path: str | Path) -> None:
        self.data = open(bin_path, "wb")  # noqa: SIM115 - closed by finalize
        self.lengths: list[int] = []

    def add(self, values: np.ndarray) -> None:
        """One document of one sequence; ``values`` is a 1-D uint8 array, written without a copy if
        contiguous."""
        assert values.dtype == np.uint8, values.dtype
        self.data.write(np.ascontiguousarray(values).data)
        self.lengths.append(values.size)

    def finalize(self, idx_path: str | Path) -> None:
        self.data.close()
        lengths = np.asarray(self.lengths, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=pointers[1:])  # byte offsets (itemsize 1)
        documents = np.arange(len(lengths) + 1, dtype=np.int64)  # one sequence per document
        with open(idx_path, "wb") as out:
            out.write(INDEX_HEADER + struct.pack("<QB", INDEX_VERSION, DTYPE_CODE_UINT8))
            out.write(struct.pack("<QQ", len(lengths), len(documents)))
            out.write(lengths.astype(np.int32).tobytes())
            out.write(pointers.tobytes())
            out.write(documents.tobytes())
