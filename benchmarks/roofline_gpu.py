"""The roofline projection (`genomelm.plan.roofline`) beside the measured time of one forward + backward of a
model (gpu_check's full-width slice on a GPU; any model on the CPU), part by part: each KDA layer kind, each
DSA layer kind, and the rest (embedding, final norm, head and loss).

The same step runs three times: once to warm up (Triton compiles, autotunes), once recorded op by op (every
kernel into a `roofline.OpLog` under the part that ran it, then costed at the device's peaks), then timed
(`repeats`, the median) with nothing but a mark at each change of part: a CUDA event on a GPU,
`time.perf_counter` on the CPU. The interval between two marks belongs to the part that ran in it, so the
parts add up to the step. Marks: a layer's forward by its module pre- and post-hooks; its backward from the
moment the autograd engine reaches the node that made the layer's output (a node pre-hook) to the moment the
gradient of the layer's input is complete (a tensor hook), its recompute included (non-reentrant checkpoint
may stop a recompute early, so its post-hook need not run). The op recording uses the same marks, so both
columns split the step the same way.

    rows = projected_vs_measured(model, ids, runner, "h200")   # model on CUDA, ids [1, S]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from genomelm.model import GlmForCausalLM
from genomelm.model.config import KDA
from genomelm.plan import rates, roofline
from genomelm.plan.rates import Peaks
from genomelm.plan.recording import flop_formula
from genomelm.train.memory import LayerRunner

REST = "embedding, norm, head, loss"


def _layer_part(model: GlmForCausalLM, layer: nn.Module) -> str:
    """The part of a decoder layer: its attention kind and its feed-forward kind (one row per kind)."""
    mlp = "MoE" if model.config.mlp_layer_types[layer.layer_idx] == "sparse" else "dense MLP"
    return f"{'KDA' if layer.layer_type == KDA else 'DSA'} layer ({mlp})"


class PartClock:
    """The part of the model running now (`current`), and a mark at every change of it: (stamp, part that
    starts), the stamp a CUDA event (`cuda`) or `time.perf_counter()`; `on_change(part)` is called at each
    change (the recorder reads `current` instead)."""

    def __init__(self, model: GlmForCausalLM, cuda: bool) -> None:
        self.cuda = cuda
        self.current = REST
        self.stack: list[str] = []
        self.marks: list[tuple[Any, str]] = []
        self.timing = False
        self.handles = []
        for layer in model.layers:
            part = _layer_part(model, layer)
            self.handles.append(layer.register_forward_pre_hook(self._entered(part)))
            self.handles.append(layer.register_forward_hook(self._left(part)))

    def mark(self) -> None:
        if not self.timing:
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((event, self.current))
        else:
            self.marks.append((time.perf_counter(), self.current))

    def push(self, part: str) -> None:
        self.stack.append(self.current)
        self.current = part
        self.mark()

    def pop(self) -> None:
        self.current = self.stack.pop()
        self.mark()

    def _entered(self, part: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            if torch._C._current_autograd_node() is not None:
                return  # the recompute, inside the layer's backward (which may stop it before its end)
            self.push(part)
            streams = args[0]
            if streams.requires_grad:  # the backward leaves the part once the input's gradient is complete
                streams.register_hook(lambda grad: self.pop())

        return hook

    def _left(self, part: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if torch._C._current_autograd_node() is not None:
                return
            self.pop()
            streams = output[0]
            if streams.grad_fn is not None:  # the backward enters the part at the node that made the output
                streams.grad_fn.register_prehook(lambda grads: self.push(part))

        return hook

    def seconds(self) -> dict[str, float]:
        """Seconds per part between the marks (after the device has finished)."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for (start, part), (end, _) in zip(self.marks, self.marks[1:]):
            elapsed = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            out[part] = out.get(part, 0.0) + elapsed
        return out

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Marks the step: one at its start, one at its end, one at each change of part between."""
        self.marks, self.stack, self.current, self.timing = [], [], REST, True
        self.mark()
        try:
            yield
        finally:
            self.mark()
            self.timing = False
        if self.stack:
            raise RuntimeError(f"parts entered but not left: {self.stack} (a hook did not fire)")

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class _Recorder(TorchDispatchMode):
    """Every kernel of the step into an `OpLog`, under the clock's current part, with its FLOPs."""

    def __init__(self, clock: PartClock) -> None:
        super().__init__()
        self.clock = clock
        self.log = roofline.OpLog()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        formula = flop_formula(packet)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        self.log.record(self.clock.current, func, args, kwargs, out, flops)
        return out


