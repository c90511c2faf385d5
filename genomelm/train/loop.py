"""The training loop, in named parts: build the run, resume it, one step (`genomelm.train.step.TrainStep`, the
step the planner measures too), record it, save it.

One window per micro-batch, AdamW with warmup + cosine, gradient accumulation and clipping, the memory stack
around every layer, atomic checkpoints, exact resume, a guard against non-finite steps. Under a launcher
(dp x cp processes, ep borrowing them) every rank runs this loop: `genomelm.parallel` splits the model over
the mesh before the optimizer is made, each dp rank reads its own windows, checkpoints are sharded, and rank 0
alone logs and prints. With `eval_every=N` every N-th step also scores held-out windows
(`genomelm.train.heldout`) into that step's metrics row, without changing the training.
"""

from __future__ import annotations

import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from genomelm.data.errors import space_checked
from genomelm.model import GlmForCausalLM, ModelConfig, load_model, save_model
from genomelm.model.config import MOE, is_preset
from genomelm.parallel.checkpoint import Checkpointer, write_checksums
from genomelm.parallel.expert_slots import placements_by_module
from genomelm.parallel.export import export_checkpoint_collective
from genomelm.parallel.launcher_watch import check_launcher
from genomelm.parallel.mesh import ParallelDims
from genomelm.parallel.rank_loading import load_rank_shard
from genomelm.parallel.training import ParallelRun
from genomelm.run.config import TrainConfig
from genomelm.run.metrics import (
    EXPERT_PLACEMENT_FILE,
    HELDOUT_LOSS,
    MetricsLog,
    device_peak_gb,
    host_memory_gb,
)
from genomelm.run.models import device_rows, model_config_of, run_device
from genomelm.run.precision import fsdp_param_dtype, fsdp_reduce_dtype
from genomelm.run.stop import StopCheck
from genomelm.train.balance import (
    PlacedLayer,
    RoutedTotals,
    expert_placements,
    write_placements,
)
from genomelm.train.faults import inject_fault
from genomelm.train.feed import TrainingData, Window
from genomelm.train.guards import (
    RunMismatch,
    check_random_init,
    check_resume,
    check_run_folder,
    check_vocabulary,
    run_identity,
    same_step,
)
from genomelm.train.heldout import HeldoutEval, heldout_line
from genomelm.train.memory import LayerRunner, set_chunk_recompute
from genomelm.train.optimizer import make_optimizer, store_weights
from genomelm.train.step import StepOutcome, TrainStep, lr_factor


