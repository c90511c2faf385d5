"""What the trainer reads each micro-batch: one window from one of the training datasets, with the training
options applied (reverse-complement augmentation, sequence-length warm-up crops, soft-mask loss weights).

Every random choice is a function of (seed, step, micro-batch), never of the global RNG state, so a resumed
run sees exactly the windows, strands and crops the uninterrupted run would have.
"""

from __future__ import annotations

import torch

from genomelm.data import WindowDataset
from genomelm.data.augment import CROP_MULTIPLE, BlendedOrder, check_compatible, crop_length
from genomelm.data.vocab import Vocabulary
from genomelm.data.windows import Window
from genomelm.run.config import TrainConfig


class TrainingData:
    """The training windows of one prepared folder or a weighted blend of several
    (`data=dirA:0.7,dirB:0.3`)."""

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
        self.order = BlendedOrder([len(d) for d in self.datasets], [w for _, w in blend], config.optim.seed)

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
        """The window for micro-batch `micro` of optimizer step `step` (0-based): perhaps read from the other
        strand, perhaps cropped (its loss weights: `window.loss_weights(softmask_weight)`)."""
        config, options = self.config, self.config.data_options
        source, index = self.order.next()
        window = self.datasets[source][index]
        draw = torch.rand(
            2, generator=torch.Generator().manual_seed(config.optim.seed * 1_000_003 + step * 1_009 + micro)
        )
        if draw[0] < options.rc_aug:
            window = window.reverse_complement()
        length = crop_length(step, options.seq_warmup_steps, config.seq_len, options.seq_warmup_start)
        if length < config.seq_len:  # a crop keeps its last label: the real next base after it
            offset = int(draw[1] * ((config.seq_len - length) // CROP_MULTIPLE + 1)) * CROP_MULTIPLE
            window = window.cropped(offset, length)
        return window

    def state(self) -> dict:
        return self.order.state()

    def load(self, state: dict) -> None:
        self.order.load(state)
