"""What a layer's ranks exchange under context parallelism, one packed collective per exchange and direction.

KDA: one all-gather each for the conv halo and for the segment summaries in forward, the matching
reduce-scatter each in backward. DSA (`gather_window`): one all-gather of every rank's keys (the normalised
latent and the indexer's pooled keys) into the whole window in global order, and in backward one
reduce-scatter that returns to each rank the gradient of its own keys, summed over the ranks whose queries
read them; with `train_indexer`, one all-reduce of the count of queries the indexer's KL term averages over.

The exchanges are autograd Functions whose output every rank consumes (KDA: the halos and incoming states of
its own segments, including the first segment's, which comes from the caller's state rather than from a
predecessor; DSA: every rank's queries read the whole gathered window), so every rank's backward reaches them
and runs its reduce-scatter: a rank that skipped one would deadlock the group. All ranks exchange at once; no
rank waits for the one before it.

Gradients of the caller's initial tail/state (replicated on every rank) are this rank's share: their sum over
the group is the full gradient, as for the model's parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

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


def _pick(tensor: Tensor, rows: list[int]) -> Tensor:
    """tensor[rows] along dim 0 for host-side row numbers: views and one stack, so no index tensor is copied
    to the device (a host sync on a GPU)."""
    return torch.stack([tensor[row] for row in rows])


def sum_over_group(value: Tensor, group: dist.ProcessGroup) -> Tensor:
    """value summed over the group's ranks (a new tensor, no graph): the same shape, on every rank."""
    total = value.detach().clone()
    dist.all_reduce(total, group=group)
    return total


class _ConvHaloExchange(torch.autograd.Function):
    """Forward: the K-1 conv-input rows before each local segment (the previous segment's last rows; the
    caller's tail before segment 0) and the window's last K-1 rows. Backward: each halo's gradient goes back
    to the rows it came from, summed over the ranks that read them."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, tails: Tensor, initial_tail: Tensor, layout: ContextLayout, group: dist.ProcessGroup
    ) -> tuple[Tensor, Tensor]:
        ctx.layout, ctx.group = layout, group
        in_order = _pick(all_gather_slots(tails, group), layout.slot_of_segment())
        preceding = torch.cat([initial_tail.unsqueeze(0), in_order])  # [G+1]: rows before segment j at j
        return _pick(preceding, layout.segments), preceding[-1].clone()

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_halos: Tensor, grad_last: Tensor
    ) -> tuple[Tensor, Tensor, None, None]:
        layout: ContextLayout = ctx.layout
        grad_preceding = grad_halos.new_zeros(layout.num_segments + 1, *grad_halos.shape[1:])
        for i, segment in enumerate(layout.segments):
            grad_preceding[segment] += grad_halos[i]
        grad_preceding[-1] += grad_last
        slot_order = _pick(grad_preceding[1:], layout.segment_of_slot())
        return reduce_scatter_slots(slot_order, ctx.group), grad_preceding[0], None, None


class _StateHandOver(torch.autograd.Function):
    """Forward: gather every segment's summary [M | S_ext], fold them in global order from the caller's state
    (S_0 = initial, S_{j+1} = M_j S_j + S_ext_j: `apply_state_map`) and return the states entering the local
    segments and the window's final state. Backward: the adjoint fold (with M transposed) gives each
    summary's gradient, which goes back to the rank that made it. Each fold step is one batched matmul over
    the [B*H] heads and one add (what `apply_state_map`'s matmul runs, without its per-step slicing and
    reshaping), and the summaries' gradients are one batched matmul over all segments: a trace or a host
    issues a few ops per segment, not tens (a 1M window at cp=64 folds 128 segments per KDA layer)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, summaries: Tensor, initial: Tensor, layout: ContextLayout, group: dist.ProcessGroup
    ) -> tuple[Tensor, Tensor]:
        ctx.layout, ctx.group = layout, group
        maps = _pick(all_gather_slots(summaries, group), layout.slot_of_segment())  # [G, B, H, Dk, Dk+Dv]
        dk = maps.shape[-2]
        transitions = maps[..., :dk].flatten(1, 2).unbind(0)  # G x [B*H, Dk, Dk]
        offsets = maps[..., dk:].flatten(1, 2).unbind(0)  # G x [B*H, Dk, Dv]
        states = [initial.flatten(0, 1)]
        for transition, offset in zip(transitions, offsets, strict=True):
            states.append(torch.bmm(transition, states[-1]) + offset)
        states_all = torch.stack(states).unflatten(1, initial.shape[:2])  # [G+1, B, H, Dk, Dv]
        ctx.save_for_backward(maps, states_all)
        return _pick(states_all, layout.segments), states[-1].unflatten(0, initial.shape[:2])

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_incoming: Tensor, grad_final: Tensor
    ) -> tuple[Tensor, Tensor, None, None]:
        layout: ContextLayout = ctx.layout
        maps, states = ctx.saved_tensors
        dk = maps.shape[-2]
        direct = grad_incoming.new_zeros(states.shape)  # gradient reaching S_j from outside the fold
        for i, segment in enumerate(layout.segments):
            direct[segment] += grad_incoming[i]
        direct[-1] += grad_final
        transposed = maps[..., :dk].mT.flatten(1, 2).unbind(0)  # G x M_j^T [B*H, Dk, Dk]
        outside = direct.flatten(1, 2).unbind(0)  # G+1 x [B*H, Dk, Dv]
        lam = outside[-1]  # d loss / d S_{j+1}, walking back
        adjoints = []
        for j in reversed(range(layout.num_segments)):
            adjoints.append(lam)
            lam = torch.bmm(transposed[j], lam) + outside[j]
        adjoint = torch.stack(adjoints[::-1]).unflatten(1, states.shape[1:3])  # [G, B, H, Dk, Dv]: d/dS_{j+1}
        grad_maps = torch.cat([adjoint @ states[:-1].mT, adjoint], dim=-1)  # [G, B, H, Dk, Dk+Dv]
        slot_order = _pick(grad_maps, layout.segment_of_slot())
        return reduce_scatter_slots(slot_order, ctx.group), lam.unflatten(0, states.shape[1:3]), None, None


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


