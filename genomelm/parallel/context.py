"""Context parallelism applied to a built model from outside: the KDA and the DSA layers.

`apply_context_parallel(model, group, kind)` sets an instance attribute `forward` on every `KDAttention` and
`DSAAttention` module (it shadows the class's method, so `module(x, ...)` runs `kda_context_parallel_forward`
or `dsa_context_parallel_forward` instead). Nothing else changes: parameters, their names, state dicts, hooks
and the class stay as they were, and `remove_context_parallel` deletes the attribute again. A forward seam
inside the model would have to know about process groups; this keeps genomelm/model free of communication
and lets the parallel code call the layer's own steps around its exchanges (KDA: `project`, `convolve`,
`gates`, `summarise`, `core`, `output`; DSA: `project`, `attend`).

Under CP each rank passes only its tokens: x [B, S/cp, D], its segments concatenated in layout order
(`ContextLayout.shard`). Per KDA layer and direction there are two collectives, both over the whole group and
both symmetric (no rank waits for its predecessor): the conv halo (`exchange_conv_halos`) and the segment
summaries (`hand_over_states`). Per DSA layer there is one: the keys (`gather_window`), and with
`train_indexer` an all-reduce of the number of queries the KL term averages over. A module with the
override holds the process group, so it cannot be deep-copied.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor, nn

from genomelm.model.dsa import DSAAttention
from genomelm.model.indexer import Selection
from genomelm.model.kda import KDAState, KDAttention

from .exchange import exchange_conv_halos, gather_window, hand_over_states, sum_over_group
from .layout import ZIGZAG, ContextLayout, segments_per_rank

ROUTE_NOTE = " + context parallel"  # appended to a KDA or DSA module's `route` while the override is on
SUMMARY_NOTE = ", cp summaries on "  # before it on a KDA module: where its segment summaries run


@dataclass(frozen=True)
class ContextParallel:
    """A context-parallel group, this rank's place in it, and the layout of the windows it runs."""

    group: dist.ProcessGroup
    kind: str
    cp: int
    rank: int

    @classmethod
    def for_group(cls, group: dist.ProcessGroup, kind: str = ZIGZAG) -> ContextParallel:
        segments_per_rank(kind)  # checks the layout name
        return cls(group, kind, dist.get_world_size(group), dist.get_rank(group))

    @property
    def route_note(self) -> str:
        return f"{ROUTE_NOTE} ({self.kind}, cp {self.cp})"


def _segments_as_batch(t: Tensor, n: int) -> Tensor:
    """[B, n*L, ...] (n segments side by side) -> [n*B, L, ...] (segment-major batch rows)."""
    return t.unflatten(1, (n, -1)).transpose(0, 1).flatten(0, 1)


def _batch_as_segments(t: Tensor, n: int) -> Tensor:
    """Inverse of `_segments_as_batch`: [n*B, L, ...] -> [B, n*L, ...]."""
    return t.unflatten(0, (n, -1)).transpose(0, 1).flatten(1, 2)


def kda_context_parallel_forward(
    layer: KDAttention, context: ContextParallel, x: Tensor, state: KDAState | None = None
) -> tuple[Tensor, KDAState]:
    """`KDAttention.forward` for this rank's part of a window.

    x: [B, S/cp, D], this rank's segments in layout order; state: what precedes the whole window (the same on
    every rank; None: a fresh sequence). The rank's segments run as extra batch rows: projections, halo
    exchange, conv, gates, each segment's summary [M | S_ext], the state hand-over, then the delta rule from
    each segment's incoming state and the output projection. Returns y [B, S/cp, D] and the state after the
    window's last token (the same on every rank; a loss term using it would be counted once per rank).

    On the fla backend the conv, each segment's summary (`fla_segment_summary`: one `chunk_kda` call on packed
    values, no fp64 solve) and the delta rule from the handed-over state run in fla's kernels; the exchanges
    stay these two collectives (fla's own context parallelism is not used: see `fla_segment_summary`).
    """
    seq_len = x.shape[1] * context.cp  # KDA needs segments of whole chunks only (k-pools are DSA's concern)
    layout = ContextLayout(
        seq_len, context.cp, context.rank, context.kind, kda_chunk=layer.chunk_size, kpool=1
    )
    n, batch = segments_per_rank(layout.kind), x.shape[0]
    layer.resolve_backend(x.device)
    note = f"{SUMMARY_NOTE}{layer.summary_route}{context.route_note}"
    if not layer.route.endswith(note):
        layer.route = layer.route.split(ROUTE_NOTE)[0].split(SUMMARY_NOTE)[0] + note
    if state is None:
        state = layer.initial_state(batch, x.dtype, x.device)
    rows = _segments_as_batch(layer.project(x), n)  # [n*B, L, 3W]
    tails = rows[:, rows.shape[1] - (layer.kernel - 1) :].unflatten(0, (n, batch))  # [n, B, K-1, 3W]
    halos, last_rows = exchange_conv_halos(tails, state.conv_tail.transpose(1, 2), layout, context.group)
    q, k, v = layer.convolve(rows, halos.flatten(0, 1), x.dtype)
    g, beta = (_segments_as_batch(t, n) for t in layer.gates(x))
    summaries, transforms = layer.summarise(q, k, v, g, beta)  # [n*B, H, Dk, Dk+Dv]
    incoming, final = hand_over_states(
        summaries.unflatten(0, (n, batch)), state.recurrent, layout, context.group
    )
    core, _ = layer.core(q, k, v, g, beta, incoming.flatten(0, 1), transforms)
    y = layer.output(x, _batch_as_segments(core, n))
    return y, KDAState(final, last_rows.transpose(1, 2))


