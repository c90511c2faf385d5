"""Held-out loss during training (`eval_every=N`): every N optimizer steps the model being trained scores a
fixed set of held-out windows, forward only, on the run's own mesh, and the loss per position bucket goes into
that step's metrics row.

The windows are `eval_windows` (0: all) of the held-out split of the run's (first) prepared folder, spread
over it as `genomelm eval` picks them, and read once at the start. The scoring is `score_windows`, the one
the evaluator runs (without its context cut): under context parallelism through a `ContextParallelScorer`,
the dp replicas splitting the windows (`WindowShare`), every rank taking part so that FSDP's all-gathers and
the expert exchange stay in step. Nothing of the training changes: the RNG streams are restored afterwards
and the data order is not touched, so the per-step losses are those of a run without it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from genomelm.data import WindowDataset
from genomelm.data.windows import Window
from genomelm.parallel.checkpoint import rng_state, set_rng_state
from genomelm.parallel.expert import received_tokens
from genomelm.parallel.training import ContextParallelScorer, ContextRun, ParallelRun
from genomelm.run.config import TrainConfig
from genomelm.run.metrics import HELDOUT_LOSS, device_peak_gb, heldout_bucket_key, heldout_se_key
from genomelm.run.precision import autocast_for
from genomelm.run.scoring import WindowRule, WindowShare, score_windows
from genomelm.run.uncertainty import Estimate, Ratio, ratio_estimate
from genomelm.train.guards import RunMismatch


@dataclass
class HeldoutLoss:
    """One held-out evaluation: the buckets' [start, end) positions, the token-weighted mean loss per bucket
    and over every valid token with their standard errors across windows (`genomelm.run.uncertainty`; as
    `genomelm.eval.buckets.bucketed_loss` computes them), and each window's loss sum and valid tokens over
    all positions (float [W], int [W]), what a later evaluation's paired change is computed from."""

    bounds: list[tuple[int, int]]
    buckets: list[Estimate]
    overall: Estimate
    window_sums: np.ndarray
    window_tokens: np.ndarray


def bucket_means(loss: np.ndarray, valid: np.ndarray, bucket: int) -> HeldoutLoss:
    """The held-out loss per position bucket and over all positions.

    loss: float [W, S] nats per position (any value where not valid); valid: bool [W, S]; bucket: positions
    per bucket (the last holds the remaining S mod bucket). A bucket without valid tokens is NaN.
    """
    width = loss.shape[1]
    starts = np.arange(0, width, bucket)
    bounds = [(int(s), int(min(s + bucket, width))) for s in starts]
    sums = np.add.reduceat(np.where(valid, loss.astype(np.float64), 0.0), starts, axis=1)
    counts = np.add.reduceat(valid.astype(np.int64), starts, axis=1)
    buckets = [ratio_estimate(Ratio.of(sums[:, i], counts[:, i], counts[:, i])) for i in range(len(bounds))]
    window_sums, window_tokens = sums.sum(axis=1), counts.sum(axis=1)
    overall = ratio_estimate(Ratio.of(window_sums, window_tokens, window_tokens))
    return HeldoutLoss(bounds, buckets, overall, window_sums, window_tokens)


def paired_change(earlier: HeldoutLoss, later: HeldoutLoss) -> Estimate:
    """The relative change of the loss over all tokens from `earlier` to `later` (the same windows), with
    its 95% interval paired by window."""
    return ratio_estimate(Ratio.of(later.window_sums, earlier.window_sums, later.window_tokens), offset=-1.0)


def heldout_line(step: int, record: dict) -> str:
    """The progress line of a step's held-out evaluation: the loss with its standard error, and the paired
    change since the previous evaluation with its 95% interval."""
    line = (
        f"step {step}: held-out loss {record[HELDOUT_LOSS]:.4f} (s.e. {record[HELDOUT_LOSS + '_se']:.4f}; "
        f"{record['heldout/windows']} windows, {record['heldout/eval_s']:.1f} s)"
    )
    if "heldout/change" in record:
        low, high = 100 * record["heldout/change_low"], 100 * record["heldout/change_high"]
        since, change = record["heldout/change_from_step"], 100 * record["heldout/change"]
        line += f"; change since step {since} {change:+.2f}% (95% interval {low:+.2f} to {high:+.2f})"
    return line


