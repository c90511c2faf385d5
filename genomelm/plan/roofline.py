"""The roofline projection of a traced step, op by op.

Every kernel the traced step dispatches (aten ops and the project's `genomelm::` custom ops) is recorded by
op class (`OpClass`: op, dtype, the unit it runs on, the source line inside genomelm/ that issued it) with
its count, FLOPs and bytes, and costed as
    time = max(FLOPs / the class's attainable FLOP/s, bytes / attainable HBM bandwidth) + launch,
at the rates of `rates.RATES` (one table, each rate with its public source; `rate_key` picks a class's row).
Collectives run on the link of their group with the ring factor of their kind (`collective_seconds`).
`project` reads the op classes of two traces (t1, t2 tokens per rank) at the rank's tokens: each class's count
and its per-op FLOPs and bytes on the line through the two traces, so a Python loop over query blocks
(count ~ t, size ~ t) grows as t^2 and a weight matmul (count fixed, size ~ t) as t.

FLOPs come from torch's `FlopCounterMode` formulas (`flop_registry`: a custom op registered with
`register_flop_formula` is found there), bytes from a custom op's own `<name>_bytes(*args, **kwargs)` in the
module that defines it (called with the op's own arguments), else from the sizes of every tensor the op reads
and writes (broadcast dimensions counted once). Views and allocations launch no kernel and cost nothing.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils._pytree import tree_leaves

from genomelm.model.moe import Experts
from genomelm.plan.rates import Peaks, ring_factor

OVERLAP_RULE = (
    "per layer and pass (genomelm/plan/overlap.py): FSDP2's all-gathers (no forward prefetch: the next "
    "layer's gather issued at each MoE forward's host sync hides behind that MoE's work alone; one layer "
    "ahead in the backward) and reduce-scatters share one link, FIFO, the NICs shared by the groups using "
    "them; their copy-outs on the compute stream; the layer inputs come back over PCIe (with the GPU's share "
    "of its NIC traffic) from the layer before's start, the layer waiting for them; compute beside a "
    "collective slowed by comm_sm_share; with ep_overlap the expert all-to-alls started ahead hide under the "
    "MoE work; the context-parallel collectives, the backward's expert dispatches and the host work add up. "
    "The evaluator's forward: side-stream work hidden under the whole compute"
)
# Matmul-like ops: they run on the matmul unit of their dtype (the other ops are costed by their bytes).
MATMULS = {
    "aten.mm",
    "aten.bmm",
    "aten.addmm",
    "aten.baddbmm",
    "aten._grouped_mm",
    "aten._scaled_mm",
    "aten._scaled_grouped_mm",
    "aten.convolution",
    "aten.convolution_backward",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._flash_attention_forward",
    "aten._flash_attention_backward",
}
# Ops that launch no kernel: allocations and metadata (views are found from their schema).
NO_KERNEL = {
    "aten.empty",
    "aten.empty_strided",
    "aten.new_empty",
    "aten.new_empty_strided",
    "aten.empty_like",
    "aten.lift_fresh",
    "aten._unsafe_view",
    "aten._reshape_alias",
    "aten.alias",
    "aten.sym_size",
    "aten.sym_stride",
    "aten.sym_numel",
    "aten.sym_storage_offset",
    "aten.is_same_size",
    "aten._local_scalar_dense",
    "aten.set_",
    "aten.record_stream",
    "aten.resize_",
}
# the project's kernels (`genomelm::`) and fla's stand-ins (`genomelm_simulation::`, train/fla_stand_in.py):
# FLOPs from their registered formulas on the unit of their dtype, bytes from their own `<op>_bytes`
CUSTOM_NAMESPACES = ("genomelm", "genomelm_simulation")
FP8 = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
_ROOT = Path(__file__).resolve().parents[1]  # genomelm/
_SKIPPED = {str(_ROOT / "plan" / name) for name in ("roofline.py", "trace.py", "recording.py")}


@dataclass
class OpClass:
    """Ops of one kind (op, dtype, unit) issued by one source line, in one part of the step: their count and
    their summed FLOPs and bytes (`recompute_flops`: of them, those the backward's recompute ran)."""

    op: str  # "aten.mm", "genomelm.sparse_mla"
    dtype: str  # of the first floating tensor it reads ("bf16", "fp32", ...)
    unit: str  # "bf16" | "fp8" | "tf32" | "fp32" (matmul units) | "memory" (bound by bytes alone)
    where: str  # "genomelm/model/moe.py:123" (a backward op: its forward's line, "backward of ...")
    count: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    recompute_flops: float = 0.0
    recompute_count: int = 0  # of `count`, those the backward's recompute ran
    atomic_bytes: float = 0.0  # of `bytes`, those read-modify-written by scattered atomic adds
    select_bytes: float = 0.0  # of `bytes`, a top-k's input (read once per pass: `Peaks.topk_passes`)
    # the routed experts' work (`expert_work`): "rows" (the busiest expert-parallel rank runs `imbalance` x
    # the mean), "weights" (per local expert: E/ep of them, none where FSDP2 gathers them in bf16), or ""
    expert: str = ""

    @property
    def key(self) -> str:
        return f"{self.op} {self.dtype} @ {self.where}"


_DTYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8e5",
}


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's distinct elements (a broadcast, stride-0 dimension counted once)."""
    n = math.prod(size for size, stride in zip(t.shape, t.stride()) if stride != 0 or size == 1)
    return n * t.element_size()


