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

    def _emit(self, codes: np.ndarray, mask: np.ndarray) -> Window:
        self.windows += 1
        self.last_end = self.next_start + self.seq
        return Window(self.next_start, codes, mask, self.seq)

    def _skip(self, codes: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        drop = min(self.skip, len(codes))
        self.skip -= drop
        self.next_start += drop
        return codes[drop:], mask[drop:]

    def feed(self, codes: np.ndarray, mask: np.ndarray) -> Iterator[Window]:
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

    def pad_short(self) -> Window:
        """The whole (shorter than ``seq``) region as one window, right-padded with code 0."""
        length = len(self.codes)
        codes = np.zeros(self.seq, dtype=np.uint8)
        mask = np.zeros(self.seq, dtype=np.uint8)
        codes[:length], mask[:length] = self.codes, self.mask
        self.windows += 1
        self.last_end = self.next_start + length
        return Window(self.next_start, codes, mask, length)
