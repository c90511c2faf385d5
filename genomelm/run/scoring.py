"""The evaluator's model: a run's weights split over the training mesh, scoring whole windows, forward only.

`ScoringRun.from_environment(config)` is this rank's place in the dp x cp x ep mesh of a launched group (or a
single process). `load_scoring_model(path, config, run)` reads a model for it:
- one process: the whole model, from a Hugging Face folder or a sharded training checkpoint (DCP, read whole);
- a launched group: the model is built empty, split over the mesh exactly as training splits it
  (`ParallelRun.prepare`: context parallel, expert parallel, FSDP2) and each rank reads only its shard,
  from a Hugging Face folder (`load_rank_shard`) or directly from the run's sharded checkpoint
  (`load_sharded_model`), so no Hugging Face export of a trained run is needed.
Parameters are stored in the run's precision: bf16 for a bf16 run (the model's fp32-declared parameters stay
fp32), never an fp32 copy of a bf16 run's model. Under context parallelism the model is wrapped in a
`ContextParallelScorer`, so every rank of a cp group gets the whole window's per-token losses.

`score_windows(model, windows, bucket, context_cut, share=run.share)` scores held-out windows with it: per
window its per-token loss, and with the context cut its last bucket again with only the preceding bucket as
context. A model is anything with ``.loss(input_ids[B, S], labels[B, S], reduction="none") -> [B, S]`` (nats,
0 where labels == -100) and parameters; a window is a `genomelm.data.windows.Window`. This is the one scoring
step the evaluator, the probe and the planner's simulation (`genomelm.plan.simulate`) run.

`WindowShare.run(jobs)` gives each dp replica every dp-th job (each one or more forward passes of one window)
and gathers the results, in job order, on every rank. Every replica runs the same number of jobs: FSDP's
all-gathers and the expert exchange span the replicas, so a replica with nothing left runs its first job again
and drops the result (each job is counted once).
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from genomelm.data.far_copy import predicted_far_copy
from genomelm.data.vocab import IGNORE_INDEX
from genomelm.data.windows import Window
from genomelm.model import GlmForCausalLM, ModelConfig, load_model
from genomelm.model.config import is_preset
from genomelm.parallel.checkpoint import (
    CHECKPOINTS_DIR,
    STATE_DIR,
    Checkpointer,
    is_sharded,
    load_sharded_model,
    verify_checkpoint,
)
from genomelm.parallel.launch import is_output_rank
from genomelm.parallel.mesh import ParallelDims
from genomelm.parallel.rank_loading import load_rank_shard
from genomelm.parallel.training import ContextParallelScorer, ParallelRun
from genomelm.run.config import TrainConfig
from genomelm.run.models import device_rows, model_config_of, run_device
from genomelm.run.precision import autocast_for, fsdp_param_dtype, resolve_precision

T = TypeVar("T")


def progress_bar(desc: str, unit: str) -> Callable[[int, int], None]:
    """A `WindowShare.run` progress callback: a tqdm bar on stdout (count, rate, ETA) of the jobs done over
    all replicas, drawn by the output rank only, closed when the last job is done."""
    bar: list[tqdm] = []

    def report(done: int, total: int) -> None:
        if not bar:
            # on stdout, where the results are printed: stderr holds a failure's one line alone
            bar.append(tqdm(total=total, desc=desc, unit=unit, file=sys.stdout, disable=not is_output_rank()))
        bar[0].update(done - bar[0].n)
        if done >= total:
            bar[0].close()

    return report


def scoring_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype a scoring model's parameters are stored in: bf16 for a bf16 run on `device`, else fp32."""
    return torch.bfloat16 if resolve_precision(precision, device) == "bf16" else torch.float32


