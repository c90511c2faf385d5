"""Bytes of the weights, gradients and optimizer state one rank holds for each `optimizer` choice
(`genomelm.run.config.OPTIMIZERS`), counted parameter tensor by parameter tensor on the meta device, and the
bytes the update moves on the GPU (`OPTIMIZER_RULE`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from genomelm.model import GlmForCausalLM, ModelConfig, RunOptions
from genomelm.plan.layouts import Layout
from genomelm.train.optimizer import BF16_WEIGHTS

# torchao's AdamW8bit (`genomelm.train.lowbit`): each moment 8 bits per value plus one fp32 scale per block
# of 256 values of the local shard; a shard of fewer than 4096 values, or not a whole number of blocks, is
# kept in the parameter's dtype (torchao/optim/adam.py `_new_buffer`). The signed and unsigned code maps
# (1 KiB per quantised moment tensor) and the step counters are not counted.
BLOCK = 256
MIN_QUANTISED = 4096
OPTIMIZER_RULE = (
    "weights, gradients and optimizer state by `optimizer`, parameter tensor by parameter tensor (meta "
    "device): adamw: fp32 weight, fp32 gradient, two fp32 moments (16 B per parameter); adamw8bit: fp32 "
    "weight and gradient, each moment 1 B per value + one fp32 scale per 256 values of the rank's local "
    "shard (~10.03 B), a local shard of < 4096 values or not a multiple of 256 kept in the weight's dtype "
    "(torchao); adamw_bf16: the same with bf16 weights and gradients (~6.03 B), the parameters the model "
    "declares fp32 kept fp32. A rank's local shard of a tensor: with FSDP2 ceil(dim0 / shards) rows (shards: "
    "dp*cp, or dp*cp/ep for the routed experts after E/ep of them), without FSDP the whole tensor (experts: "
    "E/ep); the named categories count the even share (numel / shards), the largest rank's extra rows are "
    "counted apart as FSDP padding"
)


@dataclass(frozen=True)
class TensorSpec:
    """One parameter tensor as the optimizer sees it."""

    shape: tuple[int, ...]
    expert: bool  # a routed expert's ([E, ...]: split over ep, then FSDP-sharded over dp*cp/ep)
    fp32_declared: bool  # kept fp32 by a bf16 build (`genomelm.parallel.fsdp.fp32_declared`)


@dataclass(frozen=True)
class StateBytes:
    """One rank's weights, gradients and optimizer state for one optimizer and layout: bytes of the even
    share (numel / shards per tensor: what a node's ranks hold on average), the largest rank's FSDP padding
    apart; and the bytes the update moves."""

    optimizer: str
    values: float  # parameters of the even share
    weights: float  # bytes of the even share
    gradients: float
    moments: float
    padding: float  # the largest rank's extra rows (ceil(dim0 / shards) over dim0 / shards), all three, bytes
    unquantised: float  # share of the values whose moments are kept in the weight's dtype (low-bit choices)
    fp32_weights: float  # share of the values whose weights are fp32
    fused_update: float  # bytes the low-bit choices' fused GPU update moves per step (even share)

    @property
    def total(self) -> float:
        """Bytes of the even share: weights, gradients and moments."""
        return self.weights + self.gradients + self.moments


_SPECS: dict[str, tuple[TensorSpec, ...]] = {}  # by the model config's and options' text


def parameter_specs(model_config: ModelConfig, options: RunOptions) -> tuple[TensorSpec, ...]:
    """Every trainable parameter tensor of the model built in bf16 on the meta device (those it declares fp32
    stay fp32), cached by the configs' text (they are not hashable)."""
    key = repr(model_config) + repr(options)
    if key not in _SPECS:
        model = GlmForCausalLM.from_config(model_config, options, torch.bfloat16, "meta")
        _SPECS[key] = tuple(
            TensorSpec(tuple(p.shape), ".mlp.experts." in name, p.dtype == torch.float32)
            for name, p in model.named_parameters()
            if p.requires_grad
        )
    return _SPECS[key]


def local_numel(spec: TensorSpec, world: int, ep: int, sharded: bool) -> tuple[float, int]:
    """(the even share, the largest rank's local shard) of a tensor's values on one rank of `world` ranks,
    the experts over `ep`, FSDP2 sharding when `sharded`."""
    rows, rest = (spec.shape[0], math.prod(spec.shape[1:])) if spec.shape else (1, 1)
    shards = world
    if spec.expert:
        rows, shards = rows // ep, world // ep
    if not sharded:
        return float(rows * rest), rows * rest
    return rows * rest / shards, math.ceil(rows / shards) * rest


def quantised(optimizer: str, local: int) -> bool:
    """Whether the low-bit optimizer keeps a local shard of `local` values in 8 bits."""
    return optimizer != "adamw" and local >= MIN_QUANTISED and local % BLOCK == 0


def per_value(spec: TensorSpec, optimizer: str, local: int) -> tuple[int, float, float]:
    """(weight bytes, bytes of both moments, bytes the fused GPU update moves) per value of a tensor whose
    largest local shard has `local` values; the gradient has the weight's dtype."""
    weight = 2 if optimizer in BF16_WEIGHTS and not spec.fp32_declared else 4
    if optimizer == "adamw":
        return weight, 8.0, 0.0  # torch's AdamW update is costed per parameter (timing.py)
    moment = 1 + 4 / BLOCK if quantised(optimizer, local) else weight  # one moment, its scale included
    # torchao's `single_param_adam` compiled by inductor into one kernel per parameter: the weight read and
    # written, the gradient read, both moments (codes and scales) read and written
    return weight, 2 * moment, 2 * weight + weight + 2 * 2 * moment


@functools.lru_cache(maxsize=4096)
def _state_bytes(key: str, optimizer: str, world: int, ep: int, sharded: bool) -> StateBytes:
    values = weights = moments = padding = unquantised = fp32 = update = 0.0
    for spec in _SPECS[key]:
        even, largest = local_numel(spec, world, ep, sharded)
        weight, moment, fused = per_value(spec, optimizer, largest)
        values += even
        weights += weight * even
        moments += moment * even
        padding += (largest - even) * (2 * weight + moment)
        unquantised += even if optimizer != "adamw" and not quantised(optimizer, largest) else 0.0
        fp32 += even if weight == 4 else 0.0
        update += fused * even
    share = max(values, 1.0)
    return StateBytes(
        optimizer, values, weights, weights, moments, padding, unquantised / share, fp32 / share, update
    )


def state_bytes(model_config: ModelConfig, options: RunOptions, optimizer: str, layout: Layout) -> StateBytes:
    """One rank's weights, gradients and optimizer state under `optimizer` and `layout` (`OPTIMIZER_RULE`),
    cached per (model, optimizer, layout): a search plans each layout for each optimizer."""
    parameter_specs(model_config, options)  # built once per model
    key = repr(model_config) + repr(options)
    return _state_bytes(key, optimizer, layout.world, layout.ep, layout.sharded)
