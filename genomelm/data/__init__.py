"""Data stage: genomes -> uint8 base-code windows on disk -> torch / Hugging Face datasets.

``prepare(DataConfig(...), command)`` builds a folder; ``WindowDataset(folder, split)`` reads it.
"""

from genomelm.data.config import DataConfig
from genomelm.data.dataset import IGNORE_INDEX, WindowDataset, as_hf_dataset
from genomelm.data.errors import DataError
from genomelm.data.prepare import format_report, prepare, read_manifest
from genomelm.data.regions import parse_seq, seq_label
from genomelm.data.vocab import BUILTIN, CODE_NAMES, Vocabulary, tokenizer_vocabulary

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