@dataclass(frozen=True)
class WindowShare:
    """The dp replicas that split a list of jobs: this one is `rank` of `size`, `group` their process group
    (None: a single replica), `device` where the group's collectives run."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    device: torch.device = torch.device("cpu")

    def passes(self, total: int) -> list[tuple[int, bool]]:
        """(job index, counted) for each pass this replica runs: jobs rank, rank + size, ..., then, to run
        ceil(total / size) passes like every replica, its first job (or job 0) again, not counted."""
        mine = list(range(self.rank, total, self.size))
        rounds = math.ceil(total / self.size)
        filler = mine[0] if mine else 0
        return [(i, True) for i in mine] + [(filler, False)] * (rounds - len(mine))

    def run(
        self, jobs: Sequence[Callable[[], T]], progress: Callable[[int, int], None] | None = None
    ) -> list[T]:
        """Every job's result in job order, the same on every rank: this replica runs its share (`passes`),
        the results are gathered over the replicas. `progress(done, total)` after each pass, with the jobs
        done over all replicas."""
        results: dict[int, T] = {}
        done = 0
        for index, counted in self.passes(len(jobs)):
            result = jobs[index]()
            if counted:
                results[index] = result
            before, done = done, done + self._sum(int(counted))
            if progress is not None and done > before:
                progress(done, len(jobs))
        if self.size == 1:
            return [results[i] for i in range(len(jobs))]
        parts: list[dict[int, T] | None] = [None] * self.size
        dist.all_gather_object(parts, results, group=self.group)
        merged = {index: value for part in parts for index, value in (part or {}).items()}
        return [merged[i] for i in range(len(jobs))]

    def _sum(self, count: int) -> int:
        if self.size == 1:
            return count
        total = torch.full((1,), count, dtype=torch.int64, device=self.device)  # no host-to-device copy
        dist.all_reduce(total, group=self.group)
        return int(total.item())  # one host sync per pass of a whole window: nothing beside its forward


@dataclass
class ScoringRun:
    """This rank's place for scoring: the mesh (None in one process), its device, its share of the jobs."""

    parallel: ParallelRun | None
    device: torch.device
    share: WindowShare

    @classmethod
    def from_environment(cls, config: TrainConfig) -> ScoringRun:
        """The dp x cp x ep mesh of the processes a launcher started, or a single process."""
        device = run_device()
        dims = ParallelDims(config.parallel.dp, config.parallel.cp, config.parallel.ep)
        parallel = ParallelRun.from_environment(
            dims, config.parallel.cp_layout, config.parallel.fsdp, device.type
        )
        if parallel is None:
            return cls(None, device, WindowShare(device=device))
        share = WindowShare(parallel.mesh.coordinates["dp"], dims.dp, parallel.mesh.dp_group, parallel.device)
        return cls(parallel, device, share)

    @property
    def is_output_rank(self) -> bool:
        return self.parallel is None or self.parallel.is_output_rank


def verified_checkpoint(path: Path, run: ScoringRun) -> Path:
    """`path` if its files match their checksums (the ranks share the reading), else the newest intact
    checkpoint of the same run before it (with a warning naming the damaged files)."""
    path = Path(path)
    if path.parent.name != CHECKPOINTS_DIR:
        return path  # a checkpoint outside a run folder: nothing older to fall back to
    checkpointer = Checkpointer(path.parent.parent)
    older = [p for p in checkpointer.complete() if is_sharded(p) and p.name <= path.name]
    share = (run.parallel.rank, run.parallel.dims.world) if run.parallel is not None else (0, 1)
    damaged: list[str] = []
    for candidate in reversed(older or [path]):
        problems = verify_checkpoint(candidate, share, prefix=f"{STATE_DIR}/")
        if not (_sum_world(len(problems), run) if run.parallel is not None else problems):
            if damaged:
                warnings.warn(f"damaged, using {candidate} instead: {'; '.join(damaged)}", stacklevel=3)
            return candidate
        damaged += problems or [f"{candidate}: damaged on another rank"]
    raise FileNotFoundError(
        f"every sharded checkpoint in {checkpointer.root} is damaged: {'; '.join(damaged)}"
    )


def _sum_world(count: int, run: ScoringRun) -> int:
    """`count` summed over every rank of the launched group."""
    assert run.parallel is not None
    total = torch.tensor([count], dtype=torch.int64, device=run.parallel.device)
    dist.all_reduce(total)
    return int(total.item())


def scoring_source(path: str, run: ScoringRun) -> str:
    """The model to read for `path`: itself, or for a damaged sharded checkpoint the run's newest intact one
    before it (`verified_checkpoint`). Collective in a launched group: every rank calls it."""
    if is_preset(path) or not is_sharded(Path(path)):
        return path
    return str(verified_checkpoint(Path(path), run))


