"""The training loop: one window per micro-batch, AdamW with warmup + cosine, gradient accumulation and
clipping, the memory stack around every layer, atomic checkpoints, exact resume, NaN/inf guard.

Under a launcher (dp x cp processes, ep borrowing them) every rank runs this loop: `genomelm.parallel` splits
the model over the mesh before the optimizer is made, each dp rank reads its own windows, and checkpoints are
sharded (`genomelm.parallel.sharded_checkpoint`); rank 0 alone logs and prints.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from genomelm.data.vocab import IGNORE_INDEX
from genomelm.model import GlmForCausalLM, ModelConfig, RunOptions, load_model, save_model
from genomelm.model.config import MOE
from genomelm.parallel.mesh import ParallelDims
from genomelm.parallel.sharded_checkpoint import is_sharded, load_sharded, save_sharded
from genomelm.parallel.training import ContextRun, ParallelRun
from genomelm.train import checkpoints
from genomelm.train.balance import ExpertLoad, update_expert_bias
from genomelm.train.config import TrainConfig
from genomelm.train.feed import TrainingData
from genomelm.train.guards import RunMismatch, check_random_init, check_resume, check_vocabulary, run_identity
from genomelm.train.memory import LayerRunner, set_chunk_recompute
from genomelm.train.metrics import MetricsLog, device_peak_gb, host_memory_gb
from genomelm.train.precision import autocast_for, resolve_precision


def run_options(config: TrainConfig) -> RunOptions:
    return RunOptions(
        moe_chunk_tokens=config.moe_chunk_tokens,
        indexer_query_block=config.indexer_query_block,
        attention_query_block=config.attention_query_block,
        loss_chunk_tokens=config.loss_chunk_tokens,
        train_indexer=config.train_indexer,
    )


def lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warmup over `warmup_steps`, then cosine from 1 down to `min_lr_ratio` at `steps`."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(config.steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, config: TrainConfig, device: torch.device,
                   sharded: bool = False) -> torch.optim.AdamW:  # fmt: skip
    """AdamW over fp32 master weights; no weight decay on vectors (norms, biases, gates, decays). `sharded`: the
    parameters are DTensors on two meshes (FSDP2 with expert parallel), which one foreach kernel cannot mix."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fast = {"foreach": False} if sharded else {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, **fast)


def inject_fault(config: TrainConfig, step: int, rank: int) -> None:
    """The `fault_at_step` test knob: rank `fault_rank` exits hard (no cleanup, like a lost node) after optimizer
    step `fault_at_step`, once per run (a marker in the run folder keeps a restarted run going)."""
    if not config.fault_at_step or step != config.fault_at_step or rank != config.fault_rank:
        return
    marker = config.run_dir / f".fault-injected-step{step}-rank{rank}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    os._exit(17)