class NonFiniteLoss(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""

    exit_code = 2  # the user's input (`genomelm.run.failures`)


@dataclass
class Run:
    """A training run set up on this rank."""

    config: TrainConfig  # with `steps` resolved from epochs
    device: torch.device
    parallel: ParallelRun | None
    data: TrainingData
    model: GlmForCausalLM
    optimizer: torch.optim.Optimizer
    runner: LayerRunner
    step: TrainStep
    checkpointer: Checkpointer
    identity: dict[str, Any]
    resume_from: Path | None = None
    heldout: HeldoutEval | None = None  # with eval_every > 0
    start_step: int = 0
    bad_in_row: int = 0
    log: MetricsLog | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    routed: RoutedTotals = field(default_factory=RoutedTotals)

    @property
    def output_rank(self) -> bool:
        return self.parallel is None or self.parallel.is_output_rank

    @property
    def rank(self) -> int:
        return self.parallel.rank if self.parallel is not None else 0


def train(config: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Train as configured; returns a summary (steps run, last loss, checkpoint path, skipped steps).

    Inside a launched group (dp x cp processes) every rank runs this with the same config: each dp rank reads
    its own windows, each cp rank keeps its shard of them, and rank 0 alone writes metrics and the progress
    bar.
    """
    run = build_run(config)
    config = run.config
    progress = progress and run.output_rank
    if progress:
        print(
            f"model {config.model}: {sum(p.numel() for p in run.model.parameters()):,} parameters on "
            f"{run.device}\n{run.model.route_table()}\nmemory: {run.runner.describe()}",
            flush=True,
        )
    run.log = MetricsLog(config, resumed_step=run.start_step) if run.output_rank else None
    run.summary = {"start_step": run.start_step, "losses": [], "skipped": 0, "checkpoint": run.resume_from}
    bar = tqdm(
        range(run.start_step, config.optim.steps),
        initial=run.start_step,
        total=config.optim.steps,
        disable=not progress,
        desc=f"train {config.run}",
        unit="step",
    )
    stop = StopCheck(config.run_dir)
    try:
        if stop.agreed(run.device):  # asked to stop while the run started: nothing to save
            run.summary["stopped"] = {"step": run.start_step, "signal": stop.received, "first": True}
        for step in bar if "stopped" not in run.summary else ():
            record = train_one_step(run, step)
            if progress and HELDOUT_LOSS in record:
                tqdm.write(heldout_line(step + 1, record))
            bar.set_postfix(
                loss=f"{record['loss']:.4f}",
                tok_s=f"{record['tokens_per_s']:.0f}",
                mem_gb=f"{max(record['peak_device_mem_gb'], record['host_peak_rss_gb']):.1f}",
            )
            check_launcher()  # a rank whose launcher is gone stops here, saving nothing
            saved = (step + 1) % config.checkpoint.save_every == 0 or step + 1 == config.optim.steps
            if saved:
                save(run, step + 1)
            if step + 1 < config.optim.steps and stop.agreed(run.device):
                if not saved:
                    save(run, step + 1)
                run.summary["stopped"] = {"step": step + 1, "signal": stop.received}
                break
    finally:
        bar.close()
        if run.log is not None:
            run.log.close()
    if "stopped" not in run.summary and run.start_step == config.optim.steps and run.resume_from is not None:
        export_final(run, run.resume_from)  # a run resumed at its end: finish an export a kill cut short
    run.summary["steps"] = config.optim.steps
    return run.summary


# ------------------------------------------------------------------------------------------- build the run
def build_run(config: TrainConfig) -> Run:
    """Everything a rank needs before its first step: mesh, seeds, data, checks, model, optimizer, state."""
    dims = ParallelDims(config.parallel.dp, config.parallel.cp, config.parallel.ep)
    device = run_device()
    parallel = ParallelRun.from_environment(
        dims, config.parallel.cp_layout, config.parallel.fsdp, device.type
    )
    torch.manual_seed(config.optim.seed)
    np.random.seed(config.optim.seed)
    random.seed(config.optim.seed)
    data = TrainingData(config)
    heldout = HeldoutEval.for_run(config, parallel, device)  # read now: a folder without any fails here
    if not config.model:
        raise RunMismatch(
            "no model: this run config trains from a released checkpoint; pass MODEL=/path/to/GLM-5.3-Flash "
            "(make train) or model=<folder> (genomelm train), or model=<preset> for a small model"
        )
    config = config.replace(steps=config.total_steps(len(data)))
    checkpointer = Checkpointer(config.run_dir)
    if parallel is None or parallel.is_output_rank:
        config.run_dir.mkdir(parents=True, exist_ok=True)
        checkpointer.clean_interrupted_writes()
    model_config = checked_model_config(config, data)
    dims.check(model_config.n_routed_experts if MOE in model_config.mlp_layer_types else None)
    identity = run_identity(config, data.manifest)
    resume_from, state = resume_state(config, checkpointer, identity, parallel)
    check_run_folder(checkpointer, state["step"] if state is not None else 0, config.optim.steps)
    if state is not None:
        config, changed = same_step(config, state.get("config"), resume_from)
        if changed and (parallel is None or parallel.is_output_rank):
            warnings.warn(changed, stacklevel=1)
    placed = placed_by_load(config, model_config, state, parallel)
    model = build_model(config, model_config, device, parallel, resume_from, checkpointer, placed)
    runner = LayerRunner.for_memory(config.memory)
    optimizer = make_optimizer(model, config.optim, device, sharded=parallel is not None and parallel.fsdp)
    step = TrainStep.for_run(config, model, optimizer, runner, parallel, device)
    run = Run(
        config,
        device,
        parallel,
        data,
        model,
        optimizer,
        runner,
        step,
        checkpointer,
        identity,
        resume_from,
        heldout=heldout,
    )
    if state is not None:
        resume(run, state)
    return run


def checked_model_config(config: TrainConfig, data: TrainingData) -> ModelConfig:
    """The run's architecture, after refusing a random full-size preset and data with other token ids (before
    any weights are read)."""
    preset = ModelConfig.preset(config.model) if is_preset(config.model) else None
    check_random_init(config.model, preset, config.allow_random_init)
    model_config = preset if preset is not None else model_config_of(config.model)
    check_vocabulary(data.vocab, config.data_dir, config.model, model_config)
    return model_config


def build_model(
    config: TrainConfig,
    model_config: ModelConfig,
    device: torch.device,
    parallel: ParallelRun | None,
    resume_from: Path | None,
    checkpointer: Checkpointer,
    placed: dict[int, PlacedLayer] | None = None,
) -> GlmForCausalLM:
    """The model to train, split over the mesh when there is one. Under FSDP each rank builds it empty and
    reads only its own shard of the weights (from the model folder, or later from a sharded checkpoint).
    `placed`: MoE layer index -> where its experts live over the ep ranks (others: the static blocks)."""
    sharded_resume = resume_from is not None and checkpointer.is_sharded(resume_from)
    source = str(resume_from / "model") if resume_from is not None and not sharded_resume else config.model
    shard_read = parallel is not None and parallel.fsdp and not is_preset(source)
    if shard_read:
        model = GlmForCausalLM.from_config(model_config, config.model_options, torch.float32, "meta")
    else:
        model = load_model(source, options=config.model_options, device=device)
    store_weights(model, config.optim)
    set_chunk_recompute(model, config.memory.recompute_chunks)
    for layer in model.layers:  # KDA resolves its kernel on the device now, not at the first step
        if hasattr(layer.self_attn, "resolve_backend"):
            try:
                layer.self_attn.resolve_backend(device)
            except RuntimeError as exc:
                raise RunMismatch(str(exc)) from exc
    init_dir = config.run_dir / "init"
    if (
        (parallel is None or parallel.is_output_rank)
        and resume_from is None
        and is_preset(config.model)
        and not (init_dir / "config.json").exists()
    ):
        needed = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        with space_checked(init_dir, needed, "the run's initial model (the 'before' model of genomelm eval)"):
            save_model(model, init_dir)  # the "before" model of `genomelm eval` for a random-init preset
    if parallel is not None:
        param_dtype = fsdp_param_dtype(config.memory.precision, device)
        parallel.prepare(
            model,
            param_dtype,
            config.parallel.ep_capacity_factor,
            config.parallel.optimizer_offload,
            config.parallel.ep_overlap,
            placements_by_module(model, {layer: p.placement for layer, p in (placed or {}).items()}),
            config.parallel.fsdp_prefetch,
            fsdp_reduce_dtype(config.parallel.reduce_dtype),
        )
        if shard_read:
            model.to_empty(device=device)
            if not sharded_resume:
                load_rank_shard(model, source)
    model.train()
    return model


def placed_by_load(
    config: TrainConfig, model_config: ModelConfig, state: dict[str, Any] | None, parallel: ParallelRun | None
) -> dict[int, PlacedLayer]:
    """With `expert_placement=balanced` and a routed load to go by (a resume): each MoE layer's experts placed
    by it, the same on every rank (the same checkpoint); the output rank writes the placement to the run
    folder and says what it gains. Else {}: the static blocks."""
    ep = config.parallel.ep
    if config.parallel.expert_placement != "balanced" or state is None:
        return {}
    copies = config.parallel.expert_copies
    placed = expert_placements(state.get("routed"), model_config.n_routed_experts, ep, copies)
    if placed and (parallel is None or parallel.is_output_rank):
        write_placements(config.run_dir, placed, ep, state["step"])
        static, balanced = (
            sum(getattr(p, k) for p in placed.values()) / len(placed) for k in ("static", "placed")
        )
        print(
            f"experts placed by the routed load of steps 1-{state['step']}: the busiest rank's rows over the "
            f"mean {static:.2f} -> {balanced:.2f} (mean over {len(placed)} MoE layers; runs/{config.run}/"
            f"{EXPERT_PLACEMENT_FILE})",
            flush=True,
        )
    return placed


# ------------------------------------------------------------------------------------------------- resume
def resume_state(
    config: TrainConfig, checkpointer: Checkpointer, identity: dict[str, Any], parallel: ParallelRun | None
) -> tuple[Path | None, dict[str, Any] | None]:
    """(checkpoint folder, its trainer state) to continue from, or (None, None) for a fresh start; refuses a
    checkpoint of another run, and a one-process checkpoint under a launcher."""
    resume = config.checkpoint.resume
    if resume == "never" and checkpointer.complete():
        names = ", ".join(path.name for path in checkpointer.complete())
        raise RunMismatch(
            f"resume=never, but {checkpointer.root} holds checkpoints of an earlier run ({names}): a "
            "fresh run there would mix with them (pruning keeps the highest steps). Continue that run with "
            "resume=auto, or give this one another name: run=NAME"
        )
    if resume == "auto":  # the newest checkpoint whose bytes are as written, the ranks sharing the reading
        share = (parallel.rank, parallel.dims.world) if parallel is not None else (0, 1)
        resume_from = checkpointer.latest_verified(
            share,
            _gather_over_ranks if parallel is not None else None,
            set_aside=parallel is None or parallel.is_output_rank,
        )
    else:
        resume_from = None if resume == "never" else Path(resume)
    if resume_from is None:
        return None, None
    state = checkpointer.read_trainer_state(resume_from)
    check_resume(state.get("identity"), identity, resume_from)
    if parallel is not None and not checkpointer.is_sharded(resume_from):
        raise RunMismatch(
            f"{resume_from} is a one-process checkpoint; resume it with one process (dp=1 cp=1 "
            "ep=1), or start a new run beside it: resume=never run=<new name>"
        )
    return resume_from, state


def _gather_over_ranks(problems: list[str]) -> list[str]:
    """Every rank's `problems`, joined in rank order (on every rank of the launched group)."""
    found: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, problems)
    return [problem for part in found for problem in part or []]


