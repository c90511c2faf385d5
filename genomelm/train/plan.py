"""`genomelm plan`: whether a run fits and how fast it goes, measured from one traced step of the real code.

`make_plan(config)` traces one rank's training step (`genomelm.train.plan_trace.trace_step`: the trainer's
`window_loss`, `LayerRunner`, context parallelism and AdamW on fake tensors) over one decoder layer of each kind
at the real widths, then scales by the layer counts:
- device peak = the traced forward/backward peak + what each untraced layer leaves live until its backward
  (measured per kind: its saved input, and anything else the layer keeps) + parameters and gradients of the
  whole model; or the optimizer-step peak scaled by the parameter count, whichever is larger;
- when the rank's tokens exceed `trace_tokens`, the step is traced at trace_tokens/2 and trace_tokens and the
  bytes are extrapolated linearly in tokens (what a layer keeps is linear in the rank's tokens), the transients of
  the chunked modules (feed-forward: moe_chunk_tokens, loss head: loss_chunk_tokens) only up to their chunk, the
  FLOPs as a*t + b*t^2 (the indexer scores every earlier pool);
- layouts with dp > 1 or ep > 1 are planned by the sharding they would have (FSDP2 over dp*cp: parameters,
  gradients and optimizer state / (dp*cp), plus an unsharded bf16 copy of the largest layer twice and its fp32
  gradient for the reduce-scatter; experts over ep, the busiest rank receiving `imbalance` x the mean tokens)
  and marked "not built yet".
Time: FLOPs / (achieved fraction of the GPU's bf16 peak) plus the collectives at the link bandwidth (no overlap
assumed), all printed and settable.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genomelm.model import GlmForCausalLM, ModelConfig
from genomelm.train.checkpoints import is_preset
from genomelm.train.config import TrainConfig
from genomelm.train.memory import LayerRunner
from genomelm.train.plan_trace import StepTrace, layer_kind, reduced_layers, trace_step

GIB = 2**30
GPUS = {  # usable device memory (GiB), dense bf16 peak (TFLOP/s), NVLink per GPU per direction (GB/s)
    "b200": (178.0, 2250.0, 900.0),
    "h200": (139.0, 989.0, 450.0),
}
PUBLISHED = {  # the reference recipe on 64 B200 (Megatron TP8 x CP2 x DP4, EP32 x ETP2, full recompute, offload)
    "1M": {"peak_gib_per_gpu": 144.5, "tokens_per_s": 13700},
    "256k": {"tokens_per_s": 24900},
}
ASSUMPTION_KEYS = ("mfu", "nvlink_gbs", "ib_gbs", "gpus_per_node", "imbalance", "trace_tokens", "optimizer_offload",
                   "tflops")


class PlanError(RuntimeError):
    """The run does not fit the GPUs it is planned for."""


@dataclass
class Assumptions:
    """What the projection assumes; each settable as key=value on `genomelm plan`."""

    mfu: float = 0.35  # achieved fraction of the GPU's dense bf16 peak
    tflops: float = 0.0  # the GPU's dense bf16 peak, TFLOP/s (0: from `gpu`)
    nvlink_gbs: float = 0.0  # per GPU per direction inside a node, GB/s (0: from `gpu`)
    ib_gbs: float = 50.0  # per GPU per direction between nodes (400 Gb/s NICs), GB/s
    gpus_per_node: int = 8
    imbalance: float = 4.0  # busiest expert-parallel rank's tokens over the mean (from the run's metrics if any)
    imbalance_source: str = "assumed (4x the mean)"
    trace_tokens: int = 2048  # most tokens per rank traced; more are extrapolated
    optimizer_offload: bool = False  # AdamW state in host memory (planned layouts)

    def resolved(self, gpu: str) -> Assumptions:
        if gpu not in GPUS:
            raise ValueError(f"gpu must be one of {sorted(GPUS)}, not {gpu!r}")
        _, tflops, nvlink = GPUS[gpu]
        return dataclasses.replace(self, tflops=self.tflops or tflops, nvlink_gbs=self.nvlink_gbs or nvlink)


@dataclass
class Plan:
    """One layout's verdict (bytes per rank, per node; FLOPs; projected speed)."""

    run: str
    seq: int
    gpus: int
    gpu: str
    dp: int
    cp: int
    ep: int
    recompute: bool
    offload: bool
    built: bool
    fits: bool
    usable_gib: float
    peak_gib_per_rank: float
    device_gib: dict[str, float]
    transients_gib: dict[str, float]
    host_gib_per_node: dict[str, float]
    flops_per_token: float
    comm_bytes_per_step: dict[str, float]
    step_s: float
    tokens_per_s_projected: float
    assumptions: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def host_gib_total(self) -> float:
        return sum(self.host_gib_per_node.values())

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["host_gib_per_node"] = {**self.host_gib_per_node, "total": self.host_gib_total}
        return out