def _unit(op: str, dtype: torch.dtype | None, custom: bool) -> str:
    if not custom and op not in MATMULS or dtype is None:
        return "memory"
    if dtype in FP8:
        return "fp8"
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def _custom_bytes(func: Any, args: tuple, kwargs: dict) -> float | None:
    """A `genomelm::<name>` op's own byte estimate: `<name>_bytes(*args, **kwargs)` of the module that defines
    the op, or None when it has none."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(f"{func.namespace}::{func._opname}")
    module = sys.modules.get(getattr(getattr(opdef, "_init_fn", None), "__module__", ""), None)
    if module is None:
        return None
    estimate = getattr(module, f"{func._opname}_bytes", None)
    if estimate is None:
        return None
    try:
        inspect.signature(estimate).bind(*args, **kwargs)
    except TypeError as error:
        raise ValueError(
            f"{module.__name__}.{func._opname}_bytes must take the op's own arguments {func._schema}: {error}"
        ) from None
    moved = estimate(*args, **kwargs)
    if not isinstance(moved, (int, float)):
        raise ValueError(f"{module.__name__}.{func._opname}_bytes must return one number, not {moved!r}")
    return float(moved)


def is_kernel(func: Any) -> bool:
    """Whether an op launches a kernel: not a view (an aliasing, non-writing return), an allocation, metadata
    or a collective (costed on its link)."""
    if func.namespace in ("c10d", "_c10d_functional", "prim", "profiler"):
        return False
    name = f"{func.namespace}.{func._opname}"
    if name in NO_KERNEL:
        return False
    returns = func._schema.returns
    return not (returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns))


def sparse_mla_bwd_atomics(
    grad_out: torch.Tensor,
    q_lat: torch.Tensor,
    latent: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pools: torch.Tensor,
    positions: torch.Tensor,
    kpool: int,
    select_tail: bool,
    *_: object,
) -> float:
    """Of `dsa_triton.sparse_mla_bwd_bytes`, the fp32 read-modify-writes of the d latent buffer: one per
    slot row, head block and latent column of every query (its atomic adds)."""
    from genomelm.model.dsa_triton import BACKWARD_TILES, slot_count

    batch, queries, heads, width = q_lat.shape
    slots = slot_count(pools.shape[-1], kpool, select_tail)
    return 2.0 * batch * queries * math.ceil(heads / BACKWARD_TILES.block_h) * slots * width * 4


ATOMICS = {"genomelm.sparse_mla_bwd": sparse_mla_bwd_atomics}  # kernels whose bytes hold atomic adds
TOPK = {"aten.topk"}  # radix-select top-k: its input read once per pass


def special_bytes(name: str, args: tuple, kwargs: dict) -> tuple[float, float]:
    """(atomic bytes, top-k input bytes) of a kernel's bytes (`ATOMICS`, `TOPK`); 0 for the others."""
    if name in ATOMICS:
        return ATOMICS[name](*args, **kwargs), 0.0
    if name in TOPK:
        return 0.0, float(_tensor_bytes(args[0]))
    return 0.0, 0.0


