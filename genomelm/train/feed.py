"""What the trainer reads each micro-batch: one window from one of the training datasets, with the training
options applied (reverse-complement augmentation, sequence-length warm-up crops, soft-mask loss weights).

Every random choice is a function of (seed, step, micro-batch), never of the global RNG state, so a resumed run
sees exactly the windows, strands and crops the uninterrupted run would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from genomelm.data import WindowDataset
from genomelm.data.augment import (
    CROP_MULTIPLE,
    BlendedOrder,
    check_compatible,
    crop_length,
    labels_for,
    reverse_complement,
)
from genomelm.data.vocab import IGNORE_INDEX, Vocabulary
from genomelm.train.config import TrainConfig


@dataclass
class Window:
    """One micro-batch row: input_ids, labels [L] long, weights [L] fp32 (loss weight per position, 0 where the
    label is ignored); source: the prepared folder it came from; index: its window number there."""

    input_ids: Tensor
    labels: Tensor
    weights: Tensor
    source: str
    index: int
    reverse: bool
    offset: int


class TrainingData:
    """The training windows of one prepared folder or a weighted blend of several (`data=dirA:0.7,dirB:0.3`)."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        blend = config.data_blend
        folders = [folder for folder, _ in blend]
        if len(folders) > 1:
            check_compatible(folders)
        self.datasets = [WindowDataset(folder, "train") for folder in folders]
        for folder, dataset in zip(folders, self.datasets, strict=True):
            if dataset.seq_len != config.seq_len:
                raise ValueError(
                    f"{folder} holds {dataset.seq_len}-token windows but the run asks for seq={config.seq}; "
                    f"prepare matching data (make data SEQ={config.seq}) or set data=<folder>"
                )
            if len(dataset) == 0:
                raise ValueError(f"{folder} has no training windows")
        self.names = [Path(folder).name for folder in folders]
        self.order = BlendedOrder([len(d) for d in self.datasets], [w for _, w in blend], config.seed)
        if not 0.0 <= config.rc_aug <= 1.0:
            raise ValueError(f"rc_aug={config.rc_aug}: give a probability between 0 and 1")
        if config.softmask_weight < 0:
            raise ValueError(f"softmask_weight={config.softmask_weight}: give a weight >= 0")

    @property
    def vocab(self) -> Vocabulary:
        return self.datasets[0].vocab

    @property
    def manifest(self) -> dict:
        """The first folder's manifest, with the blend's fingerprints joined (the run's data identity)."""
        first = dict(self.datasets[0].manifest)
        first["fingerprint"] = "+".join(str(d.manifest.get("fingerprint")) for d in self.datasets)
        return first

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def next(self, step: int, micro: int) -> Window:
        """The window for micro-batch `micro` of optimizer step `step` (0-based)."""
        config = self.config
        source, index = self.order.next()
        dataset = self.datasets[source]
        row = dataset[index]
        ids, softmask, labels = row["input_ids"], row["softmask"], row["labels"]
        draw = torch.rand(2, generator=torch.Generator().manual_seed(
            config.seed * 1_000_003 + step * 1_009 + micro))  # fmt: skip
        reverse = bool(draw[0] < config.rc_aug)
        if reverse:
            ids, softmask = reverse_complement(ids, softmask, dataset.vocab)
            labels = labels_for(ids, dataset.vocab)
        # the soft-mask of the base each position predicts (the next one); the last position predicts nothing
        predicted = torch.zeros_like(softmask)
        predicted[:-1] = softmask[1:]
        length = crop_length(step, config.seq_warmup_steps, config.seq_len, config.seq_warmup_start)
        offset = 0
        if length < config.seq_len:  # a crop keeps its last label: the real next base after it
            offset = int(draw[1] * ((config.seq_len - length) // CROP_MULTIPLE + 1)) * CROP_MULTIPLE
            ids, labels, predicted = (t[offset : offset + length] for t in (ids, labels, predicted))
        weights = torch.where(predicted, config.softmask_weight, 1.0).float()
        weights = weights.masked_fill(labels == IGNORE_INDEX, 0.0)
        return Window(ids, labels, weights, self.names[source], index, reverse, offset)

    def state(self) -> dict:
        return self.order.state()

    def load(self, state: dict) -> None:
        self.order.load(state)
