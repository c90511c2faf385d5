"""One optimizer step of one rank: what the training loop runs and what `genomelm plan` measures.

`TrainStep.run` is the step: for each of this rank's windows the forward and backward (`window_loss`, the
memory stack's `LayerRunner`, context parallelism through the `ParallelRun`), then the gradient sum over the
mesh, global-norm clipping and the optimizer's update with expert-bias balancing, or a skipped update when the
loss or the gradient norm is not finite. The planner runs the same `run` on fake tensors, entering its memory
trackers around the two phases through `StepPhases`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from genomelm.data.vocab import IGNORE_INDEX
from genomelm.parallel.training import ContextRun, ParallelRun
from genomelm.run.config import OptimConfig, TrainConfig
from genomelm.run.precision import autocast_for
from genomelm.train.balance import ExpertLoad, update_expert_bias
from genomelm.train.optimizer import set_lr

LayerRunnerFn = Callable[..., object]


def window_loss(
    model: nn.Module, rows: list[Tensor], runner: LayerRunnerFn | None, context: ContextRun | None
) -> tuple[Tensor, Tensor]:
    """The training loss of one window, or this rank's share of it under context parallelism.

    rows: input_ids, labels [1, S] long and loss weights [1, S] fp32 of the whole window. Returns the loss
    (with graph): the token-weighted mean sum(w * nll) / sum(w) over the whole window, plus the indexer KL
    terms when trained; under CP each rank holds its shard and divides by the window's total weight, so the
    ranks' losses add up to the window's. Also [total weight, valid labels, nll sum] over the window (no
    graph).
    """
    if context is not None:
        layout = context.layout(rows[0].shape[1], model.options.kda_chunk_size, model.config.index_kpool)
        rows = context.shard(layout, *rows)
    input_ids, labels, weights = rows
    nll = model(input_ids, labels, reduction="none", layer_runner=runner)
    totals = torch.stack([weights.sum(), (labels != IGNORE_INDEX).sum().float(), nll.detach().sum()])
    if context is not None:
        totals = context.global_sum(totals)
    loss = (nll * weights).sum() / totals[0].clamp_min(torch.finfo(torch.float32).tiny)
    if model.last_indexer_loss:
        loss = loss + sum(model.last_indexer_loss.values())
    return loss, totals


def lr_factor(step: int, optim: OptimConfig, steps: int) -> float:
    """Linear warmup over `warmup_steps`, then cosine from 1 down to `min_lr_ratio` at `steps`."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    span = max(steps - optim.warmup_steps, 1)
    progress = min((step - optim.warmup_steps) / span, 1.0)
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class StepPhases:
    """What runs around the step's two phases (the planner's memory trackers; nothing for training), and
    whether the update may assume a finite step: fake tensors hold no values to test."""

    forward_backward: Callable[[], AbstractContextManager] = nullcontext
    update: Callable[[], AbstractContextManager] = nullcontext
    assume_finite: bool = False


@dataclass
class StepOutcome:
    """What one step did: the loss (mean over the step's windows and dp ranks), the loss with every base
    weighing 1, the gradient norm before clipping, whether the update was applied, the routed token counts."""

    loss: float
    loss_unweighted: float
    grad_norm: float
    finite: bool
    expert_load: ExpertLoad = field(default_factory=ExpertLoad)


class TrainStep:
    """One rank's optimizer step over `windows_per_step` windows of the whole mesh (grad_accum x dp).

    model: already split over the mesh (`ParallelRun.prepare`) when `parallel` is given; `runner`: the memory
    stack around each decoder layer; `autocast`: the precision context of the forward.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        runner: LayerRunnerFn | None,
        parallel: ParallelRun | None,
        optim: OptimConfig,
        autocast: Callable[[], AbstractContextManager],
        windows_per_step: int,
    ) -> None:
        self.model, self.optimizer, self.runner, self.parallel = model, optimizer, runner, parallel
        self.optim, self.autocast, self.windows_per_step = optim, autocast, windows_per_step
        self.context = parallel.context if parallel is not None else None

    @classmethod
    def for_run(
        cls,
        config: TrainConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        runner: LayerRunnerFn | None,
        parallel: ParallelRun | None,
        device: torch.device,
    ) -> TrainStep:
        """The step of a run of `config` on this rank: its precision's autocast on `device`, grad_accum x dp
        windows per step."""
        windows = config.optim.grad_accum * config.parallel.dp
        autocast = functools.partial(autocast_for, config.memory.precision, device)
        return cls(model, optimizer, runner, parallel, config.optim, autocast, windows)

    def run(
        self, lr: float, windows: Iterable[list[Tensor]], phases: StepPhases | None = None
    ) -> StepOutcome:
        """Forward and backward of each of this rank's `windows` (rows as `window_loss` takes them), then the
        gradient sum, clipping and the update at learning rate `lr`."""
        phases = phases or StepPhases()
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        load = ExpertLoad()
        losses: list[tuple[Tensor, Tensor]] = []
        with phases.forward_backward():
            for rows in windows:
                losses.append(self._forward_backward(rows, load))
        with phases.update():
            return self._update(losses, load, phases.assume_finite)

    def _forward_backward(self, rows: list[Tensor], load: ExpertLoad) -> tuple[Tensor, Tensor]:
        """One window: its loss over the whole window and its unweighted loss (scalars, no graph)."""
        with self.autocast():
            loss, totals = window_loss(self.model, rows, self.runner, self.context)
        load.add(self.model.router_stats())  # read before the backward's recompute routes the tokens again
        (loss / self.windows_per_step).backward()
        local = loss.detach()
        whole = self.context.global_sum(local) if self.context is not None else local
        return whole, totals[2] / totals[1].clamp_min(1)

    def _update(
        self, losses: list[tuple[Tensor, Tensor]], load: ExpertLoad, assume_finite: bool
    ) -> StepOutcome:
        """Sum the gradients over the mesh, clip them, and apply AdamW and the expert bias (or skip the update
        of a non-finite step)."""
        accum = self.windows_per_step // (self.parallel.dims.dp if self.parallel is not None else 1)
        parallel, model = self.parallel, self.model
        max_norm = math.inf if self.optim.grad_clip is None else self.optim.grad_clip  # inf: the norm alone
        if parallel is not None:
            parallel.reduce_gradients(model)
            load.counts = parallel.sum_counts(load.counts)
            grad_norm = parallel.clip_grad_norm_(model, max_norm)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        # the step's numbers on the device, averaged over the dp ranks, then read in the step's one host sync
        means = torch.stack([torch.stack(column).double().sum() for column in zip(*losses)]) / accum
        if parallel is not None:
            means = parallel.mean_over_data(means)
        values = torch.cat([means, grad_norm.detach().double().reshape(1).to(means.device)])
        if assume_finite:  # fake tensors: no values to read
            loss = plain = norm = math.nan
            finite = True
        else:
            loss, plain, norm = values.tolist()
            finite = math.isfinite(loss) and math.isfinite(norm)
        if finite:
            self.optimizer.step()
            update_expert_bias(model.layers, load, self.optim.expert_bias_speed)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(loss, plain, norm, finite, load)
