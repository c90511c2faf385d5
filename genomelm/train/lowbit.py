"""torchao's AdamW8bit as a run uses it (`optimizer=adamw8bit` and `adamw_bf16`): imported only by the runs
that choose it (torchao's import adds about 4 s to a process).

Each moment is kept in 8 bits per value with an fp32 scale per block of 256 values of a rank's local shard;
torchao keeps a shard of fewer than 4096 values, or one not a whole number of blocks, in the parameter's dtype
(bitsandbytes' rule: norms, gates and biases; pytorch/ao issue 4912). With `bf16_stochastic_round` a bf16
weight is updated in fp32 and rounded back to bf16 stochastically, so small updates survive on average.

A checkpoint holds the moments as plain fp32 tensors (`state_dict`), so DCP reshards them as it does
AdamW's, and `load_state_dict` quantises them again. That is not always exact: torchao's signed code map ends
at -0.993, not -1, so a block whose largest magnitude is negative comes back with a smaller scale. So
each rank also keeps its quantised moments as they are (`exact_state`: codes and scales), which a resume on
the same layout puts back (`load_exact_state`), and its losses equal the uninterrupted run's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


@contextmanager
def _quiet_import() -> Iterator[None]:
    """torchao logs a warning for each CUDA extension a CPU-only torch cannot load, and torch one for an enum
    torchao registers: neither concerns the optimizers."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


with _quiet_import():
    from torchao.optim import AdamW8bit
    from torchao.optim.adam import single_param_adam
    from torchao.optim.subclass_8bit import OptimState8bit

MOMENTS = ("exp_avg", "exp_avg_sq")


class LowBitAdamW(AdamW8bit):
    """torchao's AdamW8bit, its update (`single_param_adam`) applied to each parameter's local shard: the
    update is elementwise, and the shard's moments share its placement, so a DTensor's update is its local
    tensors' (DTensor's eager dispatch cannot lerp a bf16-looking quantised moment with an fp32 one).
    `compiled`: the update of a parameter on a GPU compiled per shape, as torchao's own step does; else (and
    for parameters FSDP2 offloads to the host) run eagerly, as inductor's CPU compile costs tens of seconds
    per shape and needs a C++ compiler on the host."""

    def __init__(self, groups: list[dict[str, Any]], *, compiled: bool, **settings: Any) -> None:
        super().__init__(groups, **settings)
        self.compiled = compiled

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        compiled = torch.compile(single_param_adam, fullgraph=True, dynamic=False)
        # as torchao: a model has a fixed set of argument shapes, so no cache limit
        limit = torch._dynamo.utils.disable_cache_limit() if self.compiled else nullcontext()
        with limit:
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        # parameters FSDP2 offloads to the host update eagerly: no C++ compile on the host
                        on_gpu = self.compiled and param.device.type == "cuda"
                        self._update(compiled if on_gpu else single_param_adam, param, group)
        return None

    def _update(self, update: Any, param: Tensor, group: dict[str, Any]) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = self._new_buffer(param, True)
            state["exp_avg_sq"] = self._new_buffer(param, False)
        state["step"] += 1
        update(
            _local(param.detach()),
            _local(param.grad),
            state["step"],
            _local(state["exp_avg"]),
            _local(state["exp_avg_sq"]),
            None,
            group["lr"],
            group["betas"][0],
            group["betas"][1],
            group["weight_decay"],
            group["eps"],
            True,
            self.bf16_stochastic_round and param.dtype is torch.bfloat16,
        )

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict with every moment as a plain fp32 tensor (a DTensor where the
        parameter is one), quantised or not."""
        saved = super().state_dict()
        saved["state"] = {
            index: {key: _plain(value) if key in MOMENTS else value for key, value in entry.items()}
            for index, entry in saved["state"].items()
        }
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load `state_dict` (its moments plain, as `state_dict` writes them), quantising each moment as this
        optimizer keeps it (`_new_buffer`: by the local shard's size)."""
        moments = {
            index: {key: value for key, value in entry.items() if key in MOMENTS}
            for index, entry in state_dict["state"].items()
        }
        rest = {
            index: {key: value for key, value in entry.items() if key not in MOMENTS}
            for index, entry in state_dict["state"].items()
        }
        super().load_state_dict({**state_dict, "state": rest})
        saved_ids = [index for group in state_dict["param_groups"] for index in group["params"]]
        for index, param in zip(saved_ids, self._params(), strict=True):
            for key, value in moments.get(index, {}).items():
                buffer = self._new_buffer(param, signed=key == "exp_avg")
                buffer.copy_(value.to(buffer.device) if not isinstance(value, DTensor) else value)
                self.state[param][key] = buffer

    def exact_state(self) -> dict[int, dict[str, tuple[Tensor, Tensor]]]:
        """This rank's quantised moments as kept, {parameter position: {moment: (codes, scales)}}."""
        exact: dict[int, dict[str, tuple[Tensor, Tensor]]] = {}
        for index, param in enumerate(self._params()):
            for key in MOMENTS:
                local = _local(self.state.get(param, {}).get(key))
                if isinstance(local, OptimState8bit):
                    exact.setdefault(index, {})[key] = (local.codes.clone(), local.scale.clone())
        return exact

    def load_exact_state(self, exact: dict[int, dict[str, tuple[Tensor, Tensor]]]) -> None:
        """Put back what `exact_state` returned on the same layout (after `load_state_dict`)."""
        params = self._params()
        for index, entry in exact.items():
            for key, (codes, scale) in entry.items():
                local = _local(self.state[params[index]][key])
                if not isinstance(local, OptimState8bit) or local.codes.shape != codes.shape:
                    raise ValueError(f"the saved {key} of parameter {index} is not this layout's")
                local.codes.copy_(codes)
                local.scale.copy_(scale)

    def _params(self) -> list[Tensor]:
        return [param for group in self.param_groups for param in group["params"]]


def _local(value: Tensor | None) -> Tensor | None:
    return value.to_local() if isinstance(value, DTensor) else value


def _plain(value: Tensor) -> Tensor:
    """A moment as a plain fp32 tensor (a DTensor of the same placement where it is one)."""
    if isinstance(value, DTensor):
        local = _plain(value.to_local())
        return DTensor.from_local(
            local,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, OptimState8bit):
        return value.dequantize(torch.float32)
    return value.float()
