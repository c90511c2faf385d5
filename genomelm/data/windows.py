"""Cut a stream of base codes into fixed-length windows at a fixed stride."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

_EMPTY = np.empty(0, dtype=np.uint8)


@dataclass
class Window:
    """``seq`` codes and soft-mask flags (uint8 [seq]) of bases [start, start + length) of a record."""

    start: int
    codes: np.ndarray
    mask: np.ndarray
    length: int


class WindowCutter:
    """Windows of ``seq`` bases starting at ``start``, ``start + stride``, ... of one region.

    Feed consecutive pieces of the region with :meth:`feed`; windows are yielded as soon as they are
    whole. Holds at most ``seq`` + one piece of bases, never the region.
    """

    def __init__(self, start: int, seq: int, stride: int) -> None:
        self.seq, self.stride = seq, stride
        self.next_start = start  # genomic position of pending[0] (or of the next window after a skip)
        self.skip = 0  # bases still to skip before the next window (stride > seq)
        self.codes, self.mask = _EMPTY, _EMPTY
        self.windows = 0
        self.last_end = start

    def feed(self, codes: np.ndarray, mask: np.ndarray) -> Iterator[Window]:
        """Windows completed by this piece; each is valid until the next call to ``feed``."""
        if self.skip:
            drop = min(self.skip, len(codes))
            codes, mask, self.skip = codes[drop:], mask[drop:], self.skip - drop
            self.next_start += drop
        if len(self.codes):
            codes, mask = np.concatenate((self.codes, codes)), np.concatenate((self.mask, mask))
        while len(codes) >= self.seq:
            yield Window(self.next_start, codes[: self.seq], mask[: self.seq], self.seq)
            self.windows += 1
            self.last_end = self.next_start + self.seq
            advance = min(self.stride, len(codes))
            codes, mask = codes[advance:], mask[advance:]
            self.skip = self.stride - advance
            self.next_start += advance
        self.codes, self.mask = codes, mask

    def pad_short(self) -> Window:
        """The whole (shorter than ``seq``) region as one window, right-padded with code 0."""
        length = len(self.codes)
        codes = np.zeros(self.seq, dtype=np.uint8)
        mask = np.zeros(self.seq, dtype=np.uint8)
        codes[:length], mask[:length] = self.codes, self.mask
        self.windows += 1
        self.last_end = self.next_start + length
        return Window(self.next_start, codes, mask, length)