def window_loss(
    model: torch.nn.Module, rows: list[torch.Tensor], runner: LayerRunner | None, context: ContextRun | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training loss of one window, or this rank's share of it under context parallelism.

    rows: input_ids, labels [1, S] long and loss weights [1, S] fp32 of the whole window. Returns the loss
    (with graph): the token-weighted mean sum(w * nll) / sum(w) over the whole window, plus the indexer KL terms
    when trained; under CP each rank holds its shard and divides by the window's total weight, so the ranks'
    losses add up to the window's. Also [total weight, valid labels, nll sum] over the window (no graph).
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


def memory_tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """torch's MemTracker (what `genomelm plan` measures fake tensors with), entered on this step's real tensors:
    parameters, gradients, optimizer state, activations and transients by module."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    tracker.__enter__()
    return tracker


def tracked_peak_gb(tracker: Any, device: torch.device) -> float:
    """The step's peak of tracked bytes on `device`, in GB (2^30 bytes, as the plan's GiB)."""
    peaks = tracker.get_tracker_snapshot("peak")
    return max((by_kind.get("Total", 0) for dev, by_kind in peaks.items() if dev.type == device.type),
               default=0) / 2**30  # fmt: skip


class NonFiniteLoss(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


def train(config: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Train as configured; returns a summary (steps run, last loss, checkpoint path, skipped steps).

    Inside a launched group (dp x cp processes) every rank runs this with the same config: each dp rank reads
    its own windows, each cp rank keeps its shard of them, and rank 0 alone writes metrics and the progress bar.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dims = ParallelDims(config.dp, config.cp, config.ep)
    parallel = ParallelRun.from_environment(dims, config.cp_layout, config.fsdp, device.type)
    context = parallel.context if parallel is not None else None
    output_rank = parallel is None or parallel.is_output_rank
    progress = progress and output_rank
    if parallel is not None and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # the launcher picked this rank's GPU
    torch.manual_seed(config.seed)
    np.random.seed(config.seed)
    random.seed(config.seed)

    data = TrainingData(config)
    if not config.model:
        raise RunMismatch(
            "no model: this run config trains from a released checkpoint; pass MODEL=/path/to/GLM-5.3-Flash "
            "(make train) or model=<folder> (genomelm train), or model=<preset> for a small model"
        )
    config = dataclasses.replace(config, steps=config.total_steps(len(data)))

    run_dir = config.run_dir
    if output_rank:
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoints.clean_interrupted_writes(run_dir)
    resume_from = None
    if config.resume == "auto":
        resume_from = checkpoints.latest_checkpoint(run_dir)
    elif config.resume not in ("never", "", None):
        resume_from = Path(config.resume)

    preset = ModelConfig.preset(config.model) if checkpoints.is_preset(config.model) else None
    check_random_init(config.model, preset, config.allow_random_init)
    model_config = preset if preset is not None else ModelConfig.from_file(config.model)
    check_vocabulary(data.vocab, config.data_dir, config.model, model_config)  # before loading any weights
    identity = run_identity(config, data.manifest)
    resume_state = None
    sharded_resume = resume_from is not None and is_sharded(resume_from)
    if resume_from is not None:
        resume_state = torch.load(resume_from / "trainer.pt", weights_only=False)
        check_resume(resume_state.get("identity"), identity, resume_from)
        if parallel is not None and not sharded_resume:
            raise RunMismatch(f"{resume_from} is a one-process checkpoint; resume it with one process (dp=1 cp=1 "
                              "ep=1), or start this run afresh with resume=never")  # fmt: skip
    dims.check(model_config.n_routed_experts if MOE in model_config.mlp_layer_types else None)
    model_source = str(resume_from / "model") if resume_from and not sharded_resume else config.model
    shard_read = parallel is not None and parallel.fsdp and not checkpoints.is_preset(model_source)
    if shard_read:  # each rank builds an empty model and reads only its own shard of the weights
        model = GlmForCausalLM.from_config(model_config, run_options(config), torch.float32, "meta")
    else:
        model = load_model(model_source, options=run_options(config), device=device)
    set_chunk_recompute(model, config.recompute_chunks)
    for layer in model.layers:  # KDA resolves its kernel on the device now, not at the first step
        if hasattr(layer.self_attn, "resolve_backend"):
            try:
                layer.self_attn.resolve_backend(device)
            except RuntimeError as exc:
                raise RunMismatch(str(exc)) from exc
    init_dir = run_dir / "init"
    if (output_rank and resume_from is None and checkpoints.is_preset(config.model)
            and not (init_dir / "config.json").exists()):  # fmt: skip
        save_model(model, init_dir)  # the "before" model of `genomelm eval` for a random-init preset
    if parallel is not None:
        param_dtype = torch.bfloat16 if resolve_precision(config.precision, device) == "bf16" else None
        parallel.prepare(model, param_dtype, config.ep_capacity_factor, config.optimizer_offload)
        if shard_read:
            model.to_empty(device=device)
            if not sharded_resume:
                from genomelm.parallel.rank_loading import load_rank_shard

                load_rank_shard(model, model_source)
    model.train()
    runner = LayerRunner(recompute=config.recompute, offload=config.offload, keep_selection=config.keep_selection,
                         recompute_chunks=config.recompute_chunks)
    optimizer = make_optimizer(model, config, device, sharded=parallel is not None and parallel.fsdp)
    start_step, bad_in_row = 0, 0
    if resume_state is not None:
        state = resume_state
        if sharded_resume:
            load_sharded(resume_from, model, optimizer, parallel.mesh if parallel is not None else None)
        else:
            optimizer.load_state_dict(state["optimizer"])
            checkpoints.set_rng_state(state["rng"])
        data.load(state["data_order"])
        start_step, bad_in_row = state["step"], state["bad_in_row"]

    if progress:
        print(f"model {model_source}: {sum(p.numel() for p in model.parameters()):,} parameters on {device}\n"
              f"{model.path_table()}\nmemory: {runner.describe()}", flush=True)
    log = MetricsLog(config, resumed_step=start_step) if output_rank else None
    autocast = autocast_for(config.precision, device)
    summary: dict[str, Any] = {"start_step": start_step, "losses": [], "skipped": 0, "checkpoint": resume_from}
    data_rank = parallel.mesh.coordinates["dp"] if parallel is not None else 0
    mine = range(config.grad_accum * dims.dp)  # the step's micro-batches; g goes to dp rank g % dp
    bar = tqdm(range(start_step, config.steps), initial=start_step, total=config.steps, disable=not progress,
               desc=f"train {config.run}", unit="step")
    for step in bar:
        started = time.perf_counter()
        tracker = memory_tracker(model, optimizer) if config.track_memory else None
        lr = config.lr * lr_factor(step, config)  # the schedule is a function of the step alone
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss_sum, plain_sum, seen, load = 0.0, 0.0, [], ExpertLoad()
        for micro in mine:
            window = data.next(step, micro)
            if micro % dims.dp != data_rank:
                continue  # another dp rank's window (read to keep the one data order of every rank)
            seen.append({"index": window.index, "source": window.source, "reverse": window.reverse,
                         "tokens": len(window.input_ids)})
            rows = [t[None].to(device) for t in (window.input_ids, window.labels, window.weights)]
            with autocast:
                loss, totals = window_loss(model, rows, runner, context)
            load.add(model.router_stats())  # read before the backward's recompute routes the tokens again
            (loss / len(mine)).backward()
            local = loss.detach()
            loss_sum += float(context.global_sum(local) if context is not None else local)
            plain_sum += float(totals[2] / totals[1].clamp_min(1))
        loss_value, plain_value = loss_sum / config.grad_accum, plain_sum / config.grad_accum
        if parallel is not None:
            parallel.reduce_gradients(model)
            load.counts = parallel.sum_counts(load.counts)
            loss_value, plain_value = parallel.mean_over_data(loss_value), parallel.mean_over_data(plain_value)
            seen = parallel.gather_over_data(seen)
            grad_norm = parallel.clip_grad_norm_(model, config.grad_clip)
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip))
        finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
        if finite:
            optimizer.step()
            update_expert_bias(model.layers, load, config.expert_bias_speed)
            bad_in_row = 0
        else:
            optimizer.zero_grad(set_to_none=True)
            bad_in_row += 1
            summary["skipped"] += 1
        inject_fault(config, step + 1, parallel.rank if parallel is not None else 0)
        elapsed = time.perf_counter() - started
        if tracker is not None:
            tracker.__exit__(None, None, None)
        rss, peak_rss = host_memory_gb()
        record = {
            "step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": sum(w["tokens"] for w in seen) / elapsed, "step_s": elapsed, "skipped": not finite,
            "peak_device_mem_gb": device_peak_gb(), "host_rss_gb": rss, "host_peak_rss_gb": peak_rss,
            "windows": [w["index"] for w in seen], "sources": [w["source"] for w in seen],
            "reverse": [w["reverse"] for w in seen], "tokens": [w["tokens"] for w in seen],
            "loss_weighted": config.softmask_weight != 1.0,
        }
        if config.softmask_weight != 1.0:
            record["loss_unweighted"] = plain_value
        if tracker is not None:
            record["peak_tracked_gb"] = tracked_peak_gb(tracker, device)
        rows_by_rank = parallel.expert_rows_by_rank(model) if parallel is not None else None
        if rows_by_rank:
            record["ep/rows_by_rank"] = rows_by_rank
            record["ep/busiest_over_mean"] = max(rows_by_rank) * len(rows_by_rank) / max(sum(rows_by_rank), 1)
        if model.last_indexer_loss:
            record["indexer_kl"] = float(sum(model.last_indexer_loss.values()))
        unused = load.unused()
        for layer, ratio in load.max_over_mean().items():
            record[f"router/{layer}/max_over_mean"] = ratio
            record[f"router/{layer}/unused_experts"] = unused[layer]
        if log is not None and ((step + 1) % config.log_every == 0 or not finite):
            log.log(record)
        summary["losses"].append(loss_value)
        bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                        mem_gb=f"{max(record['peak_device_mem_gb'], peak_rss):.1f}")
        if not finite:
            tqdm.write(f"step {step + 1}: non-finite loss/gradient ({loss_value}, {grad_norm}); step skipped "
                       f"({bad_in_row} in a row, limit {config.max_bad_steps})")
            if bad_in_row >= config.max_bad_steps:
                if log is not None:
                    log.close()
                raise NonFiniteLoss(f"{bad_in_row} non-finite steps in a row at step {step + 1}; "
                                    f"lower lr or check the data (metrics: {log.path})")
        done = step + 1 == config.steps
        if (step + 1) % config.save_every == 0 or done:
            state = {
                "step": step + 1, "bad_in_row": bad_in_row, "schedule": {"step": step + 1, "lr": lr},
                "data_order": data.state(), "config": config.to_dict(), "identity": identity,
            }
            if parallel is not None:
                path = save_sharded(run_dir, step + 1, model, optimizer, state, parallel.mesh, config.keep_checkpoints)
                if done and output_rank:  # the Hugging Face copy `genomelm eval` reads, one layer at a time
                    from genomelm.parallel.export import export_checkpoint

                    export_checkpoint(path, path / "model", dtype=torch.float32)
                summary["checkpoint"] = path
            elif output_rank:
                state |= {"optimizer": optimizer.state_dict(), "rng": checkpoints.rng_state()}
                summary["checkpoint"] = checkpoints.save_checkpoint(run_dir, step + 1, model, state,
                                                                    config.keep_checkpoints)
    bar.close()
    if log is not None:
        log.close()
    summary["steps"] = config.steps
    return summary
