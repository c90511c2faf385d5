"""How a window of S tokens is split over the cp ranks of a context-parallel group.

The window is cut into equal segments. "zigzag" (the default): 2*cp segments, rank r holds segments r and
2cp-1-r, so every rank holds one early and one late piece and the DSA indexer's work, which grows with
position, is the same on every rank. "contiguous": cp segments, rank r holds segment r. A rank's local tokens
are its segments concatenated in that order; `ContextLayout.positions` gives their global positions.

Labels are the next token of the whole window, so they are made (or taken from the data stage) before
sharding: shifting after sharding would pair the last token of a segment with the first token of the rank's
next segment.

A window must split into segments of whole KDA chunks and whole k-pools (so no chunk or pool straddles two
ranks); other lengths are refused with the lengths that would work (no padding: the data stage chooses SEQ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from genomelm.data.vocab import IGNORE_INDEX

ZIGZAG = "zigzag"
CONTIGUOUS = "contiguous"
LAYOUTS = (ZIGZAG, CONTIGUOUS)


class LayoutError(ValueError):
    """A window that cannot be split over the group as asked."""


def segments_per_rank(kind: str) -> int:
    """2 for zigzag, 1 for contiguous."""
    if kind not in LAYOUTS:
        raise LayoutError(f"context-parallel layout must be one of {LAYOUTS}, got {kind!r}")
    return 2 if kind == ZIGZAG else 1


def segments_of(rank: int, cp: int, kind: str) -> tuple[int, ...]:
    """Global indices of the segments rank `rank` holds, in local order."""
    if not 0 <= rank < cp:
        raise LayoutError(f"rank {rank} is outside a context-parallel group of {cp}")
    return (rank, 2 * cp - 1 - rank) if segments_per_rank(kind) == 2 else (rank,)


class LocalWindow(NamedTuple):
    """One rank's part of a window: input_ids and labels [B, S/cp] (long), positions [S/cp] (long, global)."""

    input_ids: Tensor
    labels: Tensor
    positions: Tensor