def op_record(func: Any, args: tuple, kwargs: dict, out: Any, flops: float) -> tuple[str, str, str, float]:
    """(op name, dtype, unit, bytes) of one dispatched kernel with its `flops` (0 without a formula)."""
    name = f"{func.namespace}.{func._opname}"
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    dtype = next((t.dtype for t in inputs if t.is_floating_point()), None)
    custom = func.namespace in CUSTOM_NAMESPACES
    moved = _custom_bytes(func, args, kwargs) if custom else None
    if moved is None:
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        moved = float(sum(_tensor_bytes(t) for t in inputs + outputs))
    unit = _unit(name, dtype, custom) if flops > 0 or name in MATMULS else "memory"
    return name, _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")), unit, moved


_FRAME_FILES: dict[Any, str | None] = {}  # code object -> its file relative to the repository, or None


_RECOMPUTE = (torch.utils.checkpoint.__file__, "recompute_fn")  # non-reentrant checkpoint's recompute
_EXPERT_ROWS, _EXPERT_WEIGHTS = Experts.expert_rows.__code__, Experts.weights_in.__code__
_EXPERT_FILES = ("genomelm/model/moe.py", "genomelm/model/mlp.py")  # where expert_rows's kernels are issued
MOE_FILES = ("genomelm/model/moe.py", "genomelm/model/mlp.py", "genomelm/parallel/expert.py")  # a MoE block
_MODEL_FILES = ("genomelm/model", "genomelm/parallel")  # a backward op issued here is a Python backward
_STAND_IN_FILES = ("genomelm/plan/fla_stand_in.py",)  # fla's kernels as the model calls them (traced)