def _step(model: GlmForCausalLM, ids: torch.Tensor, runner: LayerRunner) -> None:
    """One forward + backward of the mean next-token loss, bf16 autocast (gpu_check's `forward_backward`)."""
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        loss = model(ids, labels, layer_runner=runner)
    loss.backward()


def projected_vs_measured(
    model: GlmForCausalLM,
    ids: torch.Tensor,
    runner: LayerRunner,
    gpu: str | Peaks,
    repeats: int = 3,
) -> list[dict[str, Any]]:
    """One forward + backward of `model` on `ids` [1, S] (bf16 autocast, `runner`'s recompute), projected
    by the roofline at `gpu`'s peaks ("b200" | "h200" | "h100", or measured `Peaks` on the CPU) and
    measured (the median of `repeats`), by part. One row per part and a last row "step", each with: part,
    layers (how many layers it stands for), projected_ms, measured_ms, ratio (projected / measured), bound
    (of its costliest op class), top_class (that class, with its share of the part's projection)."""
    p = rates.peaks(gpu) if isinstance(gpu, str) else gpu
    cuda = ids.device.type == "cuda"
    clock = PartClock(model, cuda)
    try:
        _step(model, ids, runner)  # warm-up: compiles, autotunes, allocator
        recorder = _Recorder(clock)
        with recorder, roofline.SourceTags():
            _step(model, ids, runner)
        measured: dict[str, list[float]] = {}
        for _ in range(repeats):
            with clock.timed():
                _step(model, ids, runner)
            for part, seconds in clock.seconds().items():
                measured.setdefault(part, []).append(seconds)
    finally:
        clock.close()
        model.zero_grad(set_to_none=True)
    tokens = ids.numel()
    layers = {REST: 0}
    for layer in model.layers:
        part = _layer_part(model, layer)
        layers[part] = layers.get(part, 0) + 1
    rows = []
    for part, count in layers.items():
        ops = {part: recorder.log.parts.get(part, {})}
        classes = roofline.project(ops, ops, tokens, tokens, tokens, {part: 1.0}, p)
        projected = sum(c.seconds for c in classes)
        top = classes[0] if classes else None
        rows.append(
            {
                "part": part,
                "layers": count,
                "projected_ms": projected * 1e3,
                "measured_ms": statistics.median(measured.get(part, [0.0])) * 1e3,
                "bound": top.bound if top else "-",
                "top_class": f"{top.key} ({top.seconds / projected:.0%})" if top else "-",
            }
        )
    step = {
        "part": "step",
        "layers": len(model.layers),
        "projected_ms": sum(r["projected_ms"] for r in rows),
        "measured_ms": sum(r["measured_ms"] for r in rows),
        "bound": "-",
        "top_class": "-",
    }
    rows.append(step)
    for r in rows:
        r["ratio"] = r["projected_ms"] / r["measured_ms"] if r["measured_ms"] > 0 else float("nan")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| part | layers | projected ms | measured ms | ratio | bound | costliest op class |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    lines += [
        f"| {r['part']} | {r['layers']} | {r['projected_ms']:,.1f} | {r['measured_ms']:,.1f} | "
        f"{r['ratio']:.2f} | {r['bound']} | {r['top_class']} |"
        for r in rows
    ]
    return "\n".join(lines)
