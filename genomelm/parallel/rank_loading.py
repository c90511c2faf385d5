"""Fill a sharded model with only this rank's part of a Hugging Face checkpoint folder.

`load_rank_shard(model, folder)` walks the model's parameters and persistent buffers one at a time:
- an FSDP2 / DTensor parameter (global shape, `Shard` placements on its mesh) gets the block of rows (and
  columns, for 2-D shardings) this rank holds;
- the routed-expert weights of an `Experts` module that holds a slice of the experts (expert parallelism:
  its `ExpertShard.owned_experts`, the global ids of the experts whose weights live here) get those experts,
  and of them, when the slice is also a DTensor, only this rank's;
- anything else is copied whole.
Expert tensors are read expert by expert (`CheckpointReader.read(..., experts=...)`): only this rank's experts
are ever read. Other tensors are read whole, one at a time: peak memory is one full non-expert tensor.
Official or internal names, FP8 or not, whatever `CheckpointReader` reads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from genomelm.model.checkpoint import CheckpointError, CheckpointReader
from genomelm.model.moe import Experts

from .expert import expert_shard

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # [E, ...] tensors of `Experts`, one row per expert


def _local_block(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) of this rank's block of `tensor` in its global shape (all of it unless a DTensor)."""
    if isinstance(tensor, DTensor):
        return compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(tensor.shape), (0,) * tensor.dim()


def _slice(
    tensor: torch.Tensor, shape: tuple[int, ...], offset: tuple[int, ...], first_dim: int = 0
) -> torch.Tensor:
    """The block [offset, offset + shape) of `tensor` in dims `first_dim`.. (a view)."""
    for dim in range(first_dim, tensor.dim()):
        tensor = tensor.narrow(dim, offset[dim], shape[dim])
    return tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The storage this rank holds of `tensor` (a DTensor's local shard, or the tensor itself)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def load_rank_shard(model: nn.Module, folder: str | Path) -> None:
    """Copy this rank's part of every parameter and persistent buffer of `model` from the checkpoint `folder`.

    `model`'s tensors must have storage (build on the meta device, shard, then `to_empty`); its names are the
    internal ones (`GlmForCausalLM.state_dict()`). Values are cast to each tensor's dtype as they are read.
    """
    reader = CheckpointReader(folder)
    for prefix, module in model.named_modules():
        tensors = dict(module.named_parameters(recurse=False)) | {
            name: buffer
            for name, buffer in module.named_buffers(recurse=False)
            if name not in module._non_persistent_buffers_set
        }
        for leaf, tensor in tensors.items():
            name = f"{prefix}.{leaf}" if prefix else leaf
            if tensor.is_meta:
                raise CheckpointError(
                    f"{name} of the model has no storage (meta device); call model.to_empty(device=...) "
                    "after sharding and before load_rank_shard"
                )
            shape, offset = _local_block(tensor)
            if 0 in shape:  # an uneven sharding left this rank no rows
                continue
            experts = None
            if isinstance(module, Experts) and leaf in EXPERT_WEIGHTS:
                shard = expert_shard(module)
                held = list(shard.owned_experts if shard is not None else range(module.num_experts))
                if tensor.shape[0] != len(held):
                    raise CheckpointError(
                        f"{name} holds {tensor.shape[0]} experts but its module's expert shard lists "
                        f"{len(held)}"
                    )
                experts = held[offset[0] : offset[0] + shape[0]]  # rows of the DTensor are experts
            value = reader.read([name], experts=experts, dtypes={name: tensor.dtype})[name]
            first_dim = 0 if experts is None else 1
            if value.shape[first_dim:] != tensor.shape[first_dim:]:
                raise CheckpointError(
                    f"{reader.where(name)} has shape {tuple(value.shape)} but the model's {name} is "
                    f"{tuple(tensor.shape)}; the model was built from another config than {folder}"
                )
            value = _slice(value, shape, offset, first_dim)
            local = _local(tensor)
            assert tuple(value.shape) == tuple(local.shape), (
                f"{name}: block {tuple(value.shape)} != local {tuple(local.shape)}"
            )
            local.copy_(value)