def dsa_context_parallel_forward(
    layer: DSAAttention,
    context: ContextParallel,
    x: Tensor,
    shared_selection: Selection | None = None,
    selection_cache: dict | None = None,
) -> tuple[Tensor, Selection]:
    """`DSAAttention.forward` for this rank's part of a window: queries stay local, keys are gathered.

    x: [B, S/cp, D], this rank's segments in layout order (segments of whole k-pools). The rank projects its
    tokens (`DSAAttention.project`: queries, the normalised latent, and the indexer's pooled keys when the
    indexer runs), gathers the latent [B, S, kv_lora_rank] and the pooled keys [B, S/kpool, index_head_dim]
    of the whole window in global order (one all-gather; backward: one reduce-scatter), then selects and
    attends for its own queries only, at their global positions (`DSAAttention.attend`). Returns (y [B, S/cp,
    D], the selection of this rank's queries, whose `positions` are global; shared layers reuse it).
    With `train_indexer` the pooled keys keep their graph (their gradient goes back in the same
    reduce-scatter) and `layer.indexer_loss` is this rank's share: its queries' KL sum over the window's query
    count (one all-reduce), so the shares sum over the group to the window's KL term.
    """
    layout = ContextLayout(
        x.shape[1] * context.cp, context.cp, context.rank, context.kind, kda_chunk=1, kpool=layer.kpool
    )
    if not layer.route.endswith(context.route_note):
        layer.route += context.route_note
    q_resid, latent, pool_keys = layer.project(x, layer.needs_pool_keys(selection_cache))
    if pool_keys is None:
        (latent_all,) = gather_window([latent], [layout], context.group)
        pool_keys_all = None
    else:
        latent_all, pool_keys_all = gather_window(
            [latent, pool_keys], [layout, layout.pooled(layer.kpool)], context.group
        )
    return layer.attend(
        x,
        q_resid,
        latent_all,
        pool_keys_all,
        layout.spans(),
        shared_selection,
        selection_cache,
        functools.partial(sum_over_group, group=context.group),
    )


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup, kind: str = ZIGZAG) -> list[str]:
    """Run every KDA and DSA attention module in `model` (the model itself included) context-parallel over
    `group`.

    Returns the names of the modules changed. Applying again replaces the previous settings.
    """
    context = ContextParallel.for_group(group, kind)
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, KDAttention | DSAAttention):
            _drop_override(module)
            parallel_forward = (
                kda_context_parallel_forward
                if isinstance(module, KDAttention)
                else dsa_context_parallel_forward
            )
            module.forward = functools.partial(parallel_forward, module, context)
            changed.append(name)
    return changed


def remove_context_parallel(model: nn.Module) -> list[str]:
    """Undo `apply_context_parallel`: the KDA and DSA modules run their class's forward again. Returns their
    names."""
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, KDAttention | DSAAttention) and _drop_override(module):
            changed.append(name)
    return changed


def _drop_override(module: KDAttention | DSAAttention) -> bool:
    """Remove a context-parallel forward (and its note in `module.route`) if present; say whether there was
    one."""
    if module.__dict__.pop("forward", None) is None:
        return False
    module.route = module.route.split(ROUTE_NOTE)[0].split(SUMMARY_NOTE)[0]
    return True
