"""What a step would do on GPUs with NCCL, watched on fake CUDA tensors: every collective checked against
NCCL's rules and recorded, every host sync found.

`SimulationMode` is a `TorchDispatchMode` entered inside torch's `FakeTensorMode` (and, on a CPU-only build,
inside a fake-CUDA process: `genomelm.parallel.fake_cuda`), around code that runs on torch's fake process
group ("fake" backend: collectives return at once, without peers, and accept anything). It adds what NCCL and
the GPU would impose:
- **collectives** (the c10d ops): every tensor on the group's device (`device_type`), contiguous, of a dtype
  NCCL takes; a violation raises `CollectiveError` naming the collective, the group, the tensor and the Python
  line that issued it. Each collective is recorded (`Collective`: kind, group ranks, dtype, bytes, site) so
  the ranks' sequences can be compared (`check_ranks_agree`) and the bytes counted;
- **host syncs** (`HostSync`): a value read of a device tensor (`.item()`, `float()`, `.tolist()`, `if t`),
  a copy between the device and the host (`.cpu()`, `.to("cuda")` of a host tensor, `torch.tensor(...,
  device="cuda")`), and an op whose output size depends on the data (`nonzero`, boolean indexing,
  `repeat_interleave` without `output_size`): each stops the host until the GPU's queue drains.

Fake tensors hold no values, but a few small integer tensors steer the code (the expert all-to-all's split
sizes come from the routing counts). So integer and bool tensors of up to `SHADOW_NUMEL` elements carry real
values here ("shadows", computed on the CPU beside the fake op): factories, ops of shadowed inputs, and the
collectives over them with every rank assumed alike. The routing counts themselves (`aten.bincount` with
`minlength`, whose output length fake tensors cannot know) are the balanced counts: each expert receives its
share of the (token, expert) pairs, as when the router spreads tokens evenly. A value read of a tensor without
a shadow returns a placeholder (0), and the sync is still recorded.
"""

from __future__ import annotations

import itertools
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakTensorKeyDictionary

# the dtypes ProcessGroupNCCL maps to an ncclDataType_t (bool travels as uint8)
NCCL_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    }
)
COLLECTIVE_KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "broadcast_": "broadcast",
    "send": "send",
    "recv_": "recv",
    "barrier": "barrier",
}
# collectives whose tensors must have the same shape on every rank (all-to-all sizes may differ)
SAME_SHAPE_KINDS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast"})
SHADOW_NUMEL = 1 << 16
_PACKAGE = Path(__file__).resolve().parents[1]  # genomelm/
# the place of each recorded event (collective or host sync) in the order the host issued them, this process
_ISSUED = itertools.count()
_THIS = Path(__file__).resolve()


class CollectiveError(RuntimeError):
    """A collective NCCL would reject (or that would deadlock the ranks)."""

    exit_code = 1  # the machine's failure (`genomelm.run.failures`)


class SimulationError(RuntimeError):
    """An op the simulation cannot size (its output depends on values it does not have)."""

    exit_code = 1  # the machine's failure (`genomelm.run.failures`)


@dataclass(frozen=True)
class Collective:
    """One collective as issued by this rank: kind, group (global ranks), dtype, bytes this rank sends or
    receives (its largest tensor), the shapes of its tensors, the source line, the phase it ran in, and
    whether it was started without waiting (`async_op`: on a GPU it runs on NCCL's stream beside the compute
    until the caller waits for its work); `issued`: its place among this process's recorded collectives and
    host syncs, in the order the host reached them (the order the GPU's streams are handed their work)."""

    kind: str
    ranks: tuple[int, ...]
    dtype: str
    bytes: int
    shapes: tuple[tuple[int, ...], ...]
    site: str
    phase: str
    started_ahead: bool = False
    issued: int = field(default_factory=lambda: next(_ISSUED), compare=False)


@dataclass(frozen=True)
class HostSync:
    """A point where the host waits for the device: kind ("value read", "device-to-host copy", "host-to-device
    copy", "data-dependent shape"), the aten op, the source line, the phase, and its place among the recorded
    events (`Collective.issued`)."""

    kind: str
    op: str
    site: str
    phase: str
    issued: int = field(default_factory=lambda: next(_ISSUED), compare=False)


