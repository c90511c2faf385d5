"""A rank's rows of a routed-expert tensor as torch.distributed.checkpoint (DCP) sees them: the global
[E, ...] tensor in the canonical expert order, of which this rank holds one chunk per run of consecutive
experts among its rows.

Expert parallelism keeps on each rank the weights of the experts it owns (`ExpertShard.owned_experts`): a
block under the static layout, any set under a placement by load; FSDP may hold a block of those rows. A
checkpoint stores every expert tensor (weights and optimizer moments) at its global shape in expert order
whatever the placement, so a run resumes under another placement, ep or world size. Written here because
torch's own types cannot describe such rows: a DTensor's shard is one block of the global tensor, and a
ShardedTensor needs every rank's shards and devices up front. DCP's protocol for a tensor that describes its
own chunks (`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`, as DTensor implements
it) is what this class implements; each chunk is a view of the local rows, so DCP reads into them in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .expert import expert_shard


def expert_runs(experts: Sequence[int]) -> list[tuple[int, int, int]]:
    """The rows of `experts` (one global expert id per local row) as runs of consecutive experts:
    (first local row, first expert, rows) each."""
    runs: list[tuple[int, int, int]] = []
    for row, expert in enumerate(experts):
        if runs and runs[-1][1] + runs[-1][2] == expert and runs[-1][0] + runs[-1][2] == row:
            first_row, first_expert, rows = runs[-1]
            runs[-1] = (first_row, first_expert, rows + 1)
        else:
            runs.append((row, expert, 1))
    return runs


class ExpertRows(Tensor):
    """The global [E, ...] view of one rank's expert rows `local` [n, ...], row i holding expert
    `experts[i]`. Only DCP's planning and I/O use it (its shape, dtype and chunks); any other op raises."""

    local: Tensor
    runs: list[tuple[int, int, int]]

    @staticmethod
    def __new__(cls, local: Tensor, experts: Sequence[int], num_experts: int) -> ExpertRows:
        if len(experts) != local.shape[0]:
            raise ValueError(f"{local.shape[0]} rows but {len(experts)} experts named for them")
        size = torch.Size((num_experts, *local.shape[1:]))
        view = Tensor._make_wrapper_subclass(cls, size, dtype=local.dtype, device=local.device)
        view.local = local
        view.runs = expert_runs(experts)
        return view

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"{cls.__name__} describes a checkpoint's expert rows; it does not run {func}")

    def _chunk(self, first_expert: int, rows: int) -> ChunkStorageMetadata:
        offsets = torch.Size((first_expert,) + (0,) * (self.dim() - 1))
        return ChunkStorageMetadata(offsets=offsets, sizes=torch.Size((rows, *self.shape[1:])))

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape),
            )
            for chunk in (self._chunk(expert, rows) for _, expert, rows in self.runs)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk(expert, rows) for _, expert, rows in self.runs]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        for row, expert, rows in self.runs:
            if index.offset is not None and index.offset[0] == expert:
                return self.local.narrow(0, row, rows)
        raise ValueError(f"{index.fqn}: this rank holds no expert rows at {index.offset}")


def placed_experts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, list[int]]:
    """The experts held by each expert parameter of a module placed by load (`ExpertShard.slots`), by the
    parameter's position in `optimizer`: what a rank's optimizer state is laid out by beyond the mesh."""
    held = {}
    for module in model.modules():
        shard = expert_shard(module)
        if shard is not None and shard.slots is not None:
            for param in module.parameters(recurse=False):
                held[id(param)] = list(shard.owned_experts)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    return {i: held[id(param)] for i, param in enumerate(params) if id(param) in held}


def expert_rows(value: Tensor, experts: Sequence[int], num_experts: int) -> ExpertRows:
    """`value`: a module's expert tensor [rows, ...] (a DTensor where FSDP shards the rows, then this rank
    holds a block of them), row i holding expert `experts[i]` -> its rows on this rank as `ExpertRows`."""
    if isinstance(value, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        experts = experts[offset[0] : offset[0] + shape[0]]
        value = value.to_local()
    return ExpertRows(value, experts, num_experts)