def load_scoring_model(path: str, config: TrainConfig, run: ScoringRun) -> nn.Module:
    """The model at `path` for scoring whole windows on `run`: a Hugging Face folder, a preset, or a sharded
    checkpoint's step folder (holding the model's config.json beside `state/`; check it with `scoring_source`
    first). The model has the run's `model_options`, its parameters the run's precision (`scoring_dtype`)."""
    source = Path(path)
    dtype = scoring_dtype(config.memory.precision, run.device)
    if run.parallel is None:
        if is_sharded(source):
            model = GlmForCausalLM.from_config(model_config_of(path), config.model_options, dtype, "meta")
            model.to_empty(device=run.device)
            load_sharded_model(source, model, None)
        else:
            model = load_model(path, dtype=dtype, options=config.model_options, device=run.device)
        return model.eval()

    if is_preset(path):  # random weights, the same on every rank (seeded): built whole, then split
        torch.manual_seed(config.optim.seed)
        model = load_model(path, dtype=dtype, options=config.model_options, device=run.device)
        run.parallel.prepare(
            model,
            fsdp_param_dtype(config.memory.precision, run.device),
            config.parallel.ep_capacity_factor,
            overlap=config.parallel.ep_overlap,
            prefetch=config.parallel.fsdp_prefetch,
        )
    else:
        model = build_scoring_model(model_config_of(path), config, run)
        if is_sharded(source):
            load_sharded_model(source, model, run.parallel.mesh)
        else:
            load_rank_shard(model, source)
    model.eval()
    context = run.parallel.context
    return ContextParallelScorer(model, context) if context is not None else model


def build_scoring_model(model_config: ModelConfig, config: TrainConfig, run: ScoringRun) -> GlmForCausalLM:
    """The model of `model_config` split over `run`'s mesh as training splits it (context parallel, expert
    parallel, FSDP2), its parameters in the run's precision on `run.device`, uninitialised: fill them with
    `load_rank_shard` or `load_sharded_model`."""
    assert run.parallel is not None, "build_scoring_model splits over a mesh; one process uses load_model"
    dtype = scoring_dtype(config.memory.precision, run.device)
    model = GlmForCausalLM.from_config(model_config, config.model_options, dtype, "meta")
    run.parallel.prepare(
        model,
        fsdp_param_dtype(config.memory.precision, run.device),
        config.parallel.ep_capacity_factor,
        overlap=config.parallel.ep_overlap,
        prefetch=config.parallel.fsdp_prefetch,
    )
    model.to_empty(device=run.device)
    return model


# ------------------------------------------------------------------------------------------ scoring windows
@dataclass
class Scores:
    """Per-token loss of W windows of S tokens; position t is the prediction of token t + 1.

    loss: float32 [W, S] nats (0 where not valid); valid: bool [W, S] (a real next base);
    softmask: bool [W, S] (the predicted base is soft-masked, i.e. a repeat);
    cut_loss: float32 [W, L] loss of the last bucket's L positions with only the preceding bucket as
    context, or None when not scored; cut_start: the last bucket's first position.
    """

    loss: np.ndarray
    valid: np.ndarray
    softmask: np.ndarray
    cut_loss: np.ndarray | None = None
    cut_start: int = 0


def last_bucket_start(seq: int, bucket: int) -> int:
    """First position of the last (possibly shorter) bucket of a window of `seq` positions."""
    return (seq - 1) // bucket * bucket


def context_cut_tokens(seq: int, bucket: int, context_cut: bool) -> int:
    """Tokens of the context cut's forward of a `seq`-token window: the last bucket with only the one before
    it as context, seq - c + bucket for the last bucket's start c; 0 where the evaluator skips it
    (`context_cut` off, or fewer than 2 buckets)."""
    start = last_bucket_start(seq, bucket)
    return seq - start + bucket if context_cut and start >= bucket else 0


