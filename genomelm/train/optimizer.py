"""The optimizer of a training run (`OptimConfig.optimizer`, one of `genomelm.run.config.OPTIMIZERS`).

- `adamw`: torch's AdamW over fp32 weights (the master weights under bf16 autocast) with fp32 moments.
- `adamw8bit`: torchao's AdamW8bit (`genomelm.train.lowbit`) over the same fp32 weights: 8-bit moments.
- `adamw_bf16`: torchao's AdamW8bit over weights stored in bf16 (those the model declares fp32 stay fp32),
  updated in fp32 and rounded back stochastically: no fp32 master copy. Its moments are 8-bit too: with bf16
  weights and gradients that is about 6 bytes a parameter, and over 60 steps of the demo its losses stay as
  close to AdamW's as bf16 moments' would (`benchmarks/optimizers.py`).

Every choice keeps AdamW's weight-decay groups (matrices decay; norms, biases, gates and decays do not), the
learning-rate schedule (`set_lr`), clipping and the skipped non-finite step (`genomelm.train.step`).
"""

from __future__ import annotations

import torch
from torch import nn

from genomelm.model import GlmForCausalLM
from genomelm.parallel.fsdp import fp32_declared
from genomelm.run.config import OptimConfig

BF16_WEIGHTS = ("adamw_bf16",)  # the choices that store the weights in bf16


def make_optimizer(
    model: nn.Module, optim: OptimConfig, device: torch.device, sharded: bool = False
) -> torch.optim.Optimizer:
    """`optim.optimizer` over the model's trainable parameters in two groups (weight decay on matrices only).
    `sharded`: the parameters are DTensors on two meshes (FSDP2 with expert parallel), which one foreach
    kernel cannot mix; torchao's update one parameter at a time, compiled on CUDA (`LowBitAdamW`)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if optim.optimizer == "adamw":
        fast = (
            {"foreach": False} if sharded else {"fused": True} if device.type == "cuda" else {"foreach": True}
        )
        return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, **fast)
    from genomelm.train.lowbit import LowBitAdamW  # torchao's import is slow: only for the runs using it

    return LowBitAdamW(
        groups,
        compiled=device.type == "cuda",
        lr=optim.lr,
        betas=optim.betas,
        weight_decay=optim.weight_decay,
        bf16_stochastic_round=optim.optimizer in BF16_WEIGHTS,
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate (torchao's optimizers keep it as a tensor, filled in place)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


@torch.no_grad()
def store_weights(model: GlmForCausalLM, optim: OptimConfig) -> None:
    """Cast the weights to the dtype `optim.optimizer` keeps them in, before the model is split: bf16 for
    `BF16_WEIGHTS` except the parameters the model declares fp32 (`fp32_declared`); nothing otherwise."""
    if optim.optimizer not in BF16_WEIGHTS:
        return
    keep = set(fp32_declared(model))
    for name, param in model.named_parameters():
        if name not in keep and param.is_floating_point():
            param.data = param.data.to(torch.bfloat16)