class _WindowGather(torch.autograd.Function):
    """Forward: each rank's parts [B, n_i, W_i] packed as bytes into one all-gather (each part keeps its
    dtype: under bf16 autocast the latent and the pooled keys move 2 bytes per value), each part then restored
    to global order [B, cp*n_i, W_i] by its layout. Backward: each whole-window gradient put back in rank
    order, packed in fp32 or wider, one reduce-scatter: this rank's rows' gradients summed over the group."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, layouts: tuple[ContextLayout, ...], group: dist.ProcessGroup, *parts: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.layouts, ctx.group = layouts, group
        ctx.shapes, ctx.dtypes = [p.shape for p in parts], [p.dtype for p in parts]
        packed = torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in parts])
        gathered = all_gather_slots(packed, group).view(dist.get_world_size(group), -1)
        sizes = [p.numel() * p.element_size() for p in parts]
        wholes = []
        for part, layout, rows in zip(parts, layouts, gathered.split(sizes, dim=1)):
            rows = rows.contiguous().view(part.dtype).view(-1, *part.shape)  # [cp, B, n, W]
            wholes.append(layout.restore(rows.transpose(0, 1).flatten(1, 2), dim=1))  # [B, cp*n, W]
        return tuple(wholes)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        wanted = [i for i in range(len(grads)) if ctx.needs_input_grad[2 + i]]
        dtype = functools.reduce(torch.promote_types, [ctx.dtypes[i] for i in wanted], torch.float32)
        cp = dist.get_world_size(ctx.group)
        per_rank = [
            ctx.layouts[i].rank_order(grads[i], dim=1).unflatten(1, (cp, -1)).transpose(0, 1).reshape(cp, -1)
            for i in wanted
        ]  # [cp, B*n*W] each
        mine = reduce_scatter_slots(torch.cat(per_rank, dim=1).to(dtype).flatten(), ctx.group)
        sizes = [ctx.shapes[i].numel() for i in wanted]
        result: list[Tensor | None] = [None] * len(grads)
        for i, grad in zip(wanted, mine.split(sizes)):
            result[i] = grad.view(ctx.shapes[i]).to(ctx.dtypes[i])
        return (None, None, *result)


def gather_window(
    parts: Sequence[Tensor], layouts: Sequence[ContextLayout], group: dist.ProcessGroup
) -> tuple[Tensor, ...]:
    """Every rank's rows of each part, as the whole window in global order.

    parts: this rank's [B, n_i, W_i] (rows in layout order: tokens, or k-pools with `ContextLayout.pooled`);
    layouts: each part's split (n_i = layout.local_len). Returns [B, cp*n_i, W_i] per part, in the part's
    dtype, the same on every rank. One all-gather of the parts' bytes per rank in forward and one
    reduce-scatter (fp32 or wider) of the parts that need a gradient in backward; every rank must consume the
    result (its backward must run on every rank).
    """
    for part, layout in zip(parts, layouts, strict=True):
        if part.dim() != 3 or part.shape[1] != layout.local_len:
            raise ValueError(f"a part of shape {tuple(part.shape)} is not [B, {layout.local_len}, W]")
    return _WindowGather.apply(tuple(layouts), group, *parts)
