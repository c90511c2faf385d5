"""Layouts: the plan of one dp x cp x ep layout (memory and time put together: of the training step, or with
stage=eval of the evaluator's forward), every layout of the GPUs, and their ranking."""

from __future__ import annotations

import dataclasses
import math

import torch

from genomelm.model import ModelConfig
from genomelm.model.backends import as_on_gpu
from genomelm.model.config import DSA
from genomelm.plan.layouts import GIB, Assumptions, EvalTime, Layout, Plan, load_assumptions
from genomelm.plan.memory import (
    EVAL_RULE,
    MOE_RULE,
    OFFLOAD_RULE,
    SHARDING_RULE,
    ParameterShare,
    RankMemory,
    ScaledTraces,
    TraceCache,
    eval_rank_memory,
    model_bytes,
    model_numel,
    rank_memory,
    resolve_model_config,
    scaled_traces,
    trace_token_counts,
)
from genomelm.plan.optimizer_bytes import OPTIMIZER_RULE, state_bytes
from genomelm.plan.roofline import OVERLAP_RULE
from genomelm.plan.timing import (
    StepTime,
    context_cut_tokens,
    evaluation_time,
    forward_time,
    roofline_summary,
    step_time,
)
from genomelm.plan.trace import eval_param_dtype, eval_precision, reduced_layers
from genomelm.run.config import OPTIMIZERS, TrainConfig
from genomelm.run.precision import resolve_precision
from genomelm.train.optimizer import BF16_WEIGHTS


def traced_assumptions(a: Assumptions, model_config: ModelConfig, cp: int) -> Assumptions:
    """`a` as the traces of a cp-way split take it: trace_tokens raised, where the model has DSA layers, so
    that even the lower trace (trace_tokens/2 per rank, cp ranks) holds index_topk tokens: from there the
    indexer takes its full K pools per query (its top-k and the selection's filled slots stop growing),
    which a line through two traces below would keep growing. (The selection itself is always K pools
    wide, empty slots masked, so the sparse attention's per-query work does not depend on the window.)"""
    if DSA not in model_config.layer_types:
        return a
    saturated = 2 * math.ceil(model_config.index_topk / cp)
    return a if a.trace_tokens >= saturated else dataclasses.replace(a, trace_tokens=saturated)


def check_layout(config: TrainConfig, model_config: ModelConfig, dp: int, cp: int, ep: int) -> Layout:
    """The layout of dp x cp ranks with the experts over ep, for `config`'s window, fsdp and
    optimizer_offload (training's alone); ValueError when the window (with stage=eval, or its context cut)
    or the experts do not split so."""
    seq, world = config.seq_len, dp * cp
    if not splits(seq, cp):
        raise ValueError(f"seq {seq:,} does not split into cp={cp} shards of whole 128-token pieces")
    evaluating = config.plan.stage == "eval"
    cut = context_cut_tokens(config) if evaluating else 0
    if cut and not splits(cut, cp):
        raise ValueError(
            f"the context cut's {cut:,} tokens do not split into cp={cp} shards of whole 128-token pieces"
        )
    if world % ep or model_config.n_routed_experts % ep:
        raise ValueError(
            f"ep={ep} must divide dp*cp={world} and the {model_config.n_routed_experts} routed experts"
        )
    sharded = config.parallel.fsdp and world > 1
    opt_offload = config.parallel.optimizer_offload and sharded and not evaluating
    return Layout(dp, cp, ep, sharded, opt_offload, config.optim.optimizer)


def window_splits(config: TrainConfig, cp: int) -> bool:
    """Whether the window and, with stage=eval, its context cut split into cp shards (`splits`)."""
    cut = context_cut_tokens(config) if config.plan.stage == "eval" else 0
    return splits(config.seq_len, cp) and (not cut or splits(cut, cp))


