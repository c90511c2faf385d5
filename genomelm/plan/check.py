"""`genomelm plan`: whether a run fits and how fast it goes, measured from one traced step of the real code.

`make_plan(config)` traces one rank's training step (`genomelm.plan.trace.trace_step`: the trainer's
`window_loss`, `LayerRunner`, context parallelism and AdamW on fake tensors) over one decoder layer of each
kind at the real widths, then scales by the layer counts (`plan_memory`):
- activations: the traced forward/backward peak + what each untraced layer leaves live until its backward
  (measured per kind: its saved input, and anything else the layer keeps);
- when the rank's tokens exceed `trace_tokens` (raised for DSA models until the lower trace's window holds
  index_topk tokens: `plan_search.traced_assumptions`), the step is traced at trace_tokens/2 and trace_tokens
  and the bytes are extrapolated linearly in tokens (what a layer keeps is linear in the rank's tokens), the
  transients of the chunked modules (feed-forward: moe_chunk_tokens, loss head: loss_chunk_tokens) only up to
  their chunk, but for what a layer's recompute holds of every feed-forward chunk at once without
  `recompute_chunks` (`MOE_RULE`), the FLOPs as a*t + b*t^2 (the indexer scores every earlier pool);
- parameters, gradients, AdamW state, FSDP2's gathered layers, expert parallelism, optimizer offload and
  offload=false are computed from the model's parameter count and the traced layer inputs (`SHARDING_RULE`,
  `MOE_RULE`, `OFFLOAD_RULE`, written into plan.json): one pair of traces per cp serves every layout.
Time (`timing`, `roofline`): every kernel of the traced step at the attainable rate of its class (max of
FLOPs / the class's FLOP/s and bytes / HBM's, plus a launch; the rates and their sources in `rates.RATES`),
the collectives on the links of their group (`rates.Links`) with their ring factor, the offload copies over
PCIe and the optimizer offload's host work; what FSDP2's collectives, their copies and the layer-input
copies leave exposed by a per-layer event model of the streams (`overlap`, `roofline.OVERLAP_RULE`), the
rest adding up; low / expected / high from the rates' ranges. Printed: step time, tokens/s, MFU and HFU
(`timing.MFU_FORMULA`), the ten costliest op classes (mean and busiest expert-parallel rank) with their rates,
and the flat estimate (FLOPs at `mfu` of the bf16 peak) beside for comparison.
Every layout of the GPUs, ranked: `plan_search`; the tables and plan.json: `plan_report`; the types and the
assumptions: `plan_types`.

With stage=eval the plan is the evaluator's instead: its forward of one window traced the same way
(`genomelm.plan.trace.trace_forward`: no_grad, the parameters as the evaluator stores them, the
context-parallel scorer), its peak per GPU (`plan_memory.EVAL_RULE`), one window's forward and the context
cut's, and the whole before/after evaluation of the held-out set (`plan_time.evaluation_time`).

This module: the plan of the run's own layout, and the trainer's (or, with stage=eval, the evaluator's) check
before it starts (`check_fits`, `describe_run`).
"""

from __future__ import annotations

from genomelm.model import GlmForCausalLM
from genomelm.plan.layouts import Assumptions, Plan, load_assumptions
from genomelm.plan.memory import TraceCache, resolve_model_config
from genomelm.plan.report import describe, refusal
from genomelm.plan.search import plan_layout, search
from genomelm.run.config import TrainConfig
from genomelm.train.memory import LayerRunner


class PlanError(RuntimeError):
    """The run does not fit the GPUs it is planned for."""

    exit_code = 2  # the user's input (`genomelm.run.failures`)


def make_plan(
    config: TrainConfig, assumptions: Assumptions | None = None, traces: TraceCache | None = None
) -> Plan:
    """The plan for the run's own layout (gpus = dp*cp; `gpus` alone: cp = gpus)."""
    assumptions = assumptions or load_assumptions(config)
    dp, cp, ep = config.parallel.dp, config.parallel.cp, config.parallel.ep
    if config.plan.gpus and dp * cp != config.plan.gpus:
        if dp == 1 and cp == 1:
            cp = config.plan.gpus
        else:
            raise ValueError(f"dp={dp} x cp={cp} is not gpus={config.plan.gpus}")
    return plan_layout(config, dp, cp, ep, assumptions, traces)


def plan_with_refusal(config: TrainConfig, traces: TraceCache | None = None) -> tuple[Plan, str | None]:
    """The run's plan and, when it does not fit and `force` is not set, the line training refuses it with
    (naming the best layout of the same GPUs that fits; the search reuses the plan's traces, and `traces`'
    where given)."""
    traces = traces or TraceCache()
    plan = make_plan(config, traces=traces)
    if plan.fits or config.plan.force:
        return plan, None
    return plan, refusal(config, plan, search(config.replace(gpus=plan.gpus), traces=traces))


def check_fits(config: TrainConfig, traces: TraceCache | None = None) -> Plan:
    """The trainer's check before training (the evaluator's before it scores: `config.replace(stage="eval")`):
    the run's plan, or PlanError naming the best layout that fits (unless `force=true`); `traces`: a cache
    to read and fill (`TraceCache`)."""
    plan, refused = plan_with_refusal(config, traces)
    if refused:
        raise PlanError(refused)
    return plan


def describe_run(config: TrainConfig) -> str:
    """`dry_run=true`: the plan of the run's own layout, with the model's layer routes; when it does not fit,
    the line `make train` refuses it with (naming the best layout that fits)."""
    model_config = resolve_model_config(config)
    model = GlmForCausalLM.from_config(model_config, device="meta")
    n = sum(p.numel() for p in model.parameters())
    memory = config.memory
    runner = LayerRunner.for_memory(memory)
    head = (
        f"run {config.run}: model {config.model or 'not set, sized as glm-5.3-flash'} ({n / 1e9:.2f}B "
        f"parameters, {len(model_config.kda_layers)} KDA + {len(model_config.dsa_layers)} DSA layers)\n\n"
        f"layer routes:\n{model.route_table()}\n\nmemory switches: {runner.describe()}\n"
    )
    plan, refused = plan_with_refusal(config)
    return head + "\n" + describe(plan) + (f"\n\n{refused}" if refused else "")