def resolve_model_config(config: TrainConfig) -> ModelConfig:
    """The run's architecture; without a model set, the GLM-5.3-Flash architecture the hg38 configs train."""
    if not config.model:
        return ModelConfig.preset("glm-5.3-flash")
    if is_preset(config.model):
        return ModelConfig.preset(config.model)
    if not Path(config.model).exists():
        raise FileNotFoundError(f"model {config.model!r} is neither a preset in configs/model/ nor a folder")
    return ModelConfig.from_file(config.model)


def model_numel(model_config: ModelConfig) -> dict[str, int]:
    """Parameters per decoder layer ("layers.<i>") and of the rest, counted on the meta device; "experts": the
    routed experts' share of the total."""
    model = GlmForCausalLM.from_config(model_config, device="meta")
    out = {f"layers.{i}": sum(p.numel() for p in layer.parameters()) for i, layer in enumerate(model.layers)}
    out["rest"] = sum(p.numel() for p in model.parameters()) - sum(out.values())
    out["experts"] = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return out


def measured_imbalance(config: TrainConfig) -> float | None:
    """The largest router/*/max_over_mean in runs/<run>/metrics.jsonl, or None without a run."""
    path = config.run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    ratios = []
    for line in path.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        ratios += [v for k, v in record.items() if k.startswith("router/") and k.endswith("/max_over_mean")]
    return max(ratios) if ratios else None


def _extrapolate(a: float, b: float, t1: int, t2: int, t: int) -> float:
    """The line through (t1, a) and (t2, b) at t."""
    return b if t == t2 or t1 == t2 else b + (b - a) * (t - t2) / (t2 - t1)


def _quadratic(a: float, b: float, t1: int, t2: int, t: int) -> float:
    """c1*t + c2*t^2 through (t1, a) and (t2, b), at t."""
    if t == t2:
        return b
    c2 = (b / t2 - a / t1) / (t2 - t1)
    c1 = a / t1 - c2 * t1
    return c1 * t + c2 * t * t


class _Traces:
    """Traces at one or two token counts for a (cp, switches) setting; cached across layouts."""

    def __init__(self) -> None:
        self.cache: dict[tuple, StepTrace] = {}

    def get(self, run: TrainConfig, model_config: ModelConfig, tokens: int, layers: list[int]) -> StepTrace:
        key = (run.cp, run.recompute, run.offload, run.recompute_chunks, run.keep_selection, tokens, tuple(layers))
        if key not in self.cache:
            self.cache[key] = trace_step(run, model_config, tokens, layers, fake=True)
        return self.cache[key]