def in_recompute() -> bool:
    """Whether the calling op runs in a checkpointed layer's recompute (a frame of checkpoint's
    `recompute_fn` on the stack), not in a backward proper (autograd's, or a custom op's Python backward)."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_filename, frame.f_code.co_name) == _RECOMPUTE:
            return True
        frame = frame.f_back
    return False


def expert_work(where: str | None) -> str:
    """What routed-expert work the calling op does: "weights" inside `Experts.weights_in` (a cast of the
    experts' weights: per expert), "rows" elsewhere inside `Experts.expert_rows` (per row it computes), else
    "". `where`: the op's `source_line`; only an op issued from the experts' own files is looked into."""
    if where is None or not where.startswith(_EXPERT_FILES):
        return ""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _EXPERT_WEIGHTS:
            return "weights"
        if frame.f_code is _EXPERT_ROWS:
            return "rows"
        frame = frame.f_back
    return ""


def source_line() -> tuple[str | None, str]:
    """The first frame of the Python stack inside genomelm/ (the recording modules skipped), as
    ("genomelm/model/moe.py:123", its function's name), or (None, "") when no frame is."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        where = _FRAME_FILES.get(code, "")
        if where == "":
            path = code.co_filename
            inside = path.startswith(str(_ROOT)) and path not in _SKIPPED
            where = _FRAME_FILES[code] = str(Path(path).relative_to(_ROOT.parent)) if inside else None
        if where is not None:
            return f"{where}:{frame.f_lineno}", code.co_name
        frame = frame.f_back
    return None, ""


class SourceTags(torch.overrides.TorchFunctionMode):
    """Tags each autograd node with the source line of the forward op that made it (`node.metadata`), so the
    backward's kernels (run by the autograd engine, with no genomelm frame of their own) are named by it."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        nodes = [
            t.grad_fn
            for t in (tree_leaves(out) if isinstance(out, (tuple, list)) else (out,))
            if isinstance(t, torch.Tensor) and t.grad_fn is not None
        ]
        where, expert = None, None
        while nodes:  # the nodes this call made (a composite op makes several): those not tagged yet
            node = nodes.pop()
            if node is None or "genomelm_where" in node.metadata:
                continue
            where = where or source_line()[0]
            expert = expert_work(where) if expert is None else expert
            node.metadata["genomelm_where"] = where
            node.metadata["genomelm_expert"] = expert
            nodes += [n for n, _ in node.next_functions]
        return out


@dataclass
class OpLog:
    """The op classes of a traced step, by part ("layers.<i>", "rest", "update")."""

    parts: dict[str, dict[str, OpClass]] = field(default_factory=dict)

    def record(self, part: str, func: Any, args: tuple, kwargs: dict, out: Any, flops: float) -> None:
        if not is_kernel(func):
            return
        name, dtype, unit, moved = op_record(func, args, kwargs, out, flops)
        where, function = source_line()
        node = torch._C._current_autograd_node()
        recompute = False
        expert = expert_work(where)
        if node is not None:  # the backward: a Python backward or a recompute has its own model frame
            in_model = where is not None and where.startswith(_MODEL_FILES)
            if in_model:
                recompute = in_recompute()
            elif where is not None and where.startswith(_STAND_IN_FILES) and in_recompute():
                recompute = True  # fla's kernel (its stand-in) run again by a layer's recompute
            else:
                forward = node.metadata.get("genomelm_where")
                where = f"backward of {forward or node.name()}"
            if not recompute:  # a backward kernel does the work of the forward op that made its node
                expert = node.metadata.get("genomelm_expert") or ""
        where = where or "outside genomelm"
        key = f"{name} {dtype} @ {where}"
        slot = self.parts.setdefault(part, {}).get(key)
        if slot is None:
            slot = self.parts[part][key] = OpClass(name, dtype, unit, where, expert=expert)
        slot.count += 1
        slot.flops += flops
        slot.bytes += moved
        slot.recompute_flops += flops if recompute else 0.0
        slot.recompute_count += 1 if recompute else 0
        atomic, select = special_bytes(name, args, kwargs)
        slot.atomic_bytes += atomic
        slot.select_bytes += select


# the project's kernels and fla's stand-ins at the rate of the published kernel of their kind (`rates.RATES`)
CUSTOM_RATES = {
    "genomelm.sparse_mla_fwd": "sparse_mla_fwd",
    "genomelm.sparse_mla_pool_mass": "sparse_mla_fwd",
    "genomelm.sparse_mla_bwd": "sparse_mla_bwd",
    "genomelm.indexer_scores": "indexer",
    "genomelm_simulation.chunk_kda": "kda_fwd",
    "genomelm_simulation.chunk_kda_gate": "kda_fwd",
    "genomelm_simulation.chunk_kda_backward": "kda_bwd",
}


def rate_key(op: OpClass) -> str:
    """The `rates.RATES` row an op class's FLOPs run at: its kernel's own, the routed experts' grouped GEMM,
    else the dense GEMM of its unit; a backward's dense GEMMs (the gradients' products, whose operand layouts
    differ from the forward's) at "gemm_<unit>_backward" where a device measures one apart (a CPU)."""
    if op.op in CUSTOM_RATES:
        return CUSTOM_RATES[op.op]
    if op.op == "aten._grouped_mm":
        return f"grouped_gemm_{op.unit}"
    return f"gemm_{op.unit}_backward" if op.where.startswith("backward of ") else f"gemm_{op.unit}"


def op_seconds(op: OpClass, p: Peaks, count: float | None = None) -> tuple[float, str]:
    """Seconds of `count` (default: op.count) ops of the class, each with the class's mean FLOPs and bytes,
    and what bounds them ("compute", "memory" or "launch")."""
    n = op.count if count is None else count
    if n <= 0:
        return 0.0, "memory"
    atomic, select = _shares(op)
    per = op.bytes / op.count
    return kernels_seconds(rate_key(op), op.unit, op.flops / op.count, per, n, p, atomic * per, select * per)


def _shares(op: OpClass) -> tuple[float, float]:
    """The shares of an op class's bytes that are atomic adds and a top-k's input."""
    if op.bytes <= 0:
        return 0.0, 0.0
    return op.atomic_bytes / op.bytes, op.select_bytes / op.bytes


def kernels_seconds(
    rate: str,
    unit: str,
    flops: float,
    nbytes: float,
    n: float,
    p: Peaks,
    atomic: float = 0.0,
    select: float = 0.0,
) -> tuple[float, str]:
    """`op_seconds` of n kernels of `flops` and `nbytes` each, on `rate`'s row for `unit`; of the bytes,
    `atomic` read-modify-written by atomic adds (at `Peaks.atomics`) and `select` a top-k's input (read
    `Peaks.topk_passes` times)."""
    if n <= 0:
        return 0.0, "memory"
    compute = flops / p.flops_rate(rate, unit) if unit != "memory" else 0.0
    memory = (nbytes - atomic + select * (p.topk_passes - 1)) / p.memory + (
        atomic / (p.atomics or p.memory) if atomic else 0.0
    )
    body = max(compute, memory)
    bound = "launch" if p.launch_s > body else ("compute" if compute > memory else "memory")
    return n * (body + p.launch_s), bound


def collective_seconds(kind: str, payload: float, ranks: int, p: Peaks) -> float:
    """Seconds of one collective over `ranks` consecutive ranks on `payload` bytes (its full tensor: the
    gathered output, the scattered input, the reduced or exchanged tensor), plus one launch."""
    if ranks <= 1:
        return 0.0
    return p.links.seconds(kind, payload * ring_factor(kind, ranks), ranks) + p.launch_s


@dataclass
class CostedClass:
    """One op class read at the rank's tokens, over every layer it stands for: count, FLOPs, bytes,
    seconds."""

    key: str
    op: str
    unit: str
    where: str
    count: float
    flops: float
    bytes: float
    seconds: float
    bound: str
    model_flops: float  # FLOPs but the recompute's
    rate: str = ""  # the rate that bounds it ("gemm_bf16", "memory", "launch": `rates.RATES`)
    recompute_seconds: float = 0.0  # of `seconds`, the recompute's (its share of the class's count)

    @property
    def backward(self) -> bool:
        """Whether the class runs in the backward proper (not the forward or the recompute)."""
        return self.where.startswith("backward of ")

    @property
    def moe(self) -> bool:
        """Whether the class is a MoE layer's experts' or exchange's work (what runs after its host sync)."""
        return self.where.removeprefix("backward of ").startswith(MOE_FILES)


def _line(a: float, b: float, t1: int, t2: int, t: int) -> float:
    return b if t1 == t2 or t == t2 else max(0.0, b + (b - a) * (t - t2) / (t2 - t1))


def project(
    lo: dict[str, dict[str, OpClass]],
    hi: dict[str, dict[str, OpClass]],
    t1: int,
    t2: int,
    tokens: int,
    multiplicity: dict[str, float],
    p: Peaks,
    expert_scale: float = 1.0,
    weights_scale: float = 1.0,
) -> list[CostedClass]:
    """The op classes of two traces (at t1 and t2 tokens per rank; the same when t1 == t2) read at `tokens`:
    count and per-op FLOPs and bytes on the line through the two, each part x `multiplicity[part]` (the
    layers a traced layer stands for; parts not named are left out), the routed experts' work on rows x
    `expert_scale` (the busiest expert-parallel rank's rows over the mean) and on their weights x
    `weights_scale` (the rank's share of the traced experts). Classes of the same key summed over the parts,
    the costliest first."""
    scales = {"rows": expert_scale, "weights": weights_scale, "": 1.0}
    merged: dict[str, CostedClass] = {}
    for part, times in multiplicity.items():
        for key, op in hi.get(part, {}).items():
            low = lo.get(part, {}).get(key)
            count = _line(low.count if low else 0, op.count, t1, t2, tokens)
            per_flops = _line(
                low.flops / low.count if low else op.flops / op.count, op.flops / op.count, t1, t2, tokens
            )
            per_bytes = _line(
                low.bytes / low.count if low else op.bytes / op.count, op.bytes / op.count, t1, t2, tokens
            )
            scale = times * scales[op.expert]
            atomic, select = _shares(op)
            seconds, bound = kernels_seconds(
                rate_key(op),
                op.unit,
                per_flops,
                per_bytes,
                count * scale,
                p,
                atomic * per_bytes,
                select * per_bytes,
            )
            recompute_share = op.recompute_flops / op.flops if op.flops else 0.0
            recomputed = seconds * op.recompute_count / op.count if op.count else 0.0
            flops = per_flops * count * scale
            slot = merged.get(op.key)
            if slot is None:
                merged[op.key] = CostedClass(
                    op.key,
                    op.op,
                    op.unit,
                    op.where,
                    count * scale,
                    flops,
                    per_bytes * count * scale,
                    seconds,
                    bound,
                    flops * (1 - recompute_share),
                    p.resolved(rate_key(op), op.unit) if bound == "compute" else bound,
                    recomputed,
                )
            else:
                slot.count += count * scale
                slot.flops += flops
                slot.bytes += per_bytes * count * scale
                slot.seconds += seconds
                slot.model_flops += flops * (1 - recompute_share)
                slot.recompute_seconds += recomputed
    return sorted(merged.values(), key=lambda c: -c.seconds)


def top_classes(
    classes: Iterable[CostedClass], total_s: float, p: Peaks, n: int = 10
) -> list[dict[str, Any]]:
    """The `n` costliest classes as plan.json rows: share of the step, bound, the rate that bounds it (its
    value in FLOP/s, bytes/s or seconds per launch, and its source), count, seconds, where."""
    rows = []
    for c in list(classes)[:n]:
        if c.rate == "launch":
            value = p.launch_s
        elif c.rate == "memory":
            value = p.memory
        else:
            value = p.compute[c.rate]
        rows.append(
            {
                "class": c.key,
                "share": c.seconds / total_s if total_s > 0 else 0.0,
                "seconds": c.seconds,
                "bound": c.bound,
                "unit": c.unit,
                "rate": c.rate,
                "rate_value": value,
                "rate_source": p.sources.get(c.rate, "measured on this machine"),
                "count": c.count,
                "tflop": c.flops / 1e12,
                "gb": c.bytes / 1e9,
            }
        )
    return rows


def source_file(where: str) -> str:
    """The file of an op class's source: "genomelm/model/moe.py" from "backward of genomelm/model/moe.py:156";
    a backward without a tagged forward, or an op issued outside genomelm/, as it is named."""
    where = where.removeprefix("backward of ")
    return where.rsplit(":", 1)[0] if where.startswith("genomelm/") else where


def by_source(classes: Iterable[CostedClass]) -> list[dict[str, Any]]:
    """Seconds, FLOPs and bytes of the classes summed by source file (forward, recompute and backward
    together), the costliest first: which block's code the time goes to."""
    files: dict[str, dict[str, Any]] = {}
    for c in classes:
        row = files.setdefault(source_file(c.where), {"seconds": 0.0, "tflop": 0.0, "gb": 0.0, "classes": 0})
        row["seconds"] += c.seconds
        row["tflop"] += c.flops / 1e12
        row["gb"] += c.bytes / 1e9
        row["classes"] += 1
    return sorted(({"source": k} | v for k, v in files.items()), key=lambda r: -r["seconds"])