def resume(run: Run, state: dict[str, Any]) -> None:
    """Optimizer, RNG, data order and step counters from the checkpoint the run continues from."""
    mesh = run.parallel.mesh if run.parallel is not None else None
    run.checkpointer.load(run.resume_from, run.model, run.optimizer, state, mesh)
    run.data.load(state["data_order"])
    run.start_step, run.bad_in_row = state["step"], state["bad_in_row"]
    run.routed.load(state.get("routed"))


# ----------------------------------------------------------------------------------------------- one step
def train_one_step(run: Run, step: int) -> dict[str, Any]:
    """Optimizer step `step` (0-based): this rank's windows through `TrainStep`, then its metrics row (logged
    by rank 0), with the held-out loss every `eval_every` steps (every rank scoring; the row then logged
    whatever `log_every` says); raises `NonFiniteLoss` on every rank alike after `max_bad_steps` non-finite
    steps in a row."""
    config = run.config
    started = time.perf_counter()
    tracker = memory_tracker(run.model, run.optimizer) if config.log.track_memory else None
    lr = config.optim.lr * lr_factor(step, config.optim, config.optim.steps)  # a function of the step alone
    seen: list[Window] = []
    outcome = run.step.run(lr, step_windows(run, step, seen))
    run.bad_in_row = 0 if outcome.finite else run.bad_in_row + 1
    run.routed.add(outcome.expert_load)
    run.summary["skipped"] += not outcome.finite
    inject_fault(config.run_dir, step + 1, run.rank)
    elapsed = time.perf_counter() - started
    if tracker is not None:
        tracker.__exit__(None, None, None)
    record = step_record(run, step, lr, outcome, seen, elapsed)
    if tracker is not None:
        record["peak_tracked_gb"] = tracked_peak_gb(tracker, run.device)
    evaluated = run.heldout is not None and run.heldout.due(step + 1)
    if evaluated:
        # the step's gradients are spent (the next step starts by dropping them): free their memory for the
        # forward passes now
        run.optimizer.zero_grad(set_to_none=True)
        record |= run.heldout.run(run.model, step + 1)
    if run.log is not None and ((step + 1) % config.log.log_every == 0 or not outcome.finite or evaluated):
        run.log.log(record)
    run.summary["losses"].append(outcome.loss)
    if not outcome.finite:
        check_bad_steps(run, step, outcome)
    return record


