"""What the planner's traces record as the step runs on fake tensors: each op's FLOPs and bytes
(`OpCounter`, with formulas for the ops torch's counter does not know), memory by module and moment
(`ModuleTracker`, torch's MemTracker), expert counts of fake routing, and the host copies of the offload; and
the per-part figures read from them afterwards."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker, _ModState
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, shape_wrapper

from genomelm.model import GlmForCausalLM
from genomelm.plan.roofline import OpLog, source_line
from genomelm.train.memory import HostCopier, Packed

CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")
COLLECTIVES = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",  # into a list of tensors (the scorer's per-token losses)
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "alltoall_base_": "all_to_all",
}


class ExpertCountShape(TorchDispatchMode):
    """`aten.bincount(ids, minlength=E)` as a zero tensor of length E: fake tensors cannot know a bincount's
    length, and expert ids are always < E."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.bincount.default:
            minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            return torch.zeros(minlength, dtype=torch.long, device=args[0].device)
        return func(*args, **kwargs)


class MetaHostCopier(HostCopier):
    """Offload target for the trace: the host copy lives on the meta device (MemTracker counts it apart)."""

    def to_host(self, tensor: torch.Tensor) -> Packed:
        self.bytes_offloaded += tensor.numel() * tensor.element_size()
        return tensor.device, tensor.detach().to("meta")

    def to_device(self, packed: Packed) -> torch.Tensor:
        device, host = packed
        return torch.empty(host.shape, dtype=host.dtype, device=device)


class OpCounter(TorchDispatchMode):
    """FLOPs (torch's `FlopCounterMode` formulas, `flop_registry`) and bytes per collective (the largest
    tensor argument: what one rank sends or receives), attributed to the decoder layer whose forward,
    recompute or backward runs them (`where()` names it). Counted in the memory-tracked pass itself: one pass,
    not two."""

    def __init__(self, where: Any) -> None:
        super().__init__()
        self.where = where
        self.bytes: dict[str, dict[str, int]] = {}
        self.flops: dict[str, int] = {}
        self.expert_flops: dict[str, int] = {}  # of them, the routed experts' grouped GEMMs
        self.ops = OpLog()  # every kernel by op class, for the roofline (`genomelm.plan.roofline`)
        self.updating = False  # the update phase: its kernels go to the part "update"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        formula = flop_formula(packet)
        part, flops = self.where(), 0
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            self.flops[part] = self.flops.get(part, 0) + flops
            if packet is torch.ops.aten._grouped_mm:
                self.expert_flops[part] = self.expert_flops.get(part, 0) + flops
        self.ops.record("update" if self.updating else part, func, args, kwargs, out, flops)
        kind = COLLECTIVES.get(func._opname) if func.namespace == "c10d" else None
        if kind is not None:
            tensors = [
                t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
            ]
            size = max(t.numel() * t.element_size() for t in tensors)
            if func._opname == "allgather_":  # the gathered whole, as for `_allgather_base_`'s output
                size = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(args[0]))
            slot = self.bytes.setdefault(self.where(), {})
            slot[kind] = slot.get(kind, 0) + size
        return out


class ModuleTracker(MemTracker):
    """MemTracker whose per-operation peak update visits only the active modules (the stock one walks every
    module it has seen, once per operation): the same numbers, faster. It also keeps, for each module
    `transients` names, its forward's peak moments by the code running then (`moments`: the innermost
    module and the genomelm function)."""

    def __init__(self) -> None:
        super().__init__()
        self._by_name: dict[str, Any] = {}
        self.moments: dict[str, dict[str, int]] = {}  # module fqn -> "innermost module fqn:function" -> bytes

    def _update_peak_stats(self, peak_state: Any) -> None:
        if len(self._by_name) != len(self.memory_tracking):
            self._by_name = {stats.mod_fqn: stats for stats in self.memory_tracking.values()}
        by_name = self._by_name
        current = self._curr_mem_snap
        parents = self._mod_tracker.parents
        for name in parents:
            stats = by_name.get(name)
            if stats is None or peak_state not in stats.snapshots:
                continue
            for dev, snap in current.items():
                if stats.local_peak.get(dev, 0) < snap["Total"]:
                    stats.local_peak[dev] = snap["Total"]
                    stats.snapshots[peak_state][-1][dev] = dict(snap)
            if peak_state == _ModState.PEAK_FW and module_key(name, None) is not None:
                self._note_moment(name, stats, parents, current)
        for dev, snap in current.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)

    def _note_moment(self, name: str, stats: Any, parents: Any, current: dict) -> None:
        """The forward of module `name` is running: its live bytes over its start, kept as the largest of the
        moments when the same code ran: the innermost running module (itself, or a descendant) and the
        genomelm function that issued the op (a module's per-block loops are functions of their own)."""
        module = max((p for p in parents if p.startswith(name + ".")), key=len, default=name)
        inner = f"{module}:{source_line()[1]}"
        starts = stats.snapshots[_ModState.PRE_FW]
        if not starts:
            return
        moments = self.moments.setdefault(name, {})
        for dev, snap in current.items():
            start = starts[-1].get(dev, {}).get("Total", 0)
            moments[inner] = max(moments.get(inner, 0), snap["Total"] - start)


def grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of `torch._grouped_mm` (FlopCounterMode has no formula for it): each row meets one group's
    matrix, so 2 x output elements x inner size; for the weight gradient ([M, T] x [T, N] -> [G, M, N]) each
    token's column counts once: 2 x M x N x T."""
    if len(out_shape) == 3 and len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * out_shape[1] * out_shape[2] * a_shape[-1]
    return 2 * math.prod(out_shape) * a_shape[-1]


