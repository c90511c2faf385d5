"""What a KDA layer's ranks exchange under context parallelism: one all-gather each for the conv halo and for
the segment summaries in forward, the matching reduce-scatter each in backward.

Both exchanges are autograd Functions whose output every rank consumes (the halos and incoming states of its
own segments, including the first segment's, which comes from the caller's state rather than from a
predecessor), so every rank's backward reaches them and runs its reduce-scatter: a rank that skipped one would
deadlock the group. All ranks exchange at once; no rank waits for the one before it.

Gradients of the caller's initial tail/state (replicated on every rank) are this rank's share: their sum over
the group is the full gradient, as for the model's parameters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from genomelm.model.kda import apply_state_map

from .layout import ContextLayout


def all_gather_slots(local: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[n, ...] from each rank -> [cp*n, ...] in rank order."""
    out = local.new_empty(dist.get_world_size(group) * local.shape[0], *local.shape[1:])
    dist.all_gather_single(out, local.contiguous(), group=group)
    return out


def reduce_scatter_slots(gathered: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[cp*n, ...] from each rank -> [n, ...]: this rank's slots summed over the group."""
    out = gathered.new_empty(gathered.shape[0] // dist.get_world_size(group), *gathered.shape[1:])
    dist.reduce_scatter_single(out, gathered.contiguous(), group=group)
    return out


class _ConvHaloExchange(torch.autograd.Function):
    """Forward: the K-1 conv-input rows before each local segment (the previous segment's last rows; the
    caller's tail before segment 0) and the window's last K-1 rows. Backward: each halo's gradient goes back
    to the rows it came from, summed over the ranks that read them."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, tails: Tensor, initial_tail: Tensor, layout: ContextLayout, group: dist.ProcessGroup
    ) -> tuple[Tensor, Tensor]:
        ctx.layout, ctx.group = layout, group
        in_order = all_gather_slots(tails, group).index_select(0, layout.slot_of_segment().to(tails.device))
        preceding = torch.cat([initial_tail.unsqueeze(0), in_order])  # [G+1]: rows before segment j at j
        local = torch.tensor(layout.segments, device=tails.device)
        return preceding.index_select(0, local), preceding[-1].clone()

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_halos: Tensor, grad_last: Tensor
    ) -> tuple[Tensor, Tensor, None, None]:
        layout: ContextLayout = ctx.layout
        grad_preceding = grad_halos.new_zeros(layout.num_segments + 1, *grad_halos.shape[1:])
        grad_preceding.index_add_(0, torch.tensor(layout.segments, device=grad_halos.device), grad_halos)
        grad_preceding[-1] += grad_last
        slot_order = grad_preceding[1:].index_select(0, layout.segment_of_slot().to(grad_halos.device))
        return reduce_scatter_slots(slot_order, ctx.group), grad_preceding[0], None, None


class _StateHandOver(torch.autograd.Function):
    """Forward: gather every segment's summary [M | S_ext], fold them in global order from the caller's state
    (S_0 = initial, S_{j+1} = M_j S_j + S_ext_j) and return the states entering the local segments and the
    window's final state. Backward: the adjoint fold (with M transposed) gives each summary's gradient, which
    goes back to the rank that made it."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, summaries: Tensor, initial: Tensor, layout: ContextLayout, group: dist.ProcessGroup
    ) -> tuple[Tensor, Tensor]:
        ctx.layout, ctx.group = layout, group
        maps = all_gather_slots(summaries, group).index_select(
            0, layout.slot_of_segment().to(summaries.device)
        )
        states = [initial]
        for segment_map in maps:
            states.append(apply_state_map(segment_map, states[-1]))
        states_all = torch.stack(states)  # [G+1, B, H, Dk, Dv]
        ctx.save_for_backward(maps, states_all)
        local = torch.tensor(layout.segments, device=maps.device)
        return states_all.index_select(0, local), states[-1]

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_incoming: Tensor, grad_final: Tensor
    ) -> tuple[Tensor, Tensor, None, None]:
        layout: ContextLayout = ctx.layout
        maps, states = ctx.saved_tensors
        dk = maps.shape[-2]
        direct = grad_incoming.new_zeros(states.shape)  # gradient reaching S_j from outside the fold
        direct.index_add_(0, torch.tensor(layout.segments, device=direct.device), grad_incoming)
        direct[-1] += grad_final
        grad_maps = torch.empty_like(maps)
        lam = direct[-1]  # d loss / d S_{j+1}, walking back
        for j in reversed(range(layout.num_segments)):
            grad_maps[j, ..., :dk] = lam @ states[j].mT
            grad_maps[j, ..., dk:] = lam
            lam = maps[j, ..., :dk].mT @ lam + direct[j]
        slot_order = grad_maps.index_select(0, layout.segment_of_slot().to(maps.device))
        return reduce_scatter_slots(slot_order, ctx.group), lam, None, None


def exchange_conv_halos(
    tails: Tensor, initial_tail: Tensor, layout: ContextLayout, group: dist.ProcessGroup
) -> tuple[Tensor, Tensor]:
    """tails [n, B, K-1, C]: the last K-1 conv-input rows of each local segment; initial_tail [B, K-1, C]:
    the rows before the window (zeros for a fresh sequence). Returns the halos of the local segments
    [n, B, K-1, C] and the window's last K-1 rows [B, K-1, C] (the same on every rank). One all-gather of
    n*B*(K-1)*C elements per rank."""
    return _ConvHaloExchange.apply(tails, initial_tail.to(tails.dtype), layout, group)


def hand_over_states(
    summaries: Tensor, initial: Tensor, layout: ContextLayout, group: dist.ProcessGroup
) -> tuple[Tensor, Tensor]:
    """summaries [n, B, H, Dk, Dk+Dv]: each local segment's [M | S_ext] (`kda_segment_summary`);
    initial [B, H, Dk, Dv]: the state before the window. Returns the states entering the local segments
    [n, B, H, Dk, Dv] and the window's final state [B, H, Dk, Dv] (the same on every rank), in the summaries'
    dtype. One all-gather of n*B*H*Dk*(Dk+Dv) elements per rank."""
    return _StateHandOver.apply(summaries, initial.to(summaries.dtype), layout, group)