def step_windows(run: Run, step: int, seen: list[Window]):
    """This rank's windows of `step` as model rows on its device (appended to `seen`): micro-batch g of the
    step goes to dp rank g % dp; every rank reads all of them to keep one data order."""
    data_rank = run.parallel.mesh.coordinates["dp"] if run.parallel is not None else 0
    dp = run.config.parallel.dp
    for micro in range(run.config.optim.grad_accum * dp):
        window = run.data.next(step, micro)
        if micro % dp != data_rank:
            continue
        seen.append(window)
        weights = window.loss_weights(run.config.data_options.softmask_weight)
        yield device_rows([window.input_ids, window.labels, weights], run.device)


def check_bad_steps(run: Run, step: int, outcome: StepOutcome) -> None:
    """Say a non-finite step was skipped; stop the run (every rank alike) after `max_bad_steps` in a row."""
    limit = run.config.optim.max_bad_steps
    if run.output_rank:
        tqdm.write(
            f"step {step + 1}: non-finite loss/gradient ({outcome.loss}, {outcome.grad_norm}); step "
            f"skipped ({run.bad_in_row} in a row, limit {limit})"
        )
    if run.bad_in_row >= limit:
        metrics = run.config.run_dir / "metrics.jsonl"
        raise NonFiniteLoss(
            f"{run.bad_in_row} non-finite steps in a row at step {step + 1}; lower lr or check "
            f"the data (metrics: {metrics})"
        )


