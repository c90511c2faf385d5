"""What the simulation puts in the place of what needs a real GPU: FSDP2's side streams and events
(`fsdp_stand_in`, each wait recorded as the host sync it is), numpy reading back a fake tensor
(`host_numpy`: zeros), and the stop of the evaluation's forward before the results are gathered
(`until_results_gather`)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist

from genomelm.parallel.simulation import (
    HostSync,
    SimulationError,
    SimulationMode,
    source_line,
)
from genomelm.plan.fla_stand_in import replaced
from genomelm.run.scoring import (
    WindowShare,
)


class FakeEvent:
    """A CUDA event of the simulation (`torch.cuda.Event`): marks a point of its stream; waiting for it on
    the host is a host sync, recorded."""

    def __init__(self, mode: SimulationMode, *args: Any, **kwargs: Any) -> None:
        self.mode = mode

    def record(self, stream: FakeStream | None = None) -> None:
        """Marks the stream's queue here: nothing to do in one queue without timing."""

    def wait(self, stream: FakeStream | None = None) -> None:
        """The stream's later work waits for this point: in one queue it does already."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        record_wait(self.mode, "event synchronize")


class FakeStream:
    """A CUDA stream of the simulation (`torch.cuda.Stream`, FSDP2's all-gather and reduce-scatter streams):
    the simulation has one queue and no timing, so ordering one stream after another is already so; waiting
    for it on the host is a host sync, recorded."""

    def __init__(self, mode: SimulationMode, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.mode, self.priority = mode, priority

    def wait_stream(self, stream: FakeStream) -> None:
        """Later work on this stream waits for `stream`'s: in one queue it does already."""

    def wait_event(self, event: FakeEvent) -> None:
        """Later work on this stream waits for `event`: in one queue it does already."""

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        return event if event is not None else FakeEvent(self.mode)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        record_wait(self.mode, "stream synchronize")


def record_wait(mode: SimulationMode, op: str) -> None:
    mode.syncs.append(HostSync("stream wait", op, source_line(), mode.phase()))


@contextmanager
def fsdp_stand_in(mode: SimulationMode) -> Iterator[None]:
    """FSDP2 on fake CUDA while inside: `torch.cuda`'s streams and events (FSDP2's side streams) are
    `FakeStream`s and `FakeEvent`s of `mode` (the current one switched by `torch.cuda.stream`), and a device
    mesh built from a process group (`DeviceMesh.from_group`: FSDP's meshes of its parameter groups) keeps its
    rank table a real host tensor, as on a GPU machine: it is host bookkeeping, which a fake tensor (all
    tensors are, inside `FakeTensorMode`) cannot index by value."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    current = [FakeStream(mode)]

    @contextmanager
    def stream(selected: FakeStream | None) -> Iterator[None]:
        saved = current[0]
        current[0] = selected if selected is not None else saved
        try:
            yield
        finally:
            current[0] = saved

    original = DeviceMesh.from_group

    def from_group(*args: Any, **kwargs: Any) -> DeviceMesh:
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    cuda = {
        "Stream": functools.partial(FakeStream, mode),
        "Event": functools.partial(FakeEvent, mode),
        "current_stream": lambda device=None: current[0],
        "stream": stream,
    }
    with ExitStack() as stack:
        for name, value in cuda.items():
            stack.enter_context(replaced(torch.cuda, name, value))
        stack.enter_context(replaced(DeviceMesh, "from_group", staticmethod(from_group)))
        yield


@contextmanager
def host_numpy() -> Iterator[None]:
    """`.numpy()` of a fake host tensor while inside: zeros of its shape and dtype (fake tensors hold no
    values; the copy to the host before it, `.cpu()`, is the sync the simulation records). A device tensor
    is refused, as torch refuses it."""
    import numpy as np
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    original = torch.Tensor.numpy

    def numpy(self: torch.Tensor, *, force: bool = False) -> np.ndarray:
        if not isinstance(self, FakeTensor):
            return original(self, force=force)
        if self.device.type != "cpu":
            raise TypeError(
                f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the "
                "tensor to host memory first."
            )
        with unset_fake_temporarily():
            dtype = original(torch.empty(0, dtype=self.dtype)).dtype
        return np.zeros(tuple(self.shape), dtype=dtype)

    with replaced(torch.Tensor, "numpy", numpy):
        yield


class ResultsGather(Exception):
    """The evaluator's results gather was reached: where the simulated path ends."""


@contextmanager
def until_results_gather() -> Iterator[None]:
    """Runs the body up to `WindowShare.run`'s `all_gather_object` of the results (pickled numpy arrays:
    values the simulation does not have), which ends it; an `all_gather_object` from anywhere else is
    refused."""

    def gather(*args: Any, **kwargs: Any) -> None:
        caller = sys._getframe(1)
        if caller.f_code is not WindowShare.run.__code__:
            raise SimulationError(
                f"all_gather_object at {caller.f_code.co_filename}:{caller.f_lineno}: it sends values the "
                "simulation does not have"
            )
        raise ResultsGather

    with replaced(dist, "all_gather_object", gather):
        try:
            yield
        except ResultsGather:
            pass