def _device(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def token_losses(model: torch.nn.Module, window: Window, precision: str) -> np.ndarray:
    """float32 [L] loss of each position of `window` the model reads (0 where the label is ignored), under the
    run's `precision`."""
    device = _device(model)
    ids, labels = device_rows([window.input_ids, window.labels], device)  # pinned, no host wait on CUDA
    with autocast_for(precision, device):
        out = model.loss(ids, labels, reduction="none")
    return out[0].float().cpu().numpy()


def score_windows(
    model: torch.nn.Module,
    windows: Sequence[Window],
    bucket: int,
    context_cut: bool,
    progress: bool = False,
    precision: str = "auto",
    share: WindowShare | None = None,
) -> Scores:
    """Score every window of `windows` (all of one length S) with `model`, in `precision` ("auto": bf16 on
    CUDA as in training, fp32 on the CPU); with `share`, the dp replicas split the windows (each scored once,
    the scores gathered on every rank).

    With `context_cut`, the last bucket's positions [c, S) are scored again from input_ids[c - bucket:S]
    only (the preceding bucket as context), c = `last_bucket_start(S, bucket)`; needs at least 2 buckets.
    """
    if not len(windows):
        raise ValueError("no windows to score")
    share = share if share is not None else WindowShare()
    seq = len(windows[0].input_ids)
    cut_start = last_bucket_start(seq, bucket)
    if context_cut and cut_start < bucket:
        raise ValueError(
            f"the context cut needs at least 2 buckets per window; SEQ {seq} holds one of {bucket}"
        )
    valid = np.zeros((len(windows), seq), dtype=bool)
    softmask = np.zeros((len(windows), seq), dtype=bool)
    for i in range(len(windows)):
        labels = windows[i].labels
        if len(labels) != seq:
            raise ValueError(f"window {i} has {len(labels)} tokens, window 0 has {seq}")
        valid[i] = (labels != IGNORE_INDEX).numpy()
        softmask[i] = windows[i].predicted_softmask.numpy()

    def job(i: int) -> tuple[np.ndarray, np.ndarray | None]:
        window = windows[i]
        loss = np.where(valid[i], token_losses(model, window, precision), 0.0).astype(np.float32)
        if not context_cut:
            return loss, None
        part = token_losses(model, window.cropped(cut_start - bucket), precision)[bucket:]
        return loss, np.where(valid[i, cut_start:], part, 0.0).astype(np.float32)

    model.eval()
    with torch.no_grad():
        rows = share.run(
            [functools.partial(job, i) for i in range(len(windows))],
            progress_bar("score", "window") if progress else None,
        )
    loss = np.stack([row[0] for row in rows])
    cut_loss = np.stack([row[1] for row in rows]) if context_cut else None
    return Scores(loss, valid, softmask, cut_loss, cut_start)


def pick_windows(total: int, wanted: int) -> list[int]:
    """Indices of `wanted` of `total` windows (0 = all) spread evenly, in order: the rule `genomelm eval`,
    the read-outs and the evaluation during training share, so all score the same windows."""
    if wanted <= 0 or wanted >= total:
        return list(range(total))
    return [int(i) for i in np.linspace(0, total - 1, wanted).round()]


@dataclass(frozen=True)
class WindowRule:
    """Which held-out windows are candidates: all, or (`min_far_copies` > 0) those whose `last` positions
    predict at least that share of far-copy bases (`genomelm.data.far_copy`, a fact of the sequence alone):
    where retrieving far context can pay, chosen without looking at any model's loss."""

    min_far_copies: float = 0.0
    last: int = 0

    def describe(self) -> str:
        if self.min_far_copies <= 0:
            return "every held-out window"
        share = f"{self.min_far_copies:.1%}"
        return f"held-out windows whose last {self.last:,} positions predict >= {share} far copies"

    def shares(self, windows: Sequence[Window]) -> list[float]:
        """The far-copy share of each window's last positions."""
        return [float(predicted_far_copy(windows[i])[-self.last :].mean()) for i in range(len(windows))]

    def pick(self, windows: Sequence[Window], wanted: int) -> tuple[list[int], int, float]:
        """(indices of `wanted` candidates spread as `pick_windows` spreads them, number of candidates, the
        largest share seen: 1.0 without a far-copy rule)."""
        candidates, best = list(range(len(windows))), 1.0
        if self.min_far_copies > 0:
            shares = self.shares(windows)
            candidates = [i for i in candidates if shares[i] >= self.min_far_copies]
            best = max(shares, default=0.0)
        return [candidates[i] for i in pick_windows(len(candidates), wanted)], len(candidates), best