# ----------------------------------------------------------------------------------------------- record it
def step_record(
    run: Run, step: int, lr: float, outcome: StepOutcome, seen: list[Window], elapsed: float
) -> dict[str, Any]:
    """The metrics row of a step: loss, schedule, speed, memory, the windows of every dp rank, routing."""
    config, parallel = run.config, run.parallel
    mine = [
        {"index": w.index, "source": w.source, "reverse": w.reverse, "tokens": len(w.input_ids)} for w in seen
    ]
    windows = parallel.gather_over_data(mine) if parallel is not None else mine
    rss, peak_rss = host_memory_gb()
    record = {
        "step": step + 1,
        "loss": outcome.loss,
        "lr": lr,
        "grad_norm": outcome.grad_norm,
        "tokens_per_s": sum(w["tokens"] for w in windows) / elapsed,
        "step_s": elapsed,
        "skipped": not outcome.finite,
        "peak_device_mem_gb": device_peak_gb(),
        "host_rss_gb": rss,
        "host_peak_rss_gb": peak_rss,
        "windows": [w["index"] for w in windows],
        "sources": [w["source"] for w in windows],
        "reverse": [w["reverse"] for w in windows],
        "tokens": [w["tokens"] for w in windows],
        "loss_weighted": config.data_options.softmask_weight != 1.0,
    }
    if config.data_options.softmask_weight != 1.0:
        record["loss_unweighted"] = outcome.loss_unweighted
    rows_by_rank = parallel.expert_rows_by_rank(run.model) if parallel is not None else None
    if rows_by_rank:
        record["ep/rows_by_rank"] = rows_by_rank
        record["ep/busiest_over_mean"] = max(rows_by_rank) * len(rows_by_rank) / max(sum(rows_by_rank), 1)
    if run.model.last_indexer_loss:
        record["indexer_kl"] = float(sum(run.model.last_indexer_loss.values()))
    load = outcome.expert_load
    unused = load.unused()
    for layer, ratio in load.max_over_mean().items():
        record[f"router/{layer}/max_over_mean"] = ratio
        record[f"router/{layer}/unused_experts"] = unused[layer]
    return record