def source_line() -> str:
    """The innermost line of the caller's code on the stack (not this module, not an installed package):
    "genomelm/x.py:12 in f"."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path == _THIS or "site-packages" in path.parts or path.parts[-1].startswith("<"):
            continue
        shown = path.relative_to(_PACKAGE.parent) if path.is_relative_to(_PACKAGE.parent) else path
        return f"{shown}:{frame.lineno} in {frame.name}"
    return "unknown"


def _async_op(func: Any, args: tuple, kwargs: dict) -> bool:
    """The `async_op` argument of a c10d collective op (torch.distributed passes false for a blocking call;
    the schema's default is true)."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == "async_op":
            return bool(kwargs.get("async_op", args[index] if index < len(args) else argument.default_value))
    return False


def _group_of(args: Sequence[Any]) -> dist.ProcessGroup | None:
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
            return dist.ProcessGroup.unbox(arg)
    return None


def _is_fake(value: Any) -> bool:
    return isinstance(value, FakeTensor)


def _tensors(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    tree_map(lambda t: out.append(t) if isinstance(t, torch.Tensor) else None, value)
    return out


def _caller_stack() -> str:
    """The Python stack without this module's and installed packages' frames."""
    frames = [
        frame
        for frame in traceback.extract_stack()
        if Path(frame.filename).resolve() != _THIS and "site-packages" not in Path(frame.filename).parts
    ]
    return "".join(traceback.format_list(frames[-12:]))


class SimulationMode(TorchDispatchMode):
    """Checks and records collectives and host syncs of the code run inside it (see the module docstring).

    device_type: where NCCL wants every collective's tensors ("cuda"; "cpu" to watch a gloo-like run);
    phase: names the part of the step running now (recorded with each event).
    """

    def __init__(self, device_type: str = "cuda", phase: Callable[[], str] = lambda: "step") -> None:
        super().__init__()
        self.device_type, self.phase = device_type, phase
        self.collectives: list[Collective] = []
        self.syncs: list[HostSync] = []
        self.unknown_values = 0  # value reads answered with the placeholder (0)
        self.last_read: tuple[str, weakref.ref] | None = None  # the last value read: its line and tensor
        self.shadows = WeakTensorKeyDictionary()
        self.pinned = WeakTensorKeyDictionary()  # fake host tensors made by pin_memory()

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            return self._collective(func, args, kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            return self._value_read(func, args[0])
        if func is torch.ops.aten.bincount.default and isinstance(args[0], FakeTensor):
            return self._balanced_counts(args, kwargs)
        if func is torch.ops.aten._pin_memory.default and isinstance(args[0], FakeTensor):
            pinned = torch.empty_like(args[0])  # fake tensors have no pinned memory: a host tensor marked so
            self.pinned[pinned] = True
            return pinned
        self._note_copy(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:
            return self._data_dependent(func, args, kwargs)
        if func is _REPEAT_INTERLEAVE and not kwargs.get("output_size"):  # its length is data
            self._sync("data-dependent shape", func)
        if isinstance(out, FakeTensor) or (isinstance(out, tuple | list) and any(map(_is_fake, out))):
            self._shadow(func, args, kwargs, out)
        return out

    # ------------------------------------------------------------------ host syncs
    def _sync(self, kind: str, func: Any) -> None:
        self.syncs.append(HostSync(kind, str(func.overloadpacket.__name__), source_line(), self.phase()))

    def _value_read(self, func: Any, tensor: torch.Tensor) -> Any:
        if tensor.device.type != "cpu":
            # `.tolist()` reads element by element (views of one tensor): reads of one tensor from one line
            # are one copy. Held by a weak reference, not by storage address: a freed tensor's address is
            # reused by the next one, whose read is another copy.
            owner = tensor._base if tensor._base is not None else tensor
            site = source_line()
            if self.last_read is None or self.last_read[0] != site or self.last_read[1]() is not owner:
                self._sync("value read", func)
            self.last_read = (site, weakref.ref(owner))
        if not isinstance(tensor, FakeTensor):  # a real tensor: its own value
            return func(tensor)
        shadow = self.shadows.get(tensor)
        if shadow is not None:
            with unset_fake_temporarily():
                return shadow.item()
        self.unknown_values += 1
        if tensor.dtype.is_floating_point:
            return 0.0
        return False if tensor.dtype == torch.bool else 0

    def _note_copy(self, func: Any, args: tuple, kwargs: dict) -> None:
        if func is torch.ops.aten._to_copy.default:
            host, source, target = args[0], args[0].device, kwargs.get("device")
            asked_async = kwargs.get("non_blocking", False)
        elif func is torch.ops.aten.copy_.default:
            host, source, target = args[1], args[1].device, args[0].device
            asked_async = len(args) > 2 and args[2]
        else:
            return
        # a host-to-device copy is asynchronous only from pinned memory (from pageable memory CUDA stages it)
        blocking = not (asked_async and (not isinstance(host, FakeTensor) or host in self.pinned))
        if target is None or torch.device(target).type == source.type:
            return
        if source.type == "cpu" and torch.device(target).type != "meta":
            if blocking:
                self._sync("host-to-device copy", func)
        elif torch.device(target).type == "cpu":
            self._sync("device-to-host copy", func)

    def _data_dependent(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op whose output size depends on values: sized from the shadows, else refused."""
        shadow_args = self._shadow_args(args, kwargs)
        if shadow_args is None:
            raise SimulationError(
                f"{func} at {source_line()}: its output size depends on values the simulation does not "
                "have (a host sync on a GPU); give the size (output_size=...) or keep the shape static"
            )
        self._sync("data-dependent shape", func)
        with unset_fake_temporarily():
            real = func(*shadow_args[0], **shadow_args[1])
        device = next(t.device for t in _tensors(args) if t.device.type != "cpu")
        out = tree_map(lambda t: self._fake_like(t, device) if isinstance(t, torch.Tensor) else t, real)
        return out

    def _fake_like(self, real: torch.Tensor, device: torch.device) -> torch.Tensor:
        fake = torch.empty(real.shape, dtype=real.dtype, device=device)
        self.shadows[fake] = real
        return fake

    # ------------------------------------------------------------------ shadow values
    def _shadow_args(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """args and kwargs with every tensor replaced by its shadow and devices by the CPU; None when a
        tensor has none."""
        missing = False

        def swap(value: Any) -> Any:
            nonlocal missing
            if isinstance(value, torch.Tensor):
                shadow = self.shadows.get(value)
                if shadow is None:
                    missing = True
                return shadow
            return torch.device("cpu") if isinstance(value, torch.device) else value

        new_args, new_kwargs = tree_map(swap, args), tree_map(swap, kwargs)
        if "device" in new_kwargs:
            new_kwargs["device"] = torch.device("cpu")
        return None if missing else (new_args, new_kwargs)

    def _shadow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        outputs = _tensors(out)
        if not outputs or not self._small_integers(outputs):
            self._drop_written(func, args)
            return
        inputs = _tensors((args, kwargs))
        if inputs and not all(t in self.shadows for t in inputs):
            self._drop_written(func, args)
            return
        swapped = self._shadow_args(args, kwargs)
        if swapped is None:
            return
        try:
            with unset_fake_temporarily():
                real = func(*swapped[0], **swapped[1])
        except Exception:  # a CPU-only restriction of the op: the value stays unknown
            self._drop_written(func, args)
            return
        for fake, value in zip(outputs, _tensors(real)):
            self.shadows[fake] = value

    def _small_integers(self, tensors: list[torch.Tensor]) -> bool:
        return all(
            (not t.dtype.is_floating_point and not t.dtype.is_complex) and t.numel() <= SHADOW_NUMEL
            for t in tensors
        )

    def _drop_written(self, func: Any, args: tuple) -> None:
        """A tensor an op wrote in place whose new value is unknown loses its shadow."""
        if not func._schema.is_mutable:
            return
        for argument, value in zip(func._schema.arguments, args):
            if argument.alias_info is not None and argument.alias_info.is_write:
                for tensor in _tensors(value):
                    self.shadows.pop(tensor, None)

    def _balanced_counts(self, args: tuple, kwargs: dict) -> torch.Tensor:
        ids = args[0]
        length = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
        if not length:
            raise SimulationError(f"aten.bincount without minlength at {source_line()}: its length is data")
        share, extra = divmod(ids.numel(), length)
        with unset_fake_temporarily():
            real = torch.full((length,), share, dtype=torch.long)
            real[:extra] += 1
        return self._fake_like(real, ids.device)

    # ------------------------------------------------------------------ collectives
    def _collective(self, func: Any, args: tuple, kwargs: dict) -> Any:
        kind = COLLECTIVE_KINDS.get(func._opname, func._opname)
        group = _group_of(args)
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        tensors = _tensors((args, kwargs))
        for tensor in tensors:
            problem = self._nccl_problem(tensor)
            if problem:
                raise CollectiveError(
                    f"{kind} over ranks {list(ranks)} at {source_line()}: a {tuple(tensor.shape)} "
                    f"{tensor.dtype} tensor on {tensor.device} {problem}\n" + _caller_stack()
                )
        size = max((t.numel() * t.element_size() for t in tensors), default=0)
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else ""
        shapes = tuple(tuple(t.shape) for t in tensors)
        issued = Collective(
            kind, ranks, dtype, size, shapes, source_line(), self.phase(), _async_op(func, args, kwargs)
        )
        self.collectives.append(issued)
        shadows_in = {t: self.shadows.get(t) for t in tensors}
        out = func(*args, **kwargs)
        self._shadow_collective(kind, tensors, shadows_in, len(ranks) or 1)
        return out

    def _nccl_problem(self, tensor: torch.Tensor) -> str:
        if tensor.device.type != self.device_type:
            return f"(NCCL takes {self.device_type} tensors only)"
        if not tensor.is_contiguous():
            return "that is not contiguous (NCCL sends a contiguous buffer)"
        if tensor.dtype not in NCCL_DTYPES:
            return f"(NCCL has no {tensor.dtype})"
        return ""

    def _shadow_collective(self, kind: str, tensors: list[torch.Tensor], before: dict, world: int) -> None:
        """Shadows through a collective with every rank holding the same values: all-reduce sums world
        copies, all-gather repeats, reduce-scatter sums world copies of this rank's slice."""
        known = all(value is not None for value in before.values())
        with unset_fake_temporarily():
            self._shadow_through(kind, tensors, before, world, known)

    def _shadow_through(
        self, kind: str, tensors: list[torch.Tensor], before: dict, world: int, known: bool
    ) -> None:
        if kind == "all_reduce" and known:
            for tensor in tensors:
                self.shadows[tensor] = before[tensor] * world
            return
        if kind == "all_gather" and len(tensors) == 2 and known:
            out, local = tensors
            self.shadows[out] = before[local].reshape(1, -1).repeat(world, 1).reshape(out.shape)
            return
        if kind == "reduce_scatter" and len(tensors) == 2 and known:
            out, whole = tensors
            self.shadows[out] = before[whole].reshape(world, -1)[0].reshape(out.shape) * world
            return
        for tensor in tensors:  # outputs of other collectives hold values the simulation does not know
            self.shadows.pop(tensor, None)


_REPEAT_INTERLEAVE = torch.ops.aten.repeat_interleave.Tensor


def check_ranks_agree(per_rank: Sequence[Sequence[Collective]]) -> None:
    """The collectives every rank issued, in order, must pair up within each group: the same count, kind and
    dtype per group, and the same shapes where NCCL needs them; else `CollectiveError` naming the first
    difference (on GPUs: a hang, or data read as the wrong type)."""
    by_group: dict[tuple[int, ...], dict[int, list[Collective]]] = {}
    for rank, collectives in enumerate(per_rank):
        for collective in collectives:
            by_group.setdefault(collective.ranks, {}).setdefault(rank, []).append(collective)
    for ranks, issued in by_group.items():
        members = [r for r in ranks if r < len(per_rank)]
        sequences = [issued.get(r, []) for r in members]
        first = sequences[0]
        for rank, sequence in zip(members[1:], sequences[1:]):
            if len(sequence) != len(first):
                raise CollectiveError(
                    f"group {list(ranks)}: rank {members[0]} issues {len(first)} collectives, rank {rank} "
                    f"{len(sequence)} (the group would hang)"
                )
            for i, (a, b) in enumerate(zip(first, sequence)):
                same_shape = a.kind not in SAME_SHAPE_KINDS or a.shapes == b.shapes
                if a.kind != b.kind or a.dtype != b.dtype or not same_shape:
                    raise CollectiveError(
                        f"group {list(ranks)}, collective {i}: rank {members[0]} issues {a.kind} {a.dtype} "
                        f"{a.shapes} at {a.site}, rank {rank} {b.kind} {b.dtype} {b.shapes} at {b.site}"
                    )
