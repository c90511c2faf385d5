"""Expert parallelism (EP) for the routed experts, applied to a built model from outside.

`apply_expert_parallel(model, group)` keeps on each rank r of `group` (size ep) only experts
[r*E/ep, (r+1)*E/ep) of every `Experts` module (or, under a placement by load, the E/ep experts it owns
there, plus copies of other ranks' experts whose weights arrive per layer pass: `fetch_copies`):
`gate_up_proj` [E/ep, 2I, D] and `down_proj` [E/ep, D, I], under the same parameter names, taken from the
full weights every rank built. The exchange sorts and counts pairs by slot over the group (`ExpertShard.
slot_ids`), which under the static blocks is the expert itself. It attaches to the module one
`ExpertShard` (`module.expert_shard`: the group, this rank's place in it, the global ids of the experts held
here, the capacity factor, the row counter); `is_expert_parallel(module)` is the one test for it. It also sets
an instance attribute `forward` (as `genomelm.parallel.context` does for attention) that keeps
`Experts.forward`'s contract -- x [T, D] of this rank's tokens, global expert ids and fp32 weights [T, k] from
the router -> (out [T, D], counts [E] long of this rank's (token, expert) pairs) -- and moves the rows to the
experts' owners:

1. this rank's pairs are sorted by slot over the group (so also by the rank computing them), counts per slot
   (ep x slots per rank; the static blocks' slots are the experts themselves);
2. one all-gather of the counts: every rank knows the whole [ep, slots] count matrix, hence every send and
   receive size and the capacity decision, which is therefore the same on every rank (all raise together, none
   hangs); its row sums are copied to the host (the all-to-all takes its split sizes there): a host sync,
   inherent to an uneven all-to-all. The MoE routes all its chunks before the first (`Experts.plan_chunks`),
   so one all-gather and one host copy serve all of a layer's chunks (`plan_expert_chunks`). A recompute in
   the backward pass routes each chunk exactly as the forward did, so it reuses the forward's matrix and sizes
   (kept per chunk, found by `Experts.chunk_index`): no all-gather and no host sync;
3. an uneven all-to-all of the rows (in the compute dtype: bf16 under autocast) to the owners; the rows arrive
   grouped by source rank, then slot, and are reordered slot-major for one grouped GEMM over the local
   experts (`Experts.expert_rows`, the local path's own GEMM; a second over the copies, if any), then put
   back in arrival order;
4. the reverse all-to-all, the routing weights, and an index_add into out, as the local path does.

With `overlap` (the default, `ep_overlap`), the exchanges are started ahead and waited for where their rows
are needed: the MoE hands the planning step its chunks' tokens, so chunk 0's dispatch starts with the split
sizes and each chunk, once its own rows have arrived, starts the next chunk's dispatch before its expert
GEMMs; the combine starts before the MoE's shared expert runs (`beside`) and is waited for after it. The same
rows travel in the same order as blocking exchanges (exact); on a GPU they run on NCCL's stream beside the
compute. A recompute of the whole layer runs its chunks in order and does the same (routing them ahead again,
with the forward's sizes); a recompute of one chunk at a time (`recompute_chunks`, in reverse order) starts
only its combine ahead. The backward starts the combine's reverse exchange and completes it after the shared
expert's backward (`_AwaitGradient`); the reverse dispatch blocks.
The module's `backend` is not consulted: EP always runs the grouped path ("loop" is a single-process
reference). All ranks of the group must call the MoE the same number of times with the same number of chunks
(the same local token count, as under CP or data parallelism with equal windows), since every chunk is one
round of exchanges.

Autograd: each all-to-all is a Function whose backward is the reverse all-to-all of the gradients. Every rank
enters every collective, with zero rows to send or receive too, and a rank that receives no rows still joins
the received rows (and its expert weights, whose gradient is then zero) to its output, so its backward reaches
both reverse all-to-alls. Under activation recompute the EP forward, collectives included, runs again in the
backward pass, identically on every rank.

Gradients: the owner's expert gradient already sums the contributions of every rank's tokens (their gradients
come back through the reverse dispatch), so expert parameters must NOT be summed over the EP group with the
replicated parameters (`expert_parallel_parameters` names them); they are reduced only over ranks holding the
same experts. A module with the override holds the process group (in its `ExpertShard`), so it cannot be
deep-copied; its state dict holds only the local slice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable

from genomelm.model.moe import Experts
from genomelm.model.precision import compute_dtype

from .exchange import all_gather_slots
from .expert_slots import ExpertSlots
from .placement import Placement, static_placement

ROUTE_NOTE = " + expert parallel"  # appended to the parent MoE module's `route`
SHARD_ATTRIBUTE = "expert_shard"  # the `Experts` attribute holding its `ExpertShard`


class ExpertCapacityError(RuntimeError):
    """A rank would receive more rows in one exchange than `capacity_factor` x the mean; raised on every
    rank."""

    exit_code = 1  # the machine's failure (`genomelm.run.failures`)


# (pairs, count matrix [src, dst, local slot], rows [src][dst], rows this rank computes with its own experts)
Sizes = tuple[int, Tensor, list[list[int]], int]


@dataclass
class InFlight:
    """An all-to-all of rows started and not waited for (`start_exchange`): the buffer the rows arrive in
    [sum(recv), ...], the collective's handle, and the rows sent (kept alive until it completes)."""

    out: Tensor
    work: dist.Work | None
    sent: Tensor

    def result(self) -> Tensor:
        """The received rows, once the exchange has completed (this waits for it)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.out


@dataclass
class ExpertShard:
    """One `Experts` module's share of the routed experts: the expert-parallel group, this rank's place in it,
    the global ids of the experts of its slots (its own, the rows of `gate_up_proj` / `down_proj` in order,
    then any copies of others'), and the rows they computed since the counter was last reset."""

    group: dist.ProcessGroup | None  # None: a layout made without a process group (loading, tests)
    ep: int
    rank: int
    num_experts: int  # E, over the whole group
    local_experts: tuple[int, ...]  # the global id of the expert in each of this rank's slots
    capacity_factor: float = 8.0  # <= 0: no limit (see `apply_expert_parallel`)
    name: str = ""  # the module's name in the model, for messages
    overlap: bool = True  # exchanges started ahead and waited for late (see `apply_expert_parallel`)
    received_tokens: int = field(default=0, compare=False)  # (token, expert) rows computed here
    # chunk index -> the `Sizes` of the last forward: what a recompute reuses
    kept_sizes: dict[int, Sizes] = field(default_factory=dict, compare=False, repr=False)
    # the same for the chunks of the forward under way, exchanged before its first chunk (`plan_chunks`)
    planned_sizes: dict[int, Sizes] = field(default_factory=dict, compare=False, repr=False)
    # chunk index -> (tokens [T_c, D], slot ids [T_c, k], rows between ranks) of planned chunks whose
    # dispatch is not started
    planned_rows: dict[int, tuple[Tensor, Tensor, list[list[int]]]] = field(
        default_factory=dict, compare=False, repr=False
    )
    # chunk index -> its dispatch, started while the chunk before it computed (`overlap`)
    in_flight: dict[int, InFlight] = field(default_factory=dict, compare=False, repr=False)
    # where the exchange sends each expert's pairs under a placement by load; None: the static blocks
    slots: ExpertSlots | None = field(default=None, compare=False, repr=False)

    @classmethod
    def split(
        cls,
        group: dist.ProcessGroup,
        ep: int,
        rank: int,
        num_experts: int,
        capacity_factor: float,
        name: str,
        overlap: bool = True,
        placement: Placement | None = None,
    ) -> ExpertShard:
        """Rank `rank` of `ep`: the experts of its slots in `placement` (its own experts, then any copies of
        other ranks': `Placement.slots_of`), or without one the static block [rank*E/ep, (rank+1)*E/ep)."""
        placement = placement or static_placement(num_experts, ep)
        slots = ExpertSlots.of(placement, num_experts, ep, rank)
        shard = cls(group, ep, rank, num_experts, placement.slots[rank], capacity_factor, name, overlap)
        shard.slots = slots
        return shard

    @property
    def per_rank(self) -> int:
        """Slots on each rank: its own experts and its copies of others'."""
        return len(self.local_experts)

    @property
    def owned_experts(self) -> tuple[int, ...]:
        """The experts whose weights this rank holds (the rows of `gate_up_proj` / `down_proj`)."""
        return self.local_experts[: self.slots.owned] if self.slots is not None else self.local_experts

    def slot_ids(self, expert_ids: Tensor) -> Tensor:
        """expert_ids [T, k] (global) -> the slot over the group that computes each pair [T, k]: what the
        exchange sorts and counts by (the computing rank first)."""
        return expert_ids if self.slots is None else self.slots.slot_ids(expert_ids, self.rank)


def expert_shard(module: nn.Module) -> ExpertShard | None:
    """The `ExpertShard` of an expert-parallel `Experts` module; None for any other module."""
    shard = module.__dict__.get(SHARD_ATTRIBUTE) if isinstance(module, Experts) else None
    return shard if isinstance(shard, ExpertShard) else None


def is_expert_parallel(module: nn.Module) -> bool:
    """Whether `module` is an `Experts` module holding only its share of the experts
    (`apply_expert_parallel`)."""
    return expert_shard(module) is not None


@dataclass
class _GradientExchange:
    """The reverse exchange of a combine's gradient: started by the combine's backward (`_AllToAllRows`),
    completed by `_AwaitGradient`'s."""

    in_flight: InFlight | None = None


class _AllToAllRows(torch.autograd.Function):
    """Forward: rows [N, D] split by `send` (rows to each rank, in rank order) -> the rows every rank sent
    here [sum(recv), D], in source-rank order; where the same rows' exchange is already under way
    (`in_flight`, started from these rows' values), its result. Backward: the same exchange reversed on the
    gradients, blocking, or with `gradient` started and left to `_AwaitGradient` to complete."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        rows: Tensor,
        send: list[int],
        recv: list[int],
        group: dist.ProcessGroup,
        in_flight: InFlight | None,
        gradient: _GradientExchange | None,
    ) -> Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.gradient = send, recv, group, gradient
        if in_flight is not None:
            return in_flight.result()
        return _exchange(rows, send, recv, group)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if ctx.gradient is None:
            return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None, None, None
        ctx.gradient.in_flight = start_exchange(grad, ctx.recv, ctx.send, ctx.group)
        return ctx.gradient.in_flight.out, None, None, None, None, None  # written until awaited


class _AwaitGradient(torch.autograd.Function):
    """Identity on rows; its backward completes their gradient's reverse exchange, which the combine's
    backward started (`_GradientExchange`). Applied to the experts' results before the shared expert runs:
    autograd runs the nodes made later first, so the shared expert's backward runs between the two."""

    @staticmethod
    def forward(ctx: FunctionCtx, rows: Tensor, gradient: _GradientExchange) -> Tensor:  # type: ignore[override]
        ctx.gradient = gradient
        return rows.view_as(rows)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        in_flight, ctx.gradient.in_flight = ctx.gradient.in_flight, None
        return (grad if in_flight is None else in_flight.result()), None


def _exchange(rows: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> Tensor:
    return start_exchange(rows, send, recv, group, wait=True).out


def start_exchange(
    rows: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup, wait: bool = False
) -> InFlight:
    """The uneven all-to-all of `rows` (no autograd) started on the communication stream (NCCL's own; gloo's
    worker threads), returned before it completes unless `wait`. The exchanges of a group complete in the
    order they were started, the same on every rank."""
    out = rows.new_empty(sum(recv), *rows.shape[1:])
    sent = rows.detach().contiguous()
    work = dist.all_to_all_single(out, sent, recv, send, group=group, async_op=not wait)
    return InFlight(out, work, sent)


def all_to_all_rows(
    rows: Tensor,
    send: list[int],
    recv: list[int],
    group: dist.ProcessGroup,
    in_flight: InFlight | None = None,
    gradient: _GradientExchange | None = None,
) -> Tensor:
    """Uneven all-to-all of rows with autograd: rows [sum(send), ...] -> [sum(recv), ...], same dtype.
    send[r]: rows this rank sends to rank r (consecutive, in rank order); recv[r]: rows it receives from rank
    r. Every rank of `group` must call it, with matching sizes. `in_flight`: the exchange of these same rows,
    started earlier (`start_exchange`), whose result this waits for instead of exchanging again. `gradient`:
    the backward starts the reverse exchange there and `_AwaitGradient` (applied to `rows` earlier)
    completes it."""
    return _AllToAllRows.apply(rows, send, recv, group, in_flight, gradient)


def _check_capacity(settings: ExpertShard, received: list[int]) -> None:
    """received: rows each rank would receive in this exchange. Raises the same `ExpertCapacityError` on
    every rank (all of them hold the same count matrix)."""
    total = sum(received)
    if settings.capacity_factor <= 0 or total == 0:
        return
    mean = total / settings.ep
    rows = max(received)
    busiest = received.index(rows)
    if rows > settings.capacity_factor * mean:
        raise ExpertCapacityError(
            f"expert parallel capacity exceeded in {settings.name}: rank {busiest} of {settings.ep} would "
            f"receive {rows} rows in one exchange, {rows / mean:.2f}x the mean of {mean:.1f} rows per rank "
            f"(limit {settings.capacity_factor}x). Lower moe_chunk_tokens, raise ep_capacity_factor, or "
            f"check the routing balance (expert_bias_speed)."
        )


def _in_recompute() -> bool:
    """Whether this runs again inside the backward pass (activation recompute)."""
    return torch._C._current_graph_task_id() != -1


def _exchange_sizes(settings: ExpertShard, pairs: list[int], counts: Tensor) -> list[Sizes]:
    """counts [n, ep x slots per rank] long: this rank's pairs per slot over the group in each of n chunks
    (of `pairs` pairs each) -> per chunk its `Sizes`. One all-gather of the counts and one host copy of the
    rows between ranks (every send and receive size, and the rows of this rank's own experts) for all n
    chunks: the exchanges' only host sync. Each chunk's capacity decision comes from it, so it is the same on
    every rank."""
    ep, n, owned = settings.ep, counts.shape[0], len(settings.owned_experts)
    matrices = all_gather_slots(counts, settings.group).view(ep, n, ep, settings.per_rank).transpose(0, 1)
    own = matrices[:, :, settings.rank, :owned].sum((1, 2))  # [chunk]
    on_host = torch.cat([matrices.sum(-1).flatten(), own]).tolist()
    rows = [[on_host[(c * ep + src) * ep : (c * ep + src + 1) * ep] for src in range(ep)] for c in range(n)]
    for rows_between in rows:
        _check_capacity(settings, [sum(column) for column in zip(*rows_between)])
    return list(zip(pairs, matrices, rows, on_host[n * ep * ep :]))


def plan_expert_chunks(
    module: Experts,
    settings: ExpertShard,
    route: Callable[[], list[Tensor]],
    chunks: list[Tensor] | None = None,
) -> tuple[Tensor, Tensor] | None:
    """The split sizes of all the chunks a MoE forward is about to run (`Experts.plan_chunks`; `route` gives
    each chunk's expert ids [T_c, k], run here without autograd), exchanged at once: one collective and one
    host sync per layer instead of one per chunk. A recompute reuses the forward's sizes
    (`ExpertShard.kept_sizes`): it exchanges none. With `overlap` and the chunks' tokens (`chunks`, [T_c, D]
    each), the first chunk's dispatch starts here and each chunk's forward starts the next one's, in the
    forward and in a recompute of the whole layer (which routes ahead again for it). Where ranks hold copies
    of each other's experts, their weights are fetched here, once for all the chunks, and returned: the MoE
    hands them to each chunk's forward (`fetch_copies`; None without copies)."""
    copies = fetch_copies(module, settings)
    _plan_sizes(settings, route, chunks)
    return copies


def _plan_sizes(
    settings: ExpertShard, route: Callable[[], list[Tensor]], chunks: list[Tensor] | None
) -> None:
    """`plan_expert_chunks`'s split sizes and dispatches started ahead."""
    for leftover in settings.in_flight.values():  # of a forward that raised between chunks: let it land
        leftover.result()
    settings.in_flight.clear()
    recompute = _in_recompute()
    ahead = settings.overlap and chunks is not None
    if recompute and not ahead:
        return
    with torch.no_grad():
        chunk_ids = [settings.slot_ids(ids) for ids in route()]
    if recompute:
        sizes = [settings.kept_sizes.get(index) for index in range(len(chunk_ids))]
        if any(kept is None or kept[0] != ids.numel() for kept, ids in zip(sizes, chunk_ids)):
            return  # not the forward's chunks: each exchanges as it runs
    else:
        slots = settings.ep * settings.per_rank
        counts = torch.stack([torch.bincount(ids.reshape(-1), minlength=slots) for ids in chunk_ids])
        sizes = _exchange_sizes(settings, [ids.numel() for ids in chunk_ids], counts)
        settings.planned_sizes = dict(enumerate(sizes))
    settings.planned_rows = {}
    if ahead:
        for index, (x, ids, kept) in enumerate(zip(chunks, chunk_ids, sizes)):
            settings.planned_rows[index] = (x.detach(), ids, kept[2])
        _start_dispatch(settings, 0)


def fetch_copies(module: Experts, settings: ExpertShard) -> tuple[Tensor, Tensor] | None:
    """Where ranks hold copies of each other's experts (a placement by load with spare slots): the weights of
    this rank's copies (gate_up [copies, 2I, D], down [copies, D, I]), which their owners send in one uneven
    all-to-all (every rank of the group calls this); None without copies. The copies are the owners'
    weights, so they stay identical; the exchange's backward sends each copy's gradient back to its owner,
    where autograd adds it to the owner's own. Copies are not parameters (no optimizer state, nothing in a
    checkpoint): they cost one exchange of weights per layer pass instead."""
    slots = settings.slots
    if slots is None or not slots.has_copies:
        return None
    gate_up, down = module.gate_up_proj, module.down_proj

    # the sent experts' weights, flat, in one gather per weight (its backward writes one gradient buffer);
    # taken from the parameter even where none are sent, so every rank's backward reaches the exchange
    rows = slots.rows_to_send(gate_up.device)
    sent = torch.cat([gate_up.index_select(0, rows).flatten(1), down.index_select(0, rows).flatten(1)], dim=1)
    arrived = all_to_all_rows(sent, slots.send, slots.recv, settings.group)
    split = gate_up[0].numel()
    return arrived[:, :split].reshape(-1, *gate_up.shape[1:]), arrived[:, split:].reshape(-1, *down.shape[1:])


def _by_slot(x: Tensor, slot_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [T, D], slot_ids [T, k] (`ExpertShard.slot_ids`) -> (order [T*k]: the (token, expert) pairs sorted
    by slot over the group, so by the rank computing them, the token of each sorted pair [T*k], x's rows in
    that order in the compute dtype [T*k, D])."""
    order = torch.argsort(slot_ids.reshape(-1), stable=True)
    token_of_pair = order // slot_ids.shape[1]
    return order, token_of_pair, x[token_of_pair].to(compute_dtype(x))


def _send_recv(settings: ExpertShard, rows_between: list[list[int]]) -> tuple[list[int], list[int]]:
    """This rank's rows to each rank, and from each rank, out of the rows between ranks [src][dst]."""
    return rows_between[settings.rank], [row[settings.rank] for row in rows_between]


def _start_dispatch(settings: ExpertShard, index: int) -> None:
    """Start chunk `index`'s dispatch from its planned tokens, if it was planned and not started: the same
    rows its forward sorts (the same ops on the same tokens), exchanged while other work runs."""
    planned = settings.planned_rows.pop(index, None)
    if planned is None:
        return
    x, slot_ids, rows_between = planned
    send, recv = _send_recv(settings, rows_between)
    with torch.no_grad():
        rows = _by_slot(x, slot_ids)[2]
    settings.in_flight[index] = start_exchange(rows, send, recv, settings.group)


def expert_parallel_forward(
    module: Experts,
    settings: ExpertShard,
    x: Tensor,
    expert_ids: Tensor,
    weights: Tensor,
    beside: Callable[[], Tensor] | None = None,
    copies: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """`Experts.forward` with the experts spread over the group: x [T, D] (this rank's tokens), expert_ids and
    weights [T, k] (global ids; fp32 routing) -> (out [T, D] in x's dtype, counts [E] long of this rank's
    pairs). `beside`: work on the same tokens whose [T, D] result is added to out (the MoE's shared expert),
    run while the results come back. `copies`: the weights of this rank's copies of other ranks' experts,
    as `plan_expert_chunks` fetched them for the layer (fetched here if the chunk was not planned).

    Two uneven all-to-alls of rows per call on every rank (one each way), and an all-gather of the counts
    unless the MoE planned the chunk (`plan_expert_chunks`) or a recompute replays it; the backward runs the
    two all-to-alls reversed. With `overlap`, a planned chunk's dispatch was started while the chunk before
    it computed, this chunk starts the next one's before its own expert GEMMs, and the combine is started
    before `beside` runs and waited for after (its reverse likewise around `beside`'s backward). Adds the
    rows computed here to `settings.received_tokens` (not during a recompute in the backward pass).
    """
    per_rank = settings.per_rank
    counts = torch.bincount(expert_ids.reshape(-1), minlength=settings.num_experts)
    slot_ids = settings.slot_ids(expert_ids)
    # [src, dst, local slot]: pairs rank src sends to slot `local slot` of rank dst
    recompute, index = _in_recompute(), module.chunk_index
    kept = settings.kept_sizes.get(index) if recompute else settings.planned_sizes.pop(index, None)
    in_flight = settings.in_flight.pop(index, None)
    if kept is None or kept[0] != expert_ids.numel():  # not planned by the MoE (the experts called alone)
        if in_flight is not None:
            raise RuntimeError(f"{settings.name}: chunk {index} was dispatched ahead with other sizes")
        per_slot = torch.bincount(slot_ids.reshape(-1), minlength=settings.ep * per_rank)
        kept = _exchange_sizes(settings, [expert_ids.numel()], per_slot.unsqueeze(0))[0]
    _, matrix, rows_between, own_rows = kept
    if not recompute:
        settings.kept_sizes[index] = kept
    send, recv = _send_recv(settings, rows_between)

    order, token_of_pair, x_sorted = _by_slot(x, slot_ids)  # by the computing rank, then its slot
    received = all_to_all_rows(x_sorted, send, recv, settings.group, in_flight)  # by source, then slot
    _start_dispatch(settings, index + 1)  # in flight while this chunk's experts compute
    here = matrix[:, settings.rank]  # [src, local slot]
    local_ids = (
        torch.arange(per_rank, device=x.device)
        .repeat(settings.ep)
        .repeat_interleave(here.flatten(), output_size=sum(recv))
    )
    by_expert = torch.argsort(local_ids, stable=True)
    if copies is None:  # not planned by the MoE: its copies' weights, if any, fetched for this call
        copies = fetch_copies(module, settings)
    y = _slot_rows(module, received[by_expert], here.sum(0), own_rows, copies)
    y_received = y[torch.argsort(by_expert)]  # back to arrival order
    combine, gradient, alongside = None, None, None
    if settings.overlap and beside is not None:
        # the shared expert runs while the combine is under way, and in the backward while its reverse is
        gradient = _GradientExchange()
        y_received = _AwaitGradient.apply(y_received, gradient)
        combine = start_exchange(y_received, recv, send, settings.group)
        alongside = beside()
    y_sorted = all_to_all_rows(y_received, recv, send, settings.group, combine, gradient)  # as x_sorted

    if not recompute:
        settings.received_tokens += int(received.shape[0])
    y_sorted = y_sorted * weights.reshape(-1)[order].unsqueeze(-1).to(y_sorted.dtype)
    out = torch.zeros_like(x).index_add_(0, token_of_pair, y_sorted.to(x.dtype))
    if beside is not None:
        out = out + (alongside if alongside is not None else beside())
    return out, counts


def _slot_rows(
    module: Experts, rows: Tensor, counts: Tensor, own_rows: int, copies: tuple[Tensor, Tensor] | None
) -> Tensor:
    """The expert MLP of the rows received here, sorted by local slot: rows [N, D], counts [slots] long (the
    first `own_rows` rows for this rank's own experts, the rest for its `copies`) -> [N, D]. Weights that get
    no rows stay in the graph with a zero gradient: every parameter gets one, and the backward reaches the
    exchanges the other ranks wait in (the rows' reverse dispatch, the copies' return)."""
    owned = module.gate_up_proj.shape[0]
    parts = [(rows, counts, None)]
    if copies is not None:
        parts = [(rows[:own_rows], counts[:owned], None), (rows[own_rows:], counts[owned:], copies)]
    outputs, unused = [], []
    for part, part_counts, weights in parts:
        if part.shape[0]:
            outputs.append(module.expert_rows(part, part_counts, weights))
        else:
            unused.extend(weights or (module.gate_up_proj, module.down_proj))
    y = torch.cat(outputs) if len(outputs) > 1 else outputs[0] if outputs else rows
    return y + 0 * sum(w.sum() for w in unused).to(rows.dtype) if unused else y


def apply_expert_parallel(
    model: nn.Module,
    group: dist.ProcessGroup,
    capacity_factor: float = 8.0,
    overlap: bool = True,
    placements: Mapping[str, Placement] | None = None,
) -> list[str]:
    """Each rank of `group` (size ep) keeps experts [r*E/ep, (r+1)*E/ep) of every `Experts` module in `model`
    and runs them for the whole group (see the module docstring); or, for a module named in `placements`, the
    experts of its slots there (each expert owned by one rank, plus any copies: `Placement.slots_of`; e.g. by
    load, `genomelm.parallel.placement.placement_with_replicas`), with the same results to within fp32
    summation order.

    Every rank must have built the same full model first (the slices come from the weights in the module).
    `capacity_factor`: the most rows one rank may receive in one exchange, as a multiple of the mean over the
    ranks (`ExpertCapacityError` beyond it; <= 0: no limit). `overlap`: each exchange of rows started
    ahead of the work that needs it (the next chunk's dispatch during this chunk's expert GEMMs, the combine
    during the shared expert), with the same results as blocking exchanges. Applying again with the same
    group size only updates the settings. Returns the names of the modules changed.
    """
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    placements = placements or {}
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, Experts)]
    unknown = sorted(set(placements) - {name for name, _ in modules})
    if unknown:
        raise ValueError(f"placements name modules that are not routed experts of the model: {unknown}")
    shards = {}
    for name, module in modules:  # all checked before any is changed
        num_experts = module.num_experts
        if num_experts % ep:
            divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
            raise ValueError(
                f"{name or 'the model'} has E={num_experts} routed experts, which do not split over ep={ep} "
                f"ranks; ep must divide {num_experts}: one of {divisors}"
            )
        label = name or type(module).__name__
        shards[name] = ExpertShard.split(
            group, ep, rank, num_experts, capacity_factor, label, overlap, placements.get(name)
        )
    changed = []
    for name, module in modules:
        settings = shards[name]
        previous = expert_shard(module)
        if previous is None:
            held = settings.owned_experts  # rows taken one by one: no index tensor, so any device or mode
            with torch.no_grad():  # new leaves: the full weights' storage is freed once the old ones go
                module.gate_up_proj = nn.Parameter(torch.stack([module.gate_up_proj[e] for e in held]))
                module.down_proj = nn.Parameter(torch.stack([module.down_proj[e] for e in held]))
        elif (previous.ep, previous.rank, previous.local_experts) != (ep, rank, settings.local_experts):
            raise ValueError(
                f"{name} already runs expert parallel as rank {previous.rank} of {previous.ep}; it holds "
                f"only those experts, so it cannot be re-split as rank {rank} of {ep} or re-placed"
            )
        else:
            settings.received_tokens = previous.received_tokens
        setattr(module, SHARD_ATTRIBUTE, settings)
        module.forward = functools.partial(expert_parallel_forward, module, settings)
        module.plan_chunks = functools.partial(plan_expert_chunks, module, settings)
        module.runs_beside = overlap
        _note_route(model, name, ep)
        changed.append(name)
    return changed


def _note_route(model: nn.Module, name: str, ep: int) -> None:
    """Append the EP note to the parent MoE module's `route` (the model's description of each block)."""
    if not name:
        return
    parent = model.get_submodule(name.rpartition(".")[0])
    route = getattr(parent, "route", None)
    if isinstance(route, str) and ROUTE_NOTE not in route:
        parent.route = f"{route}{ROUTE_NOTE} (ep {ep})"


def received_tokens(model: nn.Module, reset: bool = True) -> dict[str, int]:
    """Rows (token, expert pairs) each expert-parallel `Experts` module computed on this rank since the last
    reset, over all its forward calls (every chunk, every micro-batch), not counting recomputes in the
    backward pass; module name -> count. With `reset`, the counters restart at 0. The busiest rank is the max
    over the group of each module's count."""
    counts = {}
    for name, module in model.named_modules():
        shard = expert_shard(module)
        if shard is not None:
            counts[name] = shard.received_tokens
            if reset:
                shard.received_tokens = 0
    return counts


def expert_parallel_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters that hold only this rank's experts (name -> parameter): their gradients are complete on
    the owner and must not be summed with the replicated parameters' over the EP group."""
    params = {}
    for name, module in model.named_modules():
        if is_expert_parallel(module):
            prefix = f"{name}." if name else ""
            params[f"{prefix}gate_up_proj"] = module.gate_up_proj
            params[f"{prefix}down_proj"] = module.down_proj
    return params