def memory_tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """torch's MemTracker (what `genomelm plan` measures fake tensors with), entered on this step's real
    tensors: parameters, gradients, optimizer state, activations and transients by module."""
    from torch.distributed._tools.mem_tracker import MemTracker  # only with track_memory=true

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    tracker.__enter__()
    return tracker


def tracked_peak_gb(tracker: Any, device: torch.device) -> float:
    """The step's peak of tracked bytes on `device`, in GB (2^30 bytes, as the plan's GiB)."""
    peaks = tracker.get_tracker_snapshot("peak")
    return (
        max((by_kind.get("Total", 0) for dev, by_kind in peaks.items() if dev.type == device.type), default=0)
        / 2**30
    )


# ------------------------------------------------------------------------------------------------- save it
def save(run: Run, step: int) -> None:
    """Checkpoint after optimizer step `step` (every rank takes part under a launcher); after the last step of
    a sharded run, also its Hugging Face copy (`export_final`, as the settings say)."""
    config = run.config
    state = {
        "step": step,
        "bad_in_row": run.bad_in_row,
        "data_order": run.data.state(),
        "config": config.to_dict(),
        "identity": run.identity,
        "routed": run.routed.state(),
    }
    mesh = run.parallel.mesh if run.parallel is not None else None
    path = run.checkpointer.save(
        step, run.model, run.optimizer, state, mesh, config.checkpoint.keep_checkpoints
    )
    if run.output_rank and run.routed.counts:
        run.routed.write(config.run_dir, step)
    if step == config.optim.steps:
        export_final(run, path)
    run.summary["checkpoint"] = path


def writes_final_export(config: TrainConfig) -> bool:
    """Whether a sharded run writes the Hugging Face copy of its last checkpoint (`checkpoint.export_final`):
    "true" always, "false" never, "auto" unless the run spans more than one node: more ranks (dp * cp) than
    `plan.gpus_per_node`, or Ray workers on an existing cluster (`ray_address`). There the copy is a long
    extra write (313B parameters: about 1.25 TB in fp32) that `genomelm eval` does not need."""
    setting = config.checkpoint.export_final
    if setting != "auto":
        return setting == "true"
    parallel = config.parallel
    joins_cluster = parallel.launcher == "ray" and bool(parallel.ray_address)
    return parallel.world <= config.plan.gpus_per_node and not joins_cluster


def export_final(run: Run, path: Path) -> None:
    """The Hugging Face copy (`model/`, for transformers and other tools; `genomelm eval` reads the sharded
    checkpoint itself) of the run's last checkpoint `path`, when it is sharded, the copy is missing and
    `writes_final_export` says so. Collective under a launcher (every rank calls it; rank 0's view of the
    folder decides for all): each rank writes its share of the files and records their checksums
    (`checksums/model-rank-<rank>.json`), so `verify_checkpoint(path, prefix="model/")` checks them all.
    Written atomically: a kill leaves no copy, and a re-run writes it."""
    wanted = [
        writes_final_export(run.config)
        and run.checkpointer.is_sharded(path)
        and not (path / "model" / "config.json").exists()
    ]
    if run.parallel is not None:
        dist.broadcast_object_list(wanted, src=0)  # every rank enters the collective export, or none
    if wanted[0]:
        files = export_checkpoint_collective(path, path / "model", dtype=torch.float32)
        write_checksums(path, files, f"model-rank-{run.rank:05d}")
