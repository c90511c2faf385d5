"""The training options over windows: dataset blends (`parse_blend`, `BlendedOrder`) and the crop warm-up
(`crop_length`); a window's labels and other strand are `genomelm.data.tokens`. Nothing here reads or writes
files except :func:`check_compatible`, which reads the manifests of the folders to be mixed or compared.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from genomelm.data.errors import DataError
from genomelm.data.prepare import MANIFEST, read_manifest
from genomelm.data.vocab import Vocabulary

CROP_MULTIPLE = 64  # crop lengths are multiples of this (the KDA chunk size)


def parse_blend(spec: str) -> list[tuple[str, float]]:
    """``"dirA:0.7,dirB:0.3"`` -> [("dirA", 0.7), ("dirB", 0.3)]; a folder without ``:weight`` weighs 1.

    Weights are normalised to sum to 1. ValueError (saying what is wrong and the expected form) for an empty
    item, a weight that is not a positive number, or a folder given twice.
    """
    example = (
        "give prepared folders separated by commas, each with an optional :weight, e.g. dirA:0.7,dirB:0.3"
    )
    items = [item.strip() for item in str(spec).split(",")]
    if not any(items) or not all(items):
        raise ValueError(f"data={spec!r}: an empty folder name; {example}")
    blend: list[tuple[str, float]] = []
    for item in items:
        folder, colon, weight_text = item.rpartition(":")
        if not colon:
            folder, weight = item, 1.0
        else:
            try:
                weight = float(weight_text)
            except ValueError:
                raise ValueError(
                    f"data={spec!r}: weight {weight_text!r} of {item!r} is not a number; "
                    f"{example} (a folder name cannot contain ':')"
                ) from None
            if not folder.strip():
                raise ValueError(f"data={spec!r}: {item!r} has a weight but no folder; {example}")
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"data={spec!r}: weight of {folder!r} must be a positive number, got {weight}")
        if any(folder.strip() == seen for seen, _ in blend):
            raise ValueError(f"data={spec!r}: {folder.strip()!r} is given twice; give each folder once")
        blend.append((folder.strip(), weight))
    total = sum(weight for _, weight in blend)
    return [(folder, weight / total) for folder, weight in blend]


def check_compatible(folders: Sequence[str | Path]) -> list[dict]:
    """Manifests of prepared folders that are mixed in training or compared in evaluation.

    DataError naming both folders when their SEQ (window length) or vocabulary (token ids) differ, and
    naming the folder when it is not a complete prepared dataset.
    """
    if not folders:
        raise DataError("no prepared folders given")
    manifests = []
    for folder in folders:
        manifest = read_manifest(folder)
        if manifest is None:
            raise DataError(
                f"{folder}: no {MANIFEST}, so not a complete prepared dataset; run "
                "`genomelm data` for it, or fix the folder name"
            )
        manifests.append(manifest)
    first, first_folder = manifests[0], folders[0]
    first_vocab = Vocabulary.from_json(first["vocab"])
    for folder, manifest in zip(folders[1:], manifests[1:]):
        if manifest["seq_len"] != first["seq_len"]:
            raise DataError(
                f"{first_folder} has windows of {first['seq_len']:,} tokens but {folder} has "
                f"{manifest['seq_len']:,}; prepare both with the same seq="
            )
        vocab = Vocabulary.from_json(manifest["vocab"])
        if (vocab.code_to_id, vocab.vocab_size) != (first_vocab.code_to_id, first_vocab.vocab_size):
            raise DataError(
                f"{first_folder} and {folder} use different vocabularies (token ids of pad A C G T N: "
                f"{list(first_vocab.code_to_id)} vs {list(vocab.code_to_id)}); prepare both with the same "
                "tokenizer= (or both without)"
            )
    return manifests


@dataclass
class BlendedOrder:
    """Deterministic, resumable order of (dataset index, window index) draws from weighted datasets.

    Draw k goes to the dataset furthest behind its share, i.e. with the largest
    ``weights[i] * (k + 1) - drawn[i]`` (ties: the lower index), as Megatron's ``BlendedDataset`` does; after
    any number of draws k each dataset has had within one draw of ``weights[i] * k``. Within dataset i the
    windows come in a fresh permutation each epoch e, ``torch.randperm`` seeded with ``seed + e + i * 2**32``
    (for dataset 0 the same order as the trainer's single-dataset ``DataOrder``). :meth:`state` is a small
    dict of ints; :meth:`load` of it continues exactly where the saved order stopped.
    """

    window_counts: list[int]
    weights: list[float]
    seed: int
    drawn: list[int] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    cursors: list[int] = field(default_factory=list)
    _orders: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        n = len(self.window_counts)
        if n == 0 or len(self.weights) != n:
            raise ValueError(f"need one weight per dataset: {n} window counts, {len(self.weights)} weights")
        if any(count <= 0 for count in self.window_counts):
            raise ValueError(f"every dataset needs windows, got counts {self.window_counts}")
        if any(not math.isfinite(w) or w <= 0 for w in self.weights):
            raise ValueError(f"weights must be positive numbers, got {self.weights}")
        total = sum(self.weights)
        self.weights = [w / total for w in self.weights]
        self.drawn = self.drawn or [0] * n
        self.epochs = self.epochs or [0] * n
        self.cursors = self.cursors or [0] * n

    def _order(self, dataset: int) -> list[int]:
        if dataset not in self._orders:
            generator = torch.Generator().manual_seed(self.seed + self.epochs[dataset] + (dataset << 32))
            self._orders[dataset] = torch.randperm(self.window_counts[dataset], generator=generator).tolist()
        return self._orders[dataset]

    def next(self) -> tuple[int, int]:
        """The next (dataset index, window index)."""
        k = sum(self.drawn)
        lag = [weight * (k + 1) - drawn for weight, drawn in zip(self.weights, self.drawn)]
        dataset = max(range(len(lag)), key=lambda i: (lag[i], -i))
        if self.cursors[dataset] >= self.window_counts[dataset]:
            self.epochs[dataset] += 1
            self.cursors[dataset] = 0
            self._orders.pop(dataset, None)
        window = self._order(dataset)[self.cursors[dataset]]
        self.cursors[dataset] += 1
        self.drawn[dataset] += 1
        return dataset, window

    def state(self) -> dict[str, list[int]]:
        return {"drawn": list(self.drawn), "epochs": list(self.epochs), "cursors": list(self.cursors)}

    def load(self, state: dict[str, list[int]]) -> None:
        if (
            not len(state["drawn"])
            == len(state["epochs"])
            == len(state["cursors"])
            == len(self.window_counts)
        ):
            raise ValueError(
                f"saved order is for {len(state['drawn'])} datasets, this blend has "
                f"{len(self.window_counts)}; resume with the same data="
            )
        self.drawn, self.epochs, self.cursors = (
            list(state["drawn"]),
            list(state["epochs"]),
            list(state["cursors"]),
        )
        self._orders.clear()


def crop_length(step: int, warmup_steps: int, seq: int, minimum: int) -> int:
    """Tokens per training window at optimizer ``step`` (0-based) during sequence-length warm-up.

    Doubling, as HyenaDNA's warm-up: the crop starts at ``minimum`` rounded up to a multiple of 64 and doubles
    in K equal stages, K the number of doublings that stay below ``seq``; stage k (steps
    [k W / K, (k + 1) W / K), W = ``warmup_steps``) trains on ``minimum * 2**k`` tokens, and from step W on
    every window is the full ``seq``. With W <= 0 or ``minimum >= seq`` it is always ``seq``.
    """
    if step < 0 or seq < 1 or minimum < 1:
        raise ValueError(f"crop_length needs step >= 0, seq >= 1, minimum >= 1; got {step}, {seq}, {minimum}")
    start = -(-minimum // CROP_MULTIPLE) * CROP_MULTIPLE
    if warmup_steps <= 0 or step >= warmup_steps or start >= seq:
        return seq
    stages = (-(-seq // start) - 1).bit_length()  # lengths start * 2**k < seq for k < stages
    stage = step * stages // warmup_steps
    return min(seq, start << stage)