def plan_layout(config: TrainConfig, dp: int, cp: int, ep: int, assumptions: Assumptions,
                traces: _Traces | None = None, model_config: ModelConfig | None = None,
                numel: dict[str, int] | None = None) -> Plan:
    """The plan of one layout (dp x cp ranks, experts over ep) for `config`'s window and switches."""
    model_config = model_config or resolve_model_config(config)
    numel = numel or model_numel(model_config)
    traces = traces or _Traces()
    a = assumptions.resolved(config.gpu)
    seq, gpus = config.seq_len, dp * cp
    if seq % cp or (seq // cp) % 128:
        raise ValueError(f"seq {seq:,} does not split into cp={cp} shards of whole 128-token pieces")
    if (dp * cp) % ep:
        raise ValueError(f"ep={ep} must divide dp*cp={dp * cp}")
    tokens = seq // cp
    run = dataclasses.replace(config, cp=cp, dp=1, ep=1)
    layers = reduced_layers(model_config)
    t2 = min(tokens, a.trace_tokens)
    t1 = t2 // 2 if tokens > t2 else t2
    hi = traces.get(run, model_config, t2, layers)
    lo = traces.get(run, model_config, t1, layers) if t1 != t2 else hi

    def scale(x1: float, x2: float) -> float:
        return _extrapolate(x1, x2, t1, t2, tokens)

    representative = {layer_kind(model_config, i): i for i in layers}
    all_layers = range(model_config.num_hidden_layers)
    rep_of = {i: representative[layer_kind(model_config, i)] for i in all_layers}
    built = dp == 1 and ep == 1
    shard = 1 if built else dp * cp
    total_numel = sum(v for k, v in numel.items() if k != "experts")
    traced_numel = sum(hi.param_numel.values())
    param_ratio = total_numel / traced_numel

    def cat(trace: StepTrace, *names: str) -> int:
        return sum(trace.step_peak.get(n, 0) for n in names)

    untraced = [i for i in all_layers if i not in layers]
    kept_more = sum(scale(lo.kept[rep_of[i]], hi.kept[rep_of[i]]) for i in untraced)
    chunk = {"mlp": config.moe_chunk_tokens, "lm_head": config.loss_chunk_tokens}  # modules that run in chunks
    transients = {k: max(0.0, _extrapolate(lo.transients.get(k, 0), v, t1, t2, min(tokens, chunk.get(
        k.split(".")[-1], tokens)))) for k, v in hi.transients.items()}
    largest = max(transients.values(), default=0.0)
    if ep > 1:  # the busiest rank: its experts' share of the weights (1/ep), `imbalance` x the mean tokens
        for k, v in transients.items():
            if k.endswith(".mlp") and model_config.mlp_layer_types[int(k.split(".")[1])] == "sparse":
                t = min(tokens, config.moe_chunk_tokens)
                slope = max(0.0, (hi.transients[k] - lo.transients.get(k, 0)) / (t2 - t1)) if t2 != t1 else v / t
                fixed = max(0.0, v - slope * t)  # constant in tokens: the bf16 copies of the expert weights
                transients[k] = fixed / ep + a.imbalance * slope * t
        largest = max(transients.values(), default=0.0)
    device = {
        "parameters": cat(hi, "Parameter", "Buffer") * param_ratio / shard,
        "gradients": cat(hi, "Gradient") * param_ratio / shard,
        "saved activations (all layers)": scale(
            cat(lo, "Activation", "Temp", "Other") - max(lo.transients.values(), default=0),
            cat(hi, "Activation", "Temp", "Other") - max(hi.transients.values(), default=0)) + kept_more,
        "largest transient (module below)": largest,
    }
    opt_state = hi.optimizer_peak.get("Optstate", 0) * param_ratio / shard
    opt_peak = hi.optimizer_peak_total * param_ratio / shard
    host = {"offloaded layer inputs": scale(lo.host_bytes, hi.host_bytes) * model_config.num_hidden_layers
            / len(layers) * min(a.gpus_per_node, gpus)}
    if a.optimizer_offload and not built:
        host["optimizer state (offloaded)"] = opt_state * min(a.gpus_per_node, gpus)
        opt_peak -= opt_state
    notes = []
    if not built:
        experts_per_layer = numel["experts"] / max(1, model_config.mlp_layer_types.count("sparse"))
        unsharded = max(numel[f"layers.{i}"] - (experts_per_layer - experts_per_layer / ep)
                        * (model_config.mlp_layer_types[i] == "sparse") for i in all_layers)
        device["communication buffers (FSDP: bf16 layer x2, fp32 grad)"] = unsharded * (2 * 2 + 4)
        notes.append("not built yet: dp > 1 / ep > 1 need FSDP2 and expert parallelism; planned by the sharding "
                     "they would have")
    step_bytes = sum(device.values())
    peak = max(step_bytes, opt_peak)
    device["optimizer step peak (separate phase)"] = opt_peak
    usable = GPUS[config.gpu][0]

    flops = {k: _quadratic(lo.flops[k], hi.flops[k], t1, t2, tokens) for k in hi.flops}
    rank_flops = flops["rest"] + sum(flops[f"layers.{rep_of[i]}"] for i in all_layers)
    comm = _comm(lo, hi, scale, rep_of, all_layers, numel, total_numel, cp, dp, ep, tokens, model_config, a, built)
    compute_s = rank_flops / (a.tflops * 1e12 * a.mfu)
    link = a.nvlink_gbs if gpus <= a.gpus_per_node else a.ib_gbs
    comm_s = sum(comm.values()) / (link * 1e9)
    step_s = compute_s + comm_s
    if t1 != t2:
        notes.append(f"traced {len(layers)} of {model_config.num_hidden_layers} layers at {t1:,} and {t2:,} tokens "
                     f"per rank; bytes extrapolated linearly to {tokens:,}, FLOPs as a*t + b*t^2")
    else:
        notes.append(f"traced {len(layers)} of {model_config.num_hidden_layers} layers at {tokens:,} tokens per "
                     "rank, scaled by the layer counts")
    return Plan(
        run=config.run, seq=seq, gpus=gpus, gpu=config.gpu, dp=dp, cp=cp, ep=ep, recompute=config.recompute,
        offload=config.offload, built=built, fits=peak <= usable * GIB, usable_gib=usable, peak_gib_per_rank=peak / GIB,
        device_gib={k: v / GIB for k, v in device.items()},
        transients_gib={k: v / GIB for k, v in transients.items()},
        host_gib_per_node={k: v / GIB for k, v in host.items()},
        flops_per_token=rank_flops / tokens, comm_bytes_per_step={k: v * config.grad_accum for k, v in comm.items()},
        step_s=step_s * config.grad_accum, tokens_per_s_projected=dp * seq / step_s,
        assumptions={k: v for k, v in dataclasses.asdict(a).items()} | {"link_gbs": link, "compute_s": compute_s,
                                                                       "comm_s": comm_s},
        notes=notes,
    )


def _comm(lo: StepTrace, hi: StepTrace, scale: Any, rep_of: dict[int, int], all_layers: range,
          numel: dict[str, int], total_numel: int, cp: int, dp: int, ep: int, tokens: int,
          model_config: ModelConfig, a: Assumptions, built: bool) -> dict[str, float]:
    """Bytes one rank moves per window: the traced collectives scaled by layer, plus the planned ones."""
    out: dict[str, float] = {}

    def add(name: str, value: float) -> None:
        out[name] = out.get(name, 0.0) + value

    for i in all_layers:
        part = f"layers.{rep_of[i]}"
        for kind, size in hi.comm.get(part, {}).items():
            add(f"cp {kind}", scale(lo.comm.get(part, {}).get(kind, 0), size))
    for kind, size in hi.comm.get("rest", {}).items():
        if kind == "all_reduce" and size > 1024:  # the packed gradient sum: per parameter
            add("cp gradient all_reduce", size * total_numel / sum(hi.param_numel.values()))
        else:
            add(f"cp {kind}", size)
    if not built:
        out.pop("cp gradient all_reduce", None)
        shard, expert_shard = dp * cp, dp * cp // ep
        gathered = ((total_numel - numel["experts"]) * (shard - 1) / shard
                    + numel["experts"] / ep * (expert_shard - 1) / expert_shard)  # experts: over dp*cp/ep ranks
        add("fsdp all_gather (bf16, forward + recompute)", 2 * 2 * gathered)
        add("fsdp reduce_scatter (fp32 gradients)", 4 * gathered)
    if ep > 1:
        moe_layers = sum(t == "sparse" for t in model_config.mlp_layer_types)
        per_layer = tokens * model_config.num_experts_per_tok * model_config.hidden_size * 2 * (ep - 1) / ep
        add("ep all_to_all (dispatch + combine, forward x2 + backward)", per_layer * 2 * 3 * moe_layers * a.imbalance)
    return out


def make_plan(config: TrainConfig, assumptions: Assumptions | None = None) -> Plan:
    """The plan for the run's own layout (gpus = dp*cp; `gpus` alone: cp = gpus)."""
    assumptions = assumptions or load_assumptions(config)
    dp, cp, ep = config.dp, config.cp, config.ep
    if config.gpus and dp * cp != config.gpus:
        if dp == 1 and cp == 1:
            cp = config.gpus
        else:
            raise ValueError(f"dp={dp} x cp={cp} is not gpus={config.gpus}")
    return plan_layout(config, dp, cp, ep, assumptions)


def search(config: TrainConfig, assumptions: Assumptions | None = None) -> list[Plan]:
    """Every dp x cp x ep layout of `config.gpus` (and offload on/off), ranked: fitting first, then by projected
    tokens/s."""
    assumptions = assumptions or load_assumptions(config)
    model_config = resolve_model_config(config)
    numel = model_numel(model_config)
    traces = _Traces()
    gpus = config.gpus or 64
    plans = []
    for offload in (True, False):
        run = dataclasses.replace(config, offload=offload)
        for cp in _powers_of_two(gpus):
            if config.seq_len % cp or (config.seq_len // cp) % 128:
                continue
            dp = gpus // cp
            for ep in (e for e in _powers_of_two(gpus) if e == 1 or e >= 8):
                plans.append(plan_layout(run, dp, cp, ep, assumptions, traces, model_config, numel))
    return sorted(plans, key=lambda p: (not p.fits, -p.tokens_per_s_projected))


def _powers_of_two(n: int) -> list[int]:
    return [2**k for k in range(int(math.log2(n)) + 1) if n % 2**k == 0]


def load_assumptions(config: TrainConfig) -> Assumptions:
    """Assumptions from `config.extra` (the plan command's own key=value settings) and the run's metrics."""
    fields = {f.name: f for f in dataclasses.fields(Assumptions)}
    values: dict[str, Any] = {}
    for key, value in config.extra.items():
        default = fields[key].default
        values[key] = (str(value).lower() in ("1", "true", "yes", "on")) if isinstance(default, bool) else type(
            default)(value)
    measured = measured_imbalance(config)
    if "imbalance" in values:
        values["imbalance_source"] = "set"
    elif measured is not None:
        values["imbalance"] = measured
        values["imbalance_source"] = f"measured (runs/{config.run}/metrics.jsonl, router max_over_mean)"
    return Assumptions(**values)


def check_fits(config: TrainConfig) -> Plan:
    """The trainer's check before training: the run's plan, or PlanError naming the best layout that fits
    (unless `force=true`)."""
    plan = make_plan(config)
    if plan.fits or config.force:
        return plan
    candidates = search(dataclasses.replace(config, gpus=plan.gpus))
    best = next((p for p in candidates if p.fits), None)
    fix = (f"best layout that fits {plan.gpus} {config.gpu.upper()}: dp={best.dp} cp={best.cp} ep={best.ep} "
           f"offload={str(best.offload).lower()} ({best.peak_gib_per_rank:.1f} GiB, "
           f"{best.tokens_per_s_projected:,.0f} tokens/s{'' if best.built else ', not built yet'})"
           if best else f"no layout of {plan.gpus} GPUs fits")
    raise PlanError(f"run {config.run} does not fit: {plan.peak_gib_per_rank:.1f} GiB per rank > "
                    f"{plan.usable_gib:.0f} GiB usable on {config.gpu.upper()} (dp={plan.dp} cp={plan.cp} "
                    f"ep={plan.ep}); {fix}; force=true trains anyway")


def describe(plan: Plan) -> str:
    """The plan as a table."""
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines = [
        (f"plan {plan.run}: {plan.seq:,}-token windows on {plan.gpus} x {plan.gpu.upper()} "
         f"(dp {plan.dp} x cp {plan.cp}, ep {plan.ep}; recompute {plan.recompute}, offload {plan.offload})"
         f"{'' if plan.built else '  [not built yet]'}"),
        f"  {verdict}: peak {plan.peak_gib_per_rank:,.1f} GiB per rank of {plan.usable_gib:.0f} GiB usable",
        "  device memory per rank (GiB):",
    ]
    lines += [f"    {k:<58} {v:>10,.2f}" for k, v in plan.device_gib.items()]
    lines.append("  transients by module (GiB):")
    lines += [f"    {k:<58} {v:>10,.2f}" for k, v in plan.transients_gib.items()]
    lines.append(f"  host memory per node (GiB): {plan.host_gib_total:,.1f}")
    lines += [f"    {k:<58} {v:>10,.1f}" for k, v in plan.host_gib_per_node.items()]
    lines.append(f"  FLOPs per token (per rank, recompute included): {plan.flops_per_token:.3e}")
    lines.append("  bytes communicated per step per rank:")
    lines += [f"    {k:<58} {v / 1e9:>10,.2f} GB" for k, v in plan.comm_bytes_per_step.items()]
    a = plan.assumptions
    lines.append(f"  projected: {plan.step_s:,.1f} s per step, {plan.tokens_per_s_projected:,.0f} tokens/s "
                 f"(compute {a['compute_s']:.2f} s + communication {a['comm_s']:.2f} s per window, no overlap)")
    lines.append(f"  assumptions: mfu={a['mfu']} tflops={a['tflops']} nvlink_gbs={a['nvlink_gbs']} ib_gbs={a['ib_gbs']}"
                 f" gpus_per_node={a['gpus_per_node']} imbalance={a['imbalance']:.2f} ({a['imbalance_source']})"
                 f" trace_tokens={a['trace_tokens']} optimizer_offload={a['optimizer_offload']}")
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def describe_search(plans: list[Plan]) -> str:
    rows = [(f"{'fits':<5} {'dp':>3} {'cp':>3} {'ep':>3} {'offload':<8} {'peak GiB':>10} {'host GiB/node':>14} "
             f"{'tokens/s':>10}  status")]
    for p in plans:
        rows.append(f"{'yes' if p.fits else 'no':<5} {p.dp:>3} {p.cp:>3} {p.ep:>3} {str(p.offload).lower():<8} "
                    f"{p.peak_gib_per_rank:>10,.1f} {p.host_gib_total:>14,.1f} {p.tokens_per_s_projected:>10,.0f}  "
                    f"{'built' if p.built else 'not built yet'}")
    return "\n".join(rows)


def describe_run(config: TrainConfig) -> str:
    """`dry_run=true`: the plan of the run's own layout, with the model's layer paths."""
    model_config = resolve_model_config(config)
    model = GlmForCausalLM.from_config(model_config, device="meta")
    n = sum(p.numel() for p in model.parameters())
    runner = LayerRunner(recompute=config.recompute, offload=config.offload, keep_selection=config.keep_selection,
                         recompute_chunks=config.recompute_chunks)
    head = (f"run {config.run}: model {config.model or 'not set, sized as glm-5.3-flash'} ({n / 1e9:.2f}B parameters, "
            f"{len(model_config.kda_layers)} KDA + {len(model_config.dsa_layers)} DSA layers)\n\nlayer paths:\n"
            f"{model.path_table()}\n\nmemory switches: {runner.describe()}\n")
    return head + "\n" + describe(make_plan(config))


def write_plan(config: TrainConfig, plans: list[Plan]) -> Path:
    path = config.run_dir / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = plans[0].to_json() | ({"search": [p.to_json() for p in plans]} if len(plans) > 1 else {})
    path.write_text(json.dumps(body, indent=2))
    return path