def splits(seq: int, cp: int) -> bool:
    """Whether a window of `seq` tokens splits into cp shards of whole 128-token pieces."""
    return not (seq % cp or (seq // cp) % 128)


def plan_layout(
    config: TrainConfig,
    dp: int,
    cp: int,
    ep: int,
    assumptions: Assumptions,
    traces: TraceCache | None = None,
    model_config: ModelConfig | None = None,
    numel: dict[str, int] | None = None,
    stored: dict[str, int] | None = None,
) -> Plan:
    """The plan of one layout (dp x cp ranks, experts over ep) for `config`'s window and switches (fsdp,
    offload, optimizer_offload), of the training step or, with stage=eval, of the evaluation (`eval_plan`;
    `stored`: `model_bytes` of the evaluator's build)."""
    model_config = model_config or resolve_model_config(config)
    traces = traces or TraceCache()
    a = assumptions.resolved(config.plan.gpu).at_ep(ep, model_config.n_routed_experts)
    layout = check_layout(config, model_config, dp, cp, ep)
    if config.plan.stage == "eval":
        stored = stored or model_bytes(model_config, config.model_options, eval_param_dtype(config))
        return eval_plan(config, model_config, layout, a, stored, traces)
    numel = numel or model_numel(model_config)
    traced = traced_assumptions(a, model_config, cp)
    steps = scaled_traces(config, model_config, cp, traced, traces, optimizer=not layout.sharded)
    params = ParameterShare.of(numel, layout)
    state = state_bytes(model_config, config.model_options, config.optim.optimizer, layout)
    memory = rank_memory(config, model_config, layout, params, steps, a, state)
    time = step_time(config, model_config, layout, params, steps, memory.host_inputs, a, state)
    plan = _plan(config, layout, a, memory, time, _notes(config, model_config, layout, steps))
    for case in ("low", "high"):  # the range: every rate at one end, the load at its quantile
        end = a.at_case(case)
        end_memory = rank_memory(config, model_config, layout, params, steps, end, state)
        end_time = step_time(config, model_config, layout, params, steps, end_memory.host_inputs, end, state)
        plan.range[case] = {
            "tokens_per_s": layout.dp * config.seq_len / max(end_time.step_s, 1e-9),
            "step_s": end_time.step_s,
            "peak_gib": end_memory.peak / GIB,
        }
    plan.range["expected"] = {
        "tokens_per_s": plan.tokens_per_s_projected,
        "step_s": time.step_s,
        "peak_gib": plan.peak_gib_per_rank,
    }
    return plan


def _plan(
    config: TrainConfig, layout: Layout, a: Assumptions, memory: RankMemory, time: StepTime, notes: list[str]
) -> Plan:
    """The layout's `Plan`: GiB, totals per optimizer step, and for plan.json the assumptions and rules."""
    seq, accum = config.seq_len, config.optim.grad_accum
    tokens = seq // layout.cp
    return Plan(
        run=config.run,
        seq=seq,
        gpus=layout.world,
        gpu=config.plan.gpu,
        dp=layout.dp,
        cp=layout.cp,
        ep=layout.ep,
        recompute=config.memory.recompute,
        offload=config.memory.offload,
        optimizer_offload=layout.optimizer_offload,
        optimizer=layout.optimizer,
        fsdp=layout.sharded,
        fits=memory.fits(a),
        usable_gib=memory.usable,
        peak_gib_per_rank=memory.peak / GIB,
        device_gib={k: v / GIB for k, v in memory.device.items()},
        transients_gib={k: v / GIB for k, v in memory.transients.items()},
        host_gib_per_node={k: v / GIB for k, v in memory.host.items()},
        flops_per_token=time.rank_flops / tokens,
        comm_bytes_per_step={k: v * accum for k, v in time.comm.items()},
        step_s=time.step_s * accum,
        tokens_per_s_projected=layout.dp * seq / max(time.step_s, 1e-9),
        assumptions=dataclasses.asdict(a)
        | {
            "compute_s": time.compute_s,
            "comm_s": time.comm_s,
            "host_copy_s": time.host_s,
            "overlapped_s": time.overlapped_s,
            "exposed_overlap_s": time.exposed_s,
            "flat_compute_s": time.flat_compute_s,
            "busiest_rank_flops_per_token": time.busiest_flops / tokens,
            "overlap": OVERLAP_RULE,
            "sharding": SHARDING_RULE,
            "optimizer": OPTIMIZER_RULE,
            "moe": MOE_RULE,
            "offload": OFFLOAD_RULE,
        },
        notes=notes,
        roofline=roofline_summary(time, layout, seq, a, config.plan.gpu),
    )


def eval_plan(
    config: TrainConfig,
    model_config: ModelConfig,
    layout: Layout,
    a: Assumptions,
    stored: dict[str, int],
    traces: TraceCache,
) -> Plan:
    """The evaluation's plan of `layout`: the traced forward's peak per rank (`eval_rank_memory`), one
    window's forward, the context cut's and the whole before/after evaluation (`evaluation_time`)."""
    traced = traced_assumptions(a, model_config, layout.cp)
    steps = scaled_traces(config, model_config, layout.cp, traced, traces, optimizer=False)
    weights = ParameterShare.of(stored, layout)
    memory = eval_rank_memory(config, model_config, layout, weights, steps, a)
    bf16 = eval_param_dtype(config) == torch.bfloat16
    chunk_tokens, overlap = config.model_options.moe_chunk_tokens, config.parallel.ep_overlap
    window = forward_time(
        model_config, layout, weights, steps, a, bf16, config.plan.gpu, chunk_tokens, overlap
    )
    cut_tokens, cut = context_cut_tokens(config), None
    if cut_tokens:  # a forward of its own, traced (or read off the window's traces) at its tokens per rank
        cut_run = config.replace(seq=str(cut_tokens))
        cut_steps = scaled_traces(cut_run, model_config, layout.cp, traced, traces, optimizer=False)
        cut = forward_time(
            model_config, layout, weights, cut_steps, a, bf16, config.plan.gpu, chunk_tokens, overlap
        )
    evaluation = evaluation_time(config, layout, window, cut, cut_tokens)
    notes = _notes(config, model_config, layout, steps)
    notes.append(
        "not counted: loading each model (its checkpoint read and sharded), the windows' reads; "
        "communication hides under the compute only on the side streams (FSDP2's gathers; with ep_overlap, "
        "the expert exchanges started ahead)"
    )
    return _eval_plan(config, layout, a, memory, window, evaluation, notes)


def _eval_plan(
    config: TrainConfig,
    layout: Layout,
    a: Assumptions,
    memory: RankMemory,
    window: StepTime,
    evaluation: EvalTime,
    notes: list[str],
) -> Plan:
    """The evaluation's `Plan` of a layout: GiB, one window's forward, and for plan.json the assumptions and
    rules."""
    seq, tokens = config.seq_len, config.seq_len // layout.cp
    scored_s = evaluation.window_s + evaluation.cut_s
    return Plan(
        run=config.run,
        seq=seq,
        gpus=layout.world,
        gpu=config.plan.gpu,
        dp=layout.dp,
        cp=layout.cp,
        ep=layout.ep,
        recompute=False,
        offload=False,
        optimizer_offload=False,
        fsdp=layout.sharded,
        fits=memory.fits(a),
        usable_gib=memory.usable,
        peak_gib_per_rank=memory.peak / GIB,
        device_gib={k: v / GIB for k, v in memory.device.items()},
        transients_gib={k: v / GIB for k, v in memory.transients.items()},
        host_gib_per_node={},
        flops_per_token=window.rank_flops / tokens,
        comm_bytes_per_step=window.comm,
        step_s=window.step_s,
        tokens_per_s_projected=layout.dp * seq / max(scored_s, 1e-9),
        assumptions=dataclasses.asdict(a)
        | {
            "compute_s": window.compute_s,
            "comm_s": window.comm_s,
            "host_copy_s": 0.0,
            "overlapped_s": window.overlapped_s,
            "exposed_overlap_s": window.exposed_s,
            "flat_compute_s": window.flat_compute_s,
            "busiest_rank_flops_per_token": window.busiest_flops / tokens,
            "precision": eval_precision(config),
            "overlap": OVERLAP_RULE,
            "eval": EVAL_RULE,
        },
        notes=notes,
        stage="eval",
        evaluation=evaluation,
        roofline=roofline_summary(window, layout, seq, a, config.plan.gpu),
    )


def _notes(config: TrainConfig, model_config: ModelConfig, layout: Layout, steps: ScaledTraces) -> list[str]:
    """What the plan ignored, and how it was traced and scaled."""
    notes = []
    kernels_note = as_on_gpu(config.model_options)[1]
    if kernels_note is not None:
        notes.append(kernels_note)
    if config.parallel.optimizer_offload and not layout.sharded and config.plan.stage == "train":
        notes.append("optimizer_offload needs FSDP over more than one rank (fsdp=true, dp*cp > 1): ignored")
    traced = f"traced {len(steps.layers)} of {model_config.num_hidden_layers} layers"
    if steps.t1 != steps.t2:
        notes.append(
            f"{traced} at {steps.t1:,} and {steps.t2:,} tokens per rank; bytes extrapolated "
            f"linearly to {steps.tokens:,}, FLOPs as a*t + b*t^2"
            + (
                f" (past trace_tokens={config.plan.trace_tokens:,}: both traces select at the full DSA "
                f"width of {model_config.index_topk:,} tokens)"
                if steps.t2 > config.plan.trace_tokens
                else ""
            )
        )
    else:
        notes.append(f"{traced} at {steps.tokens:,} tokens per rank, scaled by the layer counts")
    return notes


def search(
    config: TrainConfig, assumptions: Assumptions | None = None, traces: TraceCache | None = None
) -> list[Plan]:
    """Every dp x cp x ep layout of `config.plan.gpus` (64 if unset), for training with offload and
    optimizer_offload on and off and each optimizer (`optimizer_choices`), ranked (`rank`); with stage=eval
    the evaluator's layouts (dp x cp x ep alone: it neither offloads nor keeps an optimizer). One pair of
    traces per cp (see `TraceCache`; the optimizer's bytes are computed, not traced), traced first, in
    parallel."""
    assumptions = assumptions or load_assumptions(config)
    model_config = resolve_model_config(config)
    evaluating = config.plan.stage == "eval"
    numel = None if evaluating else model_numel(model_config)
    stored = model_bytes(model_config, config.model_options, eval_param_dtype(config)) if evaluating else None
    traces = traces or TraceCache()
    gpus = config.plan.gpus or 64
    a = assumptions.resolved(config.plan.gpu)
    cps = [cp for cp in powers_of_two(gpus) if window_splits(config, cp)]
    sharded = config.parallel.fsdp and gpus > 1
    opt_offloads = (False, True) if sharded else (False,)  # optimizer offload is FSDP2's
    switches = (
        [{}]
        if evaluating
        else [
            {"offload": offload, "optimizer_offload": opt_offload, **optimizer}
            for offload in (True, False)
            for opt_offload in opt_offloads
            for optimizer in optimizer_choices(config)
        ]
    )
    traced_optimizer = not sharded and not evaluating
    cut = context_cut_tokens(config) if evaluating else 0
    requests = []
    for cp in cps:
        run, traced = config.replace(cp=cp, dp=1, ep=1), traced_assumptions(a, model_config, cp)
        t1, t2 = trace_token_counts(config.seq_len // cp, traced)
        requests += [(run, t1, t1 == t2 and traced_optimizer), (run, t2, traced_optimizer)]
        if cut:  # the context cut's forward (mostly the window's traces again)
            requests += [(run, t, False) for t in trace_token_counts(cut // cp, traced)]
    traces.prefetch(requests, model_config, reduced_layers(model_config))
    plans = []
    for cp in cps:
        for ep in powers_of_two(gpus):
            if model_config.n_routed_experts % ep:
                continue
            for switch in switches:
                run = config.replace(**switch)
                plan = plan_layout(run, gpus // cp, cp, ep, assumptions, traces, model_config, numel, stored)
                plans.append(plan)
    return rank(plans)


def optimizer_choices(config: TrainConfig) -> list[dict[str, str]]:
    """The optimizer settings a training search plans each layout with: every `OPTIMIZERS` choice, adamw_bf16
    where the run's precision resolves to bf16 on the GPUs planned for (its weights are read under bf16
    autocast: the run's validation asks for precision=bf16, which "auto" is on a GPU)."""
    bf16 = resolve_precision(config.memory.precision, torch.device("cuda")) == "bf16"
    choices = []
    for optimizer in OPTIMIZERS:
        if optimizer in BF16_WEIGHTS:
            if bf16:
                choices.append({"optimizer": optimizer, "precision": "bf16"})
        else:
            choices.append({"optimizer": optimizer})
    return choices


def rank(plans: list[Plan]) -> list[Plan]:
    """Fitting first; then by projected tokens/s (evaluations: by the whole evaluation's time where the
    held-out windows are counted, which the replicas' uneven shares change); at equal speed the smaller
    peak, then less host memory."""

    def speed(plan: Plan) -> float:
        total = plan.evaluation.total_s if plan.evaluation is not None else None
        return round(total, 1) if total is not None else -round(plan.tokens_per_s_projected)

    return sorted(plans, key=lambda p: (not p.fits, speed(p), p.peak_gib_per_rank, p.host_gib_total))


def powers_of_two(n: int) -> list[int]:
    """The powers of two that divide n, from 1."""
    return [2**k for k in range(int(math.log2(n)) + 1) if n % 2**k == 0]
