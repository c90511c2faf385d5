"""Data stage: genomes -> uint8 base-code windows on disk -> torch / Hugging Face datasets.

``prepare(DataConfig(...), command)`` builds a folder; ``WindowDataset(folder, split)`` reads it.
The readers (``WindowDataset``, ``as_hf_dataset``, ``IGNORE_INDEX``) are imported on first use: they need
torch (~2 s), which ``genomelm data`` (and an up-to-date check) never does.
"""

from typing import TYPE_CHECKING

from genomelm.data.config import DataConfig
from genomelm.data.errors import DataError
from genomelm.data.prepare import format_report, prepare, read_manifest
from genomelm.data.regions import parse_seq, seq_label
from genomelm.data.vocab import BUILTIN, CODE_NAMES, Vocabulary, tokenizer_vocabulary

if TYPE_CHECKING:
    from genomelm.data.dataset import IGNORE_INDEX, WindowDataset, as_hf_dataset

_READERS = ("IGNORE_INDEX", "WindowDataset", "as_hf_dataset")


def __getattr__(name: str):
    if name in _READERS:
        from genomelm.data import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUILTIN",
    "CODE_NAMES",
    "IGNORE_INDEX",
    "DataConfig",
    "DataError",
    "Vocabulary",
    "WindowDataset",
    "as_hf_dataset",
    "format_report",
    "parse_seq",
    "prepare",
    "read_manifest",
    "seq_label",
    "tokenizer_vocabulary",
]