@dataclass
class HeldoutEval:
    """The held-out windows a run scores every `every` optimizer steps (held in memory: SEQ x 9 bytes each),
    and how it scores them: `bucket` positions per bucket, the run's `precision` on `device`, this rank's
    `share` of the windows and its context-parallel group (`context`, None at cp=1)."""

    windows: list[Window]
    every: int
    bucket: int
    precision: str
    device: torch.device
    share: WindowShare
    context: ContextRun | None
    previous: tuple[int, HeldoutLoss] | None = None  # (step, result) of this process's last evaluation

    @classmethod
    def for_run(
        cls, config: TrainConfig, parallel: ParallelRun | None, device: torch.device
    ) -> HeldoutEval | None:
        """The run's held-out evaluation (None with `eval_every=0`): its windows read now, so a folder
        without held-out windows or a bucket longer than them stops the run before its first step."""
        if not config.eval.eval_every:
            return None
        heldout = WindowDataset(config.data_dir, "heldout")
        if not len(heldout):
            raise RunMismatch(
                f"eval_every={config.eval.eval_every} scores held-out windows, but {heldout.path} has none: "
                "prepare it with a held-out region (genomelm data heldout=..., make data HELDOUT=...), "
                "give data= a folder that has one, or set eval_every=0"
            )
        if config.eval.bucket > heldout.seq_len:
            raise RunMismatch(
                f"eval_every={config.eval.eval_every}: bucket={config.eval.bucket} is larger than the "
                f"held-out windows of {heldout.path} ({heldout.seq_len} tokens); use "
                f"bucket<={heldout.seq_len}"
            )
        rule = WindowRule(config.eval.eval_far_copies, config.eval.bucket)
        indices, _, best = rule.pick(heldout, config.eval.eval_windows)
        if not indices:
            raise RunMismatch(
                f"eval_every={config.eval.eval_every} scores {rule.describe()}, but none of {heldout.path} "
                f"has (the most is {best:.2%}); lower eval_far_copies= or set it to 0"
            )
        windows = [heldout[i] for i in indices]
        share, context = WindowShare(device=device), None
        if parallel is not None:
            share = WindowShare(
                parallel.mesh.coordinates["dp"], parallel.dims.dp, parallel.mesh.dp_group, parallel.device
            )
            context = parallel.context
        return cls(
            windows,
            config.eval.eval_every,
            config.eval.bucket,
            config.memory.precision,
            device,
            share,
            context,
        )

    def due(self, step: int) -> bool:
        """Whether to evaluate after optimizer step `step` (1-based: steps done)."""
        return step % self.every == 0

    def run(self, model: nn.Module, step: int) -> dict[str, float | int]:
        """Score the windows with `model` after optimizer step `step` (in training mode on return, every RNG
        as it was); the metrics row's held-out part, the same on every rank: the loss per bucket (nats/base)
        under `heldout_bucket_key(start, end)` and its standard error across windows under
        `heldout_se_key(start, end)`, over all buckets under `HELDOUT_LOSS` (and `HELDOUT_LOSS`_se), the
        relative change since this process's previous evaluation (step `heldout/change_from_step`) with its
        paired 95% interval (`heldout/change`, `_low`, `_high`; absent on a run's or a resume's first), the
        windows, the valid tokens, the seconds it took and its peak device memory (GB)."""
        state = rng_state()
        started = time.perf_counter()
        scorer = ContextParallelScorer(model, self.context) if self.context is not None else model
        try:
            # score_windows takes its device (and so its autocast) from the model's first parameter, which
            # FSDP2's CPU offload keeps on the host; the run's autocast around it holds the training's
            # numerics there too (FSDP's root moves the inputs to the GPU)
            with autocast_for(self.precision, self.device):
                scores = score_windows(
                    scorer, self.windows, self.bucket, False, precision=self.precision, share=self.share
                )
        finally:
            model.train()
            set_rng_state(state)
        received_tokens(model)  # under expert parallelism: the held-out rows are no training step's
        result = bucket_means(scores.loss, scores.valid, self.bucket)
        record: dict[str, float | int] = {
            HELDOUT_LOSS: result.overall.value,
            f"{HELDOUT_LOSS}_se": result.overall.se,
        }
        for (start, end), estimate in zip(result.bounds, result.buckets, strict=True):
            record[heldout_bucket_key(start, end)] = estimate.value
            record[heldout_se_key(start, end)] = estimate.se
        if self.previous is not None:
            change = paired_change(self.previous[1], result)
            record |= {
                "heldout/change": change.value,
                "heldout/change_low": change.low,
                "heldout/change_high": change.high,
                "heldout/change_from_step": self.previous[0],
            }
        self.previous = step, result
        record |= {
            "heldout/windows": len(self.windows),
            "heldout/tokens": int(scores.valid.sum()),
            "heldout/eval_s": time.perf_counter() - started,
            "heldout/peak_device_mem_gb": device_peak_gb(),  # also restarts the peak for the next step
        }
        return record
