"""Windows: what `genomelm data` cuts from a genome (`CutWindow`, `WindowCutter`) and what every reader of a
prepared folder gets (`Window`: the training feed, evaluation and the probe).

This module needs numpy only, as `genomelm data` does; `Window`'s derived tensors import torch when
first read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

from genomelm.data.vocab import Vocabulary

_EMPTY = np.empty(0, dtype=np.uint8)


@dataclass(frozen=True, eq=False)
class Window:
    """One window of a prepared folder, as read for training, evaluation and the copy probe.

    source: the prepared folder's name; index: the window's number in its split; record, start, end: the
    bases [start, end) (0-based) of the record it holds (end - start < SEQ for a short record, right-padded);
    strand: "+" as stored, "-" read from the other strand (reverse-complemented); ids: LongTensor[SEQ] token
    ids of `vocab` in reading order; softmask: BoolTensor[SEQ], True where the base is soft-masked (a repeat).

    The model reads the positions [offset, offset + length) (all SEQ unless cropped). Labels, the predicted
    bases' soft-mask and the loss weights are derived, for those positions, from the whole window: a crop
    keeps its last label, the real base after it.
    """

    source: str
    index: int
    record: str
    start: int
    end: int
    ids: Tensor
    softmask: Tensor
    vocab: Vocabulary
    strand: str = "+"
    offset: int = 0
    length: int | None = None

    @property
    def span(self) -> slice:
        """The positions the model reads."""
        return slice(self.offset, None if self.length is None else self.offset + self.length)

    @property
    def reverse(self) -> bool:
        """Whether the window is read from the other strand."""
        return self.strand == "-"

    @property
    def input_ids(self) -> Tensor:
        """LongTensor[L]: the token ids the model reads."""
        return self.ids[self.span]

    @property
    def labels(self) -> Tensor:
        """LongTensor[L]: the next token of each position read; -100 where it is N, padding or past the
        end."""
        from genomelm.data.tokens import labels_for  # torch: only when a window's labels are read

        return labels_for(self.ids, self.vocab)[self.span]

    @property
    def predicted_softmask(self) -> Tensor:
        """BoolTensor[L]: whether the base each position predicts (the next one) is soft-masked."""
        from genomelm.data.tokens import predicted_softmask

        return predicted_softmask(self.softmask)[self.span]

    def loss_weights(self, softmask_weight: float = 1.0) -> Tensor:
        """FloatTensor[L]: the loss weight of each position, `softmask_weight` where the predicted base is
        soft-masked, 1 elsewhere, 0 where the label is ignored."""
        import torch

        from genomelm.data.vocab import IGNORE_INDEX

        weights = torch.where(self.predicted_softmask, softmask_weight, 1.0).float()
        return weights.masked_fill(self.labels == IGNORE_INDEX, 0.0)

    def reverse_complement(self) -> Window:
        """The same window read from the other strand (see `genomelm.data.augment.reverse_complement`)."""
        from genomelm.data.tokens import reverse_complement

        ids, softmask = reverse_complement(self.ids, self.softmask, self.vocab)
        return dataclasses.replace(self, ids=ids, softmask=softmask, strand="+" if self.reverse else "-")

    def cropped(self, offset: int, length: int | None = None) -> Window:
        """The positions [offset, offset + length) of the whole window (to its end without `length`)."""
        return dataclasses.replace(self, offset=offset, length=length)

    def with_ids(self, ids: Tensor) -> Window:
        """The window with other token ids (same length), e.g. with a planted copy; labels follow them."""
        if ids.shape != self.ids.shape:
            raise ValueError(f"ids of shape {tuple(ids.shape)} for a window of {tuple(self.ids.shape)}")
        return dataclasses.replace(self, ids=ids)


@dataclass
class CutWindow:
    """What the cutter gives `genomelm data` to store: ``seq`` codes and soft-mask flags (uint8 [seq]) of
    bases [start, start + length) of a record (length < seq: right-padded with code 0)."""

    start: int
    codes: np.ndarray
    mask: np.ndarray
    length: int


class WindowCutter:
    """Windows of ``seq`` bases starting at ``start``, ``start + stride``, ... of one region.

    Feed consecutive pieces of the region with :meth:`feed`; windows are yielded as soon as they are
    whole. Holds at most ``seq`` bases besides the piece, never the region. Windows inside a piece are views
    of it; only a window that spans pieces is copied (the carry plus the head of the next piece), so a
    base is copied at most once when ``stride >= seq``.
    """

    def __init__(self, start: int, seq: int, stride: int) -> None:
        self.seq, self.stride = seq, stride
        self.next_start = start  # genomic position of carry[0] (or of the next window after a skip)
        self.skip = 0  # bases still to skip before the next window (stride > seq)
        self.codes, self.mask = _EMPTY, _EMPTY  # carry: bases from next_start on, fewer than seq
        self.windows = 0
        self.last_end = start

    def _emit(self, codes: np.ndarray, mask: np.ndarray) -> CutWindow:
        self.windows += 1
        self.last_end = self.next_start + self.seq
        return CutWindow(self.next_start, codes, mask, self.seq)

    def _skip(self, codes: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        drop = min(self.skip, len(codes))
        self.skip -= drop
        self.next_start += drop
        return codes[drop:], mask[drop:]

    def feed(self, codes: np.ndarray, mask: np.ndarray) -> Iterator[CutWindow]:
        """Windows completed by this piece; each is valid until the next call to ``feed``."""
        seq, stride = self.seq, self.stride
        if self.skip:
            codes, mask = self._skip(codes, mask)
        while len(self.codes):  # finish the window begun in earlier pieces
            need = seq - len(self.codes)
            if len(codes) < need:
                self.codes, self.mask = np.concatenate((self.codes, codes)), np.concatenate((self.mask, mask))
                return
            window_codes = np.concatenate((self.codes, codes[:need]))
            window_mask = np.concatenate((self.mask, mask[:need]))
            yield self._emit(window_codes, window_mask)
            codes, mask = codes[need:], mask[need:]
            if stride < seq:  # overlapping windows: the next one starts inside this one
                self.codes, self.mask = window_codes[stride:], window_mask[stride:]
                self.next_start += stride
            else:
                self.codes, self.mask = _EMPTY, _EMPTY
                self.next_start += seq
                self.skip = stride - seq
                codes, mask = self._skip(codes, mask)
                if self.skip:
                    return
        pos = 0  # no carry: codes[0] is at next_start
        while len(codes) - pos >= seq:
            window = self._emit(codes[pos : pos + seq], mask[pos : pos + seq])
            yield window
            pos += stride
            self.next_start += stride
        if pos > len(codes):
            self.skip = pos - len(codes)
            self.next_start -= self.skip
        else:  # copied, so the carry does not keep the whole piece alive
            self.codes, self.mask = codes[pos:].copy(), mask[pos:].copy()

    def pad_short(self) -> CutWindow:
        """The whole (shorter than ``seq``) region as one window, right-padded with code 0."""
        length = len(self.codes)
        codes = np.zeros(self.seq, dtype=np.uint8)
        mask = np.zeros(self.seq, dtype=np.uint8)
        codes[:length], mask[:length] = self.codes, self.mask
        self.windows += 1
        self.last_end = self.next_start + length
        return CutWindow(self.next_start, codes, mask, length)