def next_token_labels(input_ids: Tensor) -> Tensor:
    """labels[t] = input_ids[t+1] over the whole window, IGNORE_INDEX at the last position: [B, S] long."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


@dataclass(frozen=True)
class ContextLayout:
    """The split of a window of `seq_len` tokens over `cp` ranks, seen from rank `rank`.

    `kda_chunk` and `kpool`: every segment must hold whole KDA chunks and whole indexer k-pools.
    """

    seq_len: int
    cp: int
    rank: int
    kind: str = ZIGZAG
    kda_chunk: int = 64
    kpool: int = 4

    def __post_init__(self) -> None:
        if self.cp < 1:
            raise LayoutError(f"context-parallel size must be >= 1, got {self.cp}")
        segments_of(self.rank, self.cp, self.kind)  # checks kind and rank
        if self.seq_len <= 0:
            raise LayoutError(f"a window must hold tokens, got seq_len={self.seq_len}")
        problems = [
            f"{name} ({size})"
            for name, size in (("the KDA chunk", self.kda_chunk), ("the indexer k-pool", self.kpool))
            if self.seq_len % (self.num_segments * size)
        ]
        if problems:
            unit = self.num_segments * math.lcm(self.kda_chunk, self.kpool)
            below = self.seq_len // unit * unit
            nearest = " or ".join(str(n) for n in (below, below + unit) if n > 0)
            raise LayoutError(
                f"a window of {self.seq_len} tokens does not split into {self.num_segments} {self.kind} "
                f"segments (cp={self.cp}) of whole multiples of {' and of '.join(problems)}: the window "
                f"must be a multiple of {unit} tokens (nearest: {nearest})"
            )

    @property
    def num_segments(self) -> int:
        """Segments in the whole window: 2*cp (zigzag) or cp (contiguous)."""
        return self.cp * segments_per_rank(self.kind)

    @property
    def segment_len(self) -> int:
        return self.seq_len // self.num_segments

    @property
    def local_len(self) -> int:
        """Tokens on each rank."""
        return self.seq_len // self.cp

    @property
    def segments(self) -> tuple[int, ...]:
        """Global indices of this rank's segments, in local order."""
        return segments_of(self.rank, self.cp, self.kind)

    def segment_of_slot(self) -> list[int]:
        """Global segment index of each slot of a rank-order gather (rank 0's segments first)."""
        return [s for r in range(self.cp) for s in segments_of(r, self.cp, self.kind)]

    def slot_of_segment(self) -> list[int]:
        """Inverse of `segment_of_slot`: where segment j lies in a rank-order gather."""
        slots = self.segment_of_slot()
        return sorted(range(len(slots)), key=slots.__getitem__)

    def positions(self, rank: int | None = None) -> Tensor:
        """Global positions of a rank's local tokens (default: this rank's): [local_len] long."""
        rank = self.rank if rank is None else rank
        return torch.cat(
            [
                torch.arange(s * self.segment_len, (s + 1) * self.segment_len)
                for s in segments_of(rank, self.cp, self.kind)
            ]
        )

    def spans(self) -> tuple[tuple[int, int], ...]:
        """This rank's tokens as runs of consecutive global positions: ((first position, length), ...) in
        local order (the indexer's `Spans`)."""
        return tuple((s * self.segment_len, self.segment_len) for s in self.segments)

    def pooled(self, pool: int) -> ContextLayout:
        """The same split over the window's pools of `pool` tokens (every segment holds whole pools)."""
        if self.segment_len % pool:
            raise LayoutError(f"segments of {self.segment_len} tokens do not hold whole {pool}-token pools")
        return ContextLayout(self.seq_len // pool, self.cp, self.rank, self.kind, kda_chunk=1, kpool=1)

    def shard(self, tensor: Tensor, dim: int = 1) -> Tensor:
        """This rank's part of a whole-window tensor [..., S, ...] (S at `dim`) -> [..., S/cp, ...]."""
        self._check_len(tensor, dim, self.seq_len, "a whole window")
        parts = [tensor.narrow(dim, s * self.segment_len, self.segment_len) for s in self.segments]
        return torch.cat(parts, dim=dim)

    def restore(self, gathered: Tensor, dim: int = 1) -> Tensor:
        """Global order from every rank's part concatenated in rank order at `dim` (e.g. an all-gather):
        [..., S, ...] -> [..., S, ...]. Segment slices and one concatenation: no index tensor (on a GPU, no
        host copy)."""
        self._check_len(gathered, dim, self.seq_len, "all ranks' parts")
        return self._reorder(gathered, dim, self.slot_of_segment())

    def rank_order(self, tensor: Tensor, dim: int = 1) -> Tensor:
        """Inverse of `restore`: a whole-window tensor in global order -> every rank's part concatenated in
        rank order at `dim`: [..., S, ...] -> [..., S, ...]."""
        self._check_len(tensor, dim, self.seq_len, "a whole window")
        return self._reorder(tensor, dim, self.segment_of_slot())

    def _reorder(self, tensor: Tensor, dim: int, pieces: list[int]) -> Tensor:
        """The segment-length pieces of `tensor` at `dim`, in the order given."""
        n = self.segment_len
        return torch.cat([tensor.narrow(dim, i * n, n) for i in pieces], dim=dim)

    def shard_window(self, input_ids: Tensor, labels: Tensor | None = None) -> LocalWindow:
        """This rank's tokens, labels and global positions from a whole window input_ids [B, S].

        `labels` [B, S]: the data stage's next-token labels (`Window.labels`); None: made here from
        input_ids by `next_token_labels`. Either way they are aligned over the whole window before it is cut.
        """
        if labels is None:
            labels = next_token_labels(input_ids)
        elif labels.shape != input_ids.shape:
            raise LayoutError(
                f"labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} differ in shape"
            )
        return LocalWindow(self.shard(input_ids), self.shard(labels), self.positions().to(input_ids.device))

    def _check_len(self, tensor: Tensor, dim: int, expected: int, what: str) -> None:
        if tensor.shape[dim] != expected:
            raise LayoutError(
                f"expected {what} of {expected} tokens at dim {dim}, got shape {tuple(tensor.shape)}"
            )