GROUPED_MM_FLOPS = shape_wrapper(grouped_mm_flops)


def flop_formula(packet: Any) -> Callable[..., int] | None:
    """The FLOP formula of an op (its overload packet): torch's `FlopCounterMode` one (`flop_registry`: a
    custom op's `register_flop_formula` too, looked up at each call, as a kernel module imported during a
    step registers its formula then), the grouped GEMM's `grouped_mm_flops`; None without one."""
    return GROUPED_MM_FLOPS if packet is torch.ops.aten._grouped_mm else flop_registry.get(packet)


def snapshot_total(tracker: MemTracker, device: torch.device) -> int:
    return tracker.get_tracker_snapshot().get(device, {}).get("Total", 0)


def categories(snapshot: dict[Any, int]) -> dict[str, int]:
    return {
        str(getattr(k, "value", k)): int(v)
        for k, v in snapshot.items()
        if str(getattr(k, "value", k)) in CATEGORIES
    }


def numel_by_part(model: GlmForCausalLM, names: dict[nn.Module, str]) -> dict[str, int]:
    out = {name: sum(p.numel() for p in layer.parameters()) for layer, name in names.items()}
    out["rest"] = sum(p.numel() for p in model.parameters()) - sum(out.values())
    return out


def flops_by_part(counter: OpCounter, names: dict[nn.Module, str]) -> dict[str, int]:
    out = {name: counter.flops.get(name, 0) for name in names.values()}
    out["rest"] = sum(counter.flops.values()) - sum(out.values())
    return out


def transients(tracker: MemTracker, device: torch.device, names: dict[nn.Module, str]) -> dict[str, int]:
    """Each traced layer's attention and feed-forward module, and the head: peak minus start, forward or
    backward, whichever is larger."""
    out = {}
    for stats in tracker.memory_tracking.values():
        fqn = module_key(stats.mod_fqn, names)
        if fqn is None:
            continue
        best = 0
        for start, peak in (("Pre-Forward", "Peak-Forward"), ("Pre-Backward", "Peak-Backward")):
            starts = [s.get(device, {}).get("Total", 0) for s in states(stats, start)]
            peaks = [s.get(device, {}).get("Total", 0) for s in states(stats, peak)]
            for a, b in zip(starts, peaks):
                best = max(best, b - a)
        out[fqn] = best
    return out


def starts(tracker: MemTracker, device: torch.device, names: dict[nn.Module, str]) -> dict[str, int]:
    """Each traced layer's attention and feed-forward module, and the head: the activation, temporary and
    other bytes live as its first forward starts (what the module's transient comes on top of)."""
    out = {}
    for stats in tracker.memory_tracking.values():
        fqn = module_key(stats.mod_fqn, names)
        starts = states(stats, "Pre-Forward")
        if fqn is not None and starts:
            snapshot = categories(starts[0].get(device, {}))
            out[fqn] = sum(snapshot.get(k, 0) for k in ("Activation", "Temp", "Other"))
    return out


def module_key(mod_fqn: str, names: dict[nn.Module, str] | None) -> str | None:
    """A tracked module's name as `transients` keys it ("layers.<i>.self_attn" / ".mlp" in the full model's
    numbering, "lm_head"), or None for the other modules (`names` None: whether it is one, by its own fqn)."""
    fqn = mod_fqn.removeprefix("GlmForCausalLM.")
    parts = fqn.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in ("self_attn", "mlp"):
        return fqn if names is None else part_of(fqn, names)
    return fqn if fqn == "lm_head" else None


def moments(tracker: ModuleTracker, names: dict[nn.Module, str]) -> dict[str, dict[str, int]]:
    """`ModuleTracker.moments` keyed as `transients` is, each moment by the innermost module relative to its
    module ("" for the module's own code) and the function running ("indexer:score_blocks")."""
    out = {}
    for fqn, moments in tracker.moments.items():
        key = module_key(fqn, names)
        if key is not None:
            out[key] = {inner.removeprefix(fqn).removeprefix("."): v for inner, v in moments.items()}
    return out


def recomputed(tracker: MemTracker, device: torch.device, names: dict[nn.Module, str]) -> dict[str, int]:
    """Each traced layer's feed-forward module: what its recompute (MemTracker's forward states inside the
    backward) left live."""
    out = {}
    for stats in tracker.memory_tracking.values():
        fqn = stats.mod_fqn.removeprefix("GlmForCausalLM.")
        parts = fqn.split(".")
        if len(parts) != 3 or parts[0] != "layers" or parts[2] != "mlp":
            continue
        starts = [s.get(device, {}).get("Total", 0) for s in states(stats, "Pre-Forward-AC")]
        ends = [s.get(device, {}).get("Total", 0) for s in states(stats, "Post-Forward-AC")]
        if starts:
            out[part_of(fqn, names)] = sum(b - a for a, b in zip(starts, ends))
    return out


def part_of(fqn: str, names: dict[nn.Module, str]) -> str:
    """A module name of the traced model ("layers.<j>...") as named in the full model ("layers.<i>...")."""
    by_index = {layer.layer_idx: name for layer, name in names.items()}
    _, index, *rest = fqn.split(".")
    return ".".join([by_index[int(index)], *rest])


def states(stats: Any, name: str) -> list[dict]:
    for state, snaps in stats.snapshots.items():
        if str(getattr(state, "value", state)) == name:
            return snaps
    return []
