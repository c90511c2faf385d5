"""Readers of a prepared folder: a memory-mapped torch ``WindowDataset`` and a Hugging Face view of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from genomelm.data.errors import DataError
from genomelm.data.indexed import read_windows
from genomelm.data.integrity import FolderCheck, split_files
from genomelm.data.prepare import MANIFEST, SPLITS, read_manifest
from genomelm.data.vocab import CODE_LETTERS, IGNORE_INDEX, Vocabulary
from genomelm.data.windows import Window

__all__ = ["IGNORE_INDEX", "VERIFY_MODES", "WindowDataset", "as_hf_dataset"]

VERIFY_MODES = ("open", "lazy")


class WindowDataset(Dataset):
    """Windows of one split of a prepared folder; item ``i`` is a :class:`~genomelm.data.windows.Window`
    (token ids of the folder's vocabulary, the soft-mask, record coordinates; labels derived from the ids).

    The .bin files are memory-mapped. Opening checks the split's four files against the manifest
    (`genomelm.data.integrity`): each present with its recorded size, the .idx files hashed and agreeing with
    the manifest's windows and the .bin sizes. The .bin files' 64 MiB blocks are hashed (xxh3-128) at open
    with ``verify="open"`` (the default: a damaged file fails before training or evaluation starts; ~0.1 s
    per GB from the page cache, the disk's speed when cold), or each block once, just before the first
    window in it is read, with ``verify="lazy"`` (for reading a few windows of a large folder). Every window
    read is also checked to hold only base codes. Any mismatch is a ``DataError`` naming the file and the
    command that rebuilds it. A folder prepared before checksums were recorded is read with a warning.
    """

    def __init__(self, path: str | Path, split: str, verify: str = "open") -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify={verify!r}: must be one of {', '.join(VERIFY_MODES)}")
        self.path = Path(path)
        if split not in SPLITS:
            raise DataError(f"split {split!r}: must be one of {', '.join(SPLITS)}")
        manifest = read_manifest(self.path)
        if manifest is None:
            raise DataError(
                f"{self.path}: no {MANIFEST}, so not a complete prepared dataset; run `genomelm data`"
            )
        self.manifest: dict = manifest
        self.split = split
        self.seq_len: int = int(manifest["seq_len"])
        self.vocab = Vocabulary.from_json(manifest["vocab"])
        info = manifest["splits"][split]
        self.check = FolderCheck(self.path, manifest)
        self.check.warn_if_legacy()
        codes_bin, codes_idx, mask_bin, mask_idx = split_files(info)
        self._bins = (codes_bin, mask_bin)
        sizes = self.check.check_sizes([codes_bin, codes_idx, mask_bin, mask_idx])
        self.check.verify(codes_idx)
        self.check.verify(mask_idx)
        self.check.check_index(info, self.seq_len, sizes)
        if verify == "open":
            for name in self._bins:
                self.check.verify(name)
        self._lazy = verify == "lazy" and self.check.has_checksums
        windows = info["windows"]
        count = len(windows["start"])
        self.tokens = read_windows(self.path / codes_bin, count, self.seq_len)
        self.softmasks = read_windows(self.path / mask_bin, count, self.seq_len)
        self.records: list[str] = windows["records"]
        self.record_index = np.asarray(windows["record"], dtype=np.int64)
        self.starts = np.asarray(windows["start"], dtype=np.int64)
        self.ends = np.asarray(windows["end"], dtype=np.int64)
        self._code_to_id = torch.tensor(self.vocab.code_to_id, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.tokens)

    def coordinates(self, index: int) -> dict:
        """``record``, ``start``, ``end`` (0-based half-open) of window ``index``, without reading it."""
        return {
            "record": self.records[self.record_index[index]],
            "start": int(self.starts[index]),
            "end": int(self.ends[index]),
        }

    def _read(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(codes, soft-mask) of window ``index`` as on disk, their blocks verified first when lazy;
        DataError when a byte is no base code (0..5) or no soft-mask flag (0, 1)."""
        start = index * self.seq_len  # every window is SEQ bytes (checked at open), in order
        if self._lazy:
            for name in self._bins:
                self.check.verify(name, start, start + self.seq_len)
        codes, mask = self.tokens[index], self.softmasks[index]
        for name, values, top in ((self._bins[0], codes, len(CODE_LETTERS) - 1), (self._bins[1], mask, 1)):
            if values.size and int(values.max()) > top:
                at = int(np.flatnonzero(values > top)[0])
                self.check.fail(
                    name,
                    f"byte {start + at:,} (window {index}, position {at}) is {int(values[at])}, not a "
                    + ("base code (0-5)" if top > 1 else "soft-mask flag (0 or 1)"),
                )
        return codes, mask

    def codes(self, index: int) -> np.ndarray:
        """On-disk codes (uint8 [SEQ], read-only view of the memory map) of window ``index``."""
        return self._read(index)[0]

    def letters(self, index: int) -> str:
        """Window ``index`` as sequence text, lower case where soft-masked, '-' for padding."""
        codes, mask = self._read(index)
        letters = CODE_LETTERS[codes].copy()
        letters[mask.astype(bool)] |= 0x20
        return letters.tobytes().decode("ascii")

    def __getitem__(self, index: int) -> Window:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range 0..{len(self) - 1}")
        codes, mask = self._read(index)
        return Window(
            source=self.path.name,
            index=index,
            **self.coordinates(index),
            ids=self._code_to_id[torch.from_numpy(codes.astype(np.int64))],
            softmask=torch.from_numpy(mask.astype(bool)),
            vocab=self.vocab,
        )


def as_hf_dataset(path: str | Path, split: str, cache_dir: str | None = None):
    """The windows of ``WindowDataset(path, split)`` as rows of a ``datasets.Dataset``: ``input_ids``,
    ``labels``, ``softmask`` and ``position`` (0..SEQ-1) as lists of ints/bools, and ``record``, ``start``,
    ``end``.

    Rows are written once into the datasets cache (``cache_dir`` or the default); no network is used.
    """
    import datasets

    source = Path(path).resolve()
    manifest = read_manifest(source)
    if manifest is None:
        raise DataError(f"{source}: no {MANIFEST}, so not a complete prepared dataset; run `genomelm data`")

    def rows(folder: str, split_name: str, fingerprint: str):
        windows = WindowDataset(folder, split_name)
        if windows.manifest["fingerprint"] != fingerprint:
            raise DataError(f"{folder} was rebuilt while being read; call as_hf_dataset again")
        for i in range(len(windows)):
            window = windows[i]
            yield {
                "input_ids": window.input_ids.tolist(),
                "labels": window.labels.tolist(),
                "softmask": window.softmask.tolist(),
                "position": list(range(windows.seq_len)),
                "record": window.record,
                "start": window.start,
                "end": window.end,
            }

    seq = int(manifest["seq_len"])
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64"), length=seq),
            "labels": datasets.Sequence(datasets.Value("int64"), length=seq),
            "softmask": datasets.Sequence(datasets.Value("bool"), length=seq),
            "position": datasets.Sequence(datasets.Value("int64"), length=seq),
            "record": datasets.Value("string"),
            "start": datasets.Value("int64"),
            "end": datasets.Value("int64"),
        }
    )
    # The manifest fingerprint is part of the datasets cache key, so a rebuilt folder is never read stale.
    kwargs = {"folder": str(source), "split_name": split, "fingerprint": manifest["fingerprint"]}
    return datasets.Dataset.from_generator(rows, features=features, gen_kwargs=kwargs, cache_dir=cache_dir)
