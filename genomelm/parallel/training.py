"""What a context-parallel training step moves between ranks, beside the layers' own exchanges.

Every rank of a context-parallel group reads the same window (the same data order), keeps its shard of the
tokens, labels and loss weights (`ContextRun.shard`), and runs the model on them. The loss is the global
token-weighted mean: each rank divides its weighted sum by the weight summed over the group
(`ContextRun.global_sum`), so the ranks' losses add up to the window's loss and no term is scaled by the
group size. After the backward pass the parameter gradients (each rank's share) are summed over the group in
one packed all-reduce (`ContextRun.sum_gradients`), so every rank applies the same update and the replicas stay
equal; expert token counts are summed the same way before the expert-bias update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .layout import ZIGZAG, ContextLayout


@dataclass(frozen=True)
class ContextRun:
    """This process's place in the context-parallel group (the default process group)."""

    cp: int
    rank: int
    kind: str = ZIGZAG

    @classmethod
    def from_environment(cls, kind: str = ZIGZAG) -> ContextRun | None:
        """The group set up by `genomelm.parallel.launch`, or None in a single process."""
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        return cls(dist.get_world_size(), dist.get_rank(), kind)

    @property
    def group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    @property
    def is_output_rank(self) -> bool:
        return self.rank == 0

    def layout(self, seq_len: int, kda_chunk: int, kpool: int) -> ContextLayout:
        return ContextLayout(seq_len, self.cp, self.rank, self.kind, kda_chunk=kda_chunk, kpool=kpool)

    def shard(self, layout: ContextLayout, *rows: Tensor) -> list[Tensor]:
        """This rank's tokens of each [B, S, ...] row tensor (labels already made over the whole window)."""
        return [layout.shard(row, dim=1) for row in rows]

    def global_sum(self, value: Tensor) -> Tensor:
        """value summed over the group (no graph), the same on every rank."""
        total = value.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total

    def sum_gradients(self, model: nn.Module) -> None:
        """Sum every parameter's gradient over the group, in one packed all-reduce per dtype."""
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for param in model.parameters():
            if param.grad is not None:
                by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def sum_counts(self, counts: dict[int, Tensor]) -> dict[int, Tensor]:
        """Per-layer expert token counts summed over the group (one packed all-reduce)."""
        if not counts:
            return counts
        layers = sorted(counts)
        flat = torch.cat([counts[layer].reshape(-1) for layer in layers]).to(torch.float64)
        dist.all_reduce(flat, group=self.group)
        return dict(zip(layers, flat.split([counts[layer].numel() for layer in layers]), strict=True))


class ContextParallelScorer(nn.Module):
    """A model under context parallelism seen as one that scores whole windows, for evaluation.

    `loss(input_ids [B, S], labels [B, S], reduction="none")` shards the window, runs this rank's part and
    all-gathers the per-token losses back into window order: [B, S] fp32, the same on every rank.
    """

    def __init__(self, model: nn.Module, context: ContextRun) -> None:
        super().__init__()
        self.model = model
        self.context = context

    def loss(self, input_ids: Tensor, labels: Tensor, reduction: str = "none") -> Tensor:
        if reduction != "none":
            raise ValueError("ContextParallelScorer gives per-token losses only (reduction='none')")
        model = self.model
        layout = self.context.layout(input_ids.shape[1], model.options.kda_chunk_size, model.config.index_kpool)
        ids, local_labels = self.context.shard(layout, input_ids, labels)
        nll = model(ids, local_labels, reduction="none").contiguous()
        parts = [torch.empty_like(nll) for _ in range(self.context.cp)]
        dist.all_gather(parts, nll, group=self.context.group)
        return layout.restore(torch.cat(parts, dim=1), dim=1)
