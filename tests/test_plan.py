"""`genomelm plan`: a step traced on fake tensors holds what the same step holds on real tensors, and the
plan scaled from one layer of each kind predicts the measured peak of the whole model at 1, 2 and 4 ranks,
and of an MoE-heavy model on one rank and on 2 expert-parallel ranks, its MoE in several chunks. With
stage=eval, the evaluator's forward: traced the same way (fake = real on one rank), below the training
step, its parameters the stored build's shard, its time's arithmetic, the refusal of an evaluation that does
not fit. The shipped hg38 run configs: the layout the search ranks first."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
from benchmark_modules import benchmark
from data_fixtures import fly_windows

from genomelm.model import GlmForCausalLM, ModelConfig, RunOptions
from genomelm.parallel.fsdp import fp32_declared
from genomelm.plan import check as planner
from genomelm.plan.check import PlanError, check_fits, make_plan
from genomelm.plan.layouts import GIB, Assumptions, load_assumptions
from genomelm.plan.memory import (
    TraceCache,
    extrapolate_line,
    extrapolate_quadratic,
    model_numel,
    resolve_model_config,
)
from genomelm.plan.recording import grouped_mm_flops
from genomelm.plan.report import layout_args, refusal
from genomelm.plan.search import plan_layout, rank
from genomelm.plan.trace import (
    StepTrace,
    layer_kind,
    reduced_layers,
    sub_config,
    trace_forward,
    trace_step,
)
from genomelm.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
# the traces of this file's plans, shared: plans of the same model and traced settings (the cache's key is
# all a trace reads) differ only in what the planner computes from one trace, so each is traced once
TRACES = TraceCache()
SMALL_CHUNKS = [
    # the torch paths: the real CPU steps these plans are held to run them (a plan of auto traces the kernels)
    "indexer_backend=torch",
    "dsa_backend=sparse",
    "mhc_backend=torch",
    "kda_backend=torch",
    "offload=false",
    "moe_chunk_tokens=64",
    "loss_chunk_tokens=64",
    "indexer_query_block=32",
    "attention_query_block=32",
]


def test_reduced_layers_cover_every_kind():
    config = ModelConfig.preset("glm-5.3-flash")
    layers = reduced_layers(config)
    kinds = {
        (config.layer_types[i], config.mlp_layer_types[i], config.indexer_types[i])
        for i in range(config.num_hidden_layers)
    }
    assert len(layers) == len(kinds) and layers == sorted(layers)
    sub = sub_config(config, layers)
    assert sub.num_hidden_layers == len(layers) and sub.hidden_size == config.hidden_size


def test_extrapolation_is_exact_on_lines_and_quadratics():
    def line(t: int) -> float:
        return 3 * t + 7

    def quad(t: int) -> float:
        return 5 * t + 0.25 * t * t

    assert extrapolate_line(line(1024), line(2048), 1024, 2048, 65536) == pytest.approx(line(65536))
    assert extrapolate_quadratic(quad(1024), quad(2048), 1024, 2048, 65536) == pytest.approx(quad(65536))


def test_grouped_mm_flops_match_the_sliced_matmuls():
    tokens, dim, out, groups = 96, 16, 24, 4
    x, w = torch.randn(tokens, dim), torch.randn(groups, out, dim)
    forward = grouped_mm_flops(x.shape, w.transpose(-2, -1).shape, out_shape=(tokens, out))
    assert forward == 2 * tokens * dim * out
    # weight gradient: [dim, T] x [T, out] -> [groups, dim, out]; each token's column once
    weight_grad = grouped_mm_flops((dim, tokens), (tokens, out), out_shape=(groups, dim, out))
    assert weight_grad == 2 * dim * out * tokens


def test_assumptions_from_settings_and_from_the_runs_metrics(tmp_path):
    config = TrainConfig().replace(run="r", runs_dir=str(tmp_path), mfu=0.5, imbalance=2.0)
    assumptions = load_assumptions(config)
    assert assumptions.mfu == 0.5 and assumptions.imbalance == 2.0 and assumptions.imbalance_source == "set"
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "router/3/max_over_mean": 2.5, "router/4/max_over_mean": 3.25}) + "\n"
    )
    measured = load_assumptions(config.replace(imbalance=0.0))
    assert measured.imbalance == 3.25 and "router max_over_mean" in measured.imbalance_source
    with (tmp_path / "r" / "metrics.jsonl").open("a") as log:  # a run with ep > 1 logs its ranks' rows too
        log.write(json.dumps({"step": 2, "ep/busiest_over_mean": 1.5, "router/3/max_over_mean": 3.5}) + "\n")
    ranks = load_assumptions(config.replace(imbalance=0.0))
    assert ranks.imbalance == 1.5 and "ep/busiest_over_mean" in ranks.imbalance_source
    # a run's expert_load.json (two layers of 8 experts): the static blocks' busiest/mean at each ep, for a
    # model of as many experts; placement by load shown beside
    (tmp_path / "r" / "expert_load.json").write_text(
        json.dumps({"through_step": 2, "steps": 2, "counts": {"1": [8, 0, 0, 0, 4, 4, 0, 0], "3": [1] * 8}})
    )
    logged = load_assumptions(config.replace(imbalance=0.0))
    assert logged.logged_static == {2: 1.0, 4: pytest.approx(10 / 6), 8: pytest.approx(9 / 3)}
    assert logged.at_ep(4, 8).imbalance == pytest.approx(10 / 6)
    assert (
        "expert_load.json, the static blocks at ep=4; placed by load 1.67"
        in logged.at_ep(4, 8).imbalance_source
    )
    assert logged.at_ep(4, 288) == logged and logged.at_ep(16, 8) == logged  # another model; an ep not logged
    assert logged.imbalance == 1.5  # what layouts the load does not describe take
    # a run that places its experts by load: the imbalance after placement, the static blocks' beside (one
    # layer: static blocks [4+3 | 2+1 | 0 | 0] at ep=4, 2.8x the mean of 2.5; placed [4 | 3 | 2 | 1], 1.6x)
    (tmp_path / "r" / "expert_load.json").write_text(
        json.dumps({"through_step": 2, "steps": 2, "counts": {"1": [4, 3, 2, 1, 0, 0, 0, 0]}})
    )
    placed = load_assumptions(config.replace(imbalance=0.0, expert_placement="balanced"))
    assert placed.placed and placed.at_ep(4, 8).imbalance == pytest.approx(1.6)
    assert "placed by load at ep=4: 1.60, the static blocks 2.80" in placed.at_ep(4, 8).imbalance_source
    assert load_assumptions(config.replace(imbalance=0.0)).at_ep(4, 8).imbalance == pytest.approx(2.8)


def test_the_trace_cache_keys_all_a_trace_reads_and_no_layout():
    """`TRACES` is shared by plans of different runs: runs that differ in a traced setting or in the model
    have keys of their own; runs that differ in the layout, the assumptions or the run's schedule share."""
    tiny = ModelConfig.preset("tiny")

    def key(settings: list[str], model: ModelConfig = tiny) -> tuple:
        args = ["model=tiny", "seq=512", *(arg for setting in settings for arg in setting.split())]
        run = TraceCache.traced_run(TrainConfig.from_args(args))
        return TraceCache()._key(run, model, 512, reduced_layers(tiny))

    base = key([])
    shared = ["dp=4 ep=4", "dp=2", "fsdp=false", "imbalance=2", "expert_placement=balanced expert_copies=1"]
    shared += [
        "gpu_gib=10",
        "optimizer=adamw8bit",
        "dp=2 optimizer_offload=true",
        "steps=7",
        "warmup_steps=3",
    ]
    for setting in shared:
        assert key([setting]) == base, setting
    traced = ["cp=2", "seq=1024", "recompute=false", "dsa_backend=sparse", "moe_chunk_tokens=64"]
    traced += ["grad_accum=2", "cp_layout=contiguous", "stage=eval"]
    for setting in traced:
        assert key([setting]) != base, setting
    assert key([], dataclasses.replace(tiny, n_routed_experts=16)) != base


def test_a_memory_budget_is_capped_at_the_gpus_memory():
    from genomelm.plan.memory import usable_gib

    budget = TrainConfig.from_args(["model=tiny", "gpu_gib=144.5"])  # the published recipe's, on a B200
    assert usable_gib(budget) == 144.5
    assert usable_gib(budget.replace(gpu="h200")) == 139.0  # an H200 has less
    assert usable_gib(TrainConfig.from_args(["model=tiny", "gpu=h200"])) == 139.0


def test_an_unmeasured_run_assumes_a_zipf_load_fitted_to_the_published_4x_at_ep32():
    assumed = Assumptions()
    at32 = assumed.at_ep(32, 288)
    assert at32.imbalance == pytest.approx(4.0, abs=1e-6)  # the expectation over orders, as fitted
    assert at32.imbalance_low < 4.0 < at32.imbalance_high
    at8 = assumed.at_ep(8, 288)
    assert 1.5 < at8.imbalance < 2.0 and "placed by load 1.06" in at8.imbalance_source
    assert 2.0 < assumed.at_ep(16, 288).imbalance < 4.0
    assert assumed.at_ep(2, 8) == assumed  # 32 does not divide 8 experts: the flat 4x
    assert dataclasses.replace(assumed, load_model=False).at_ep(8, 288).imbalance == 4.0  # set or measured
    placed = dataclasses.replace(assumed, placed=True).at_ep(8, 288)  # expert_placement=balanced
    assert (
        placed.imbalance == pytest.approx(1.06, abs=0.01)
        and "the static blocks 1.71" in placed.imbalance_source
    )


def test_the_load_models_imbalance_is_the_expectation_over_orders_not_one_order():
    from genomelm.parallel.placement import static_placement, zipf_load
    from genomelm.plan.layouts import LOAD_ORDERS, fitted_exponent, static_ratios

    exponent = fitted_exponent(288)
    ratios = static_ratios(288, 2, exponent)
    # each order's ratio as the placement code computes it, from its own seed
    for seed in (0, 7, LOAD_ORDERS - 1):
        load = zipf_load(288, exponent, seed)
        assert ratios[seed] == pytest.approx(static_placement(288, 2).busiest_over_mean(load))
    at2 = Assumptions().at_ep(2, 288)
    assert at2.imbalance == pytest.approx(ratios.mean())
    assert at2.imbalance > 1.05 and at2.imbalance_high > at2.imbalance > at2.imbalance_low >= 1.0
    assert (
        at2.at_case("low").imbalance == at2.imbalance_high
        and at2.at_case("high").imbalance == at2.imbalance_low
    )
    assert at2.sized_imbalance == at2.imbalance_high  # memory is sized for a busy layer


@pytest.mark.slow
def test_fake_step_equals_real_step_on_one_rank():
    run = TrainConfig.from_args(["model=tiny", *SMALL_CHUNKS])
    model = ModelConfig.preset("tiny")
    fake = trace_step(run, model, 512, fake=True)
    real = trace_step(run, model, 512, fake=False)
    assert fake.param_numel == real.param_numel and fake.kept == real.kept
    assert abs(fake.step_peak_total - real.step_peak_total) <= 0.02 * real.step_peak_total
    assert abs(fake.optimizer_peak_total - real.optimizer_peak_total) <= 0.02 * real.optimizer_peak_total
    assert fake.flops == real.flops and sum(fake.flops.values()) > 0


def _real_step(config: TrainConfig, tokens: int):
    torch.set_num_threads(1)
    return trace_step(config, resolve_model_config(config), tokens, fake=False)


def _measured_peak(config: TrainConfig, tokens: int) -> tuple[int, list[StepTrace]]:
    """The whole model's real step on every rank of `config`'s dp x cp mesh, and its peak over the ranks in
    the steady state: from the second step on, AdamW's state (2 x fp32 per parameter the rank holds; its
    step's temporaries are the optimizer phase's) is live through the forward and backward too (what a real
    second step's tracker reads, to 0.01% on `tiny`)."""
    from genomelm.parallel.launch import launch

    world = config.parallel.dp * config.parallel.cp
    measured = (
        launch(_real_step, world, config, tokens, timeout_s=600)
        if world > 1
        else [_real_step(config, tokens)]
    )
    peak = max(
        max(m.step_peak_total + 8 * sum(m.param_numel.values()), m.optimizer_peak_total) for m in measured
    )
    return peak, measured


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "seq", "cp"), [("tiny", 512, 1), ("tiny", 1024, 2), ("tiny", 2048, 4), ("small", 2048, 1)]
)
def test_planned_peak_equals_measured_peak(preset, seq, cp):
    """The plan (one layer of each kind traced on fake tensors, scaled to all layers) against the whole
    model's real step, measured with the same tracker on every rank."""
    config = TrainConfig.from_args([f"model={preset}", f"seq={seq}", f"cp={cp}", "fsdp=false", *SMALL_CHUNKS])
    plan = make_plan(config, traces=TRACES)
    assert plan.fits and not plan.fsdp and plan.cp == cp
    peak, measured = _measured_peak(config, seq // cp)
    assert abs(allocated_gib(plan) * GIB - peak) <= 0.10 * peak, (allocated_gib(plan) * GIB, peak)
    if cp > 1:
        traced = sum(sum(c.values()) for c in measured[-1].comm.values())
        assert traced > 0 and plan.comm_bytes_per_step["cp all_gather"] > 0
        assert plan.comm_bytes_per_step["gradient all_reduce (fp32)"] > 0


def allocated_gib(plan) -> float:
    """The plan's peak as the allocator counts it (what MemTracker measures): without the fragmentation and
    the CUDA / NCCL context outside it."""
    from genomelm.plan.memory import CONTEXT, FRAGMENTATION

    return plan.peak_gib_per_rank - plan.device_gib[CONTEXT] - plan.device_gib[FRAGMENTATION]


def _moe_heavy_model(folder: Path) -> str:
    """`tiny` cut to a dense and an MoE layer, both DSA, with 64 routed experts of width 64, top-4: the MoE's
    recompute holds most of the step's bytes (the bf16 copies of the experts' weights, 768 KiB per chunk, and
    the rows)."""
    changes = {
        "num_hidden_layers": 2,
        "layer_types": ["indexed_attention"] * 2,
        "mlp_layer_types": ["dense", "sparse"],
        "indexer_types": ["full", "full"],
        "n_routed_experts": 64,
        "moe_intermediate_size": 64,
        "num_experts_per_tok": 4,
    }
    (folder / "config.json").write_text(json.dumps(ModelConfig.preset("tiny").text_config_dict() | changes))
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "ep"), [(1, 1), (2, 2)])
def test_planned_peak_counts_every_moe_chunk_a_layer_recompute_holds(tmp_path, dp, ep):
    """recompute without recompute_chunks: a layer's recompute saves all 16 MoE chunks' tensors at once, held
    until the MoE's backward. Traced at 32 and 64 tokens (one chunk), planned at 1024 tokens per rank, on one
    rank and on 2 expert-parallel ranks (planned with the measured share of the busiest rank), the plan of
    each layout against its real step."""
    settings = [f"model={_moe_heavy_model(tmp_path)}", "seq=1024", f"dp={dp}", f"ep={ep}", "fsdp=false"]
    config = TrainConfig.from_args([*settings, *SMALL_CHUNKS]).replace(trace_tokens=64)
    assert config.memory.recompute and not config.memory.recompute_chunks
    peak, measured = _measured_peak(config, 1024)
    imbalance = 1.0
    if ep > 1:  # the busiest rank's rows over the mean
        rows = [m.expert_rows["layers.1"] for m in measured]
        assert sum(rows) == dp * 1024 * 4  # every (token, expert) row, computed once
        imbalance = max(rows) * ep / sum(rows)
    plan = make_plan(config.replace(imbalance=imbalance), traces=TRACES)
    assert plan.ep == ep and "at 32 and 64 tokens per rank" in plan.notes[-1]
    assert abs(allocated_gib(plan) * GIB - peak) <= 0.10 * peak, (allocated_gib(plan) * GIB, peak)


@pytest.mark.slow
def test_check_fits_refuses_with_the_layouts_it_tried_unless_forced():
    config = TrainConfig.from_args(
        ["model=glm-5.3-flash", "seq=4096", "gpus=1", "moe_chunk_tokens=256", "loss_chunk_tokens=256"]
    )
    config = config.replace(trace_tokens=256)
    with pytest.raises(PlanError, match="does not fit.*no layout of 1 x B200 fits.*force=true"):
        check_fits(config, traces=TRACES)
    plan = check_fits(config.replace(force=True), traces=TRACES)
    assert not plan.fits and plan.peak_gib_per_rank > 178


@pytest.mark.slow
def test_plan_command_full_model_on_the_cpu(tmp_path, monkeypatch, capsys):
    """`genomelm plan configs/train/hg38-1m.yaml` with a layout of its own, in this process so that the
    command's traces are `TRACES` (its cp=16 pair is the shipped hg38-1m search's; `python -m genomelm.cli`
    itself runs in test_train and test_run_folder)."""
    from genomelm import cli
    from genomelm.commands import plan as command

    monkeypatch.setattr(command, "TraceCache", lambda: TRACES)
    config = str(ROOT / "configs" / "train" / "hg38-1m.yaml")
    layout = ["dp=4", "cp=16", "ep=32", "optimizer_offload=true"]
    code = cli.main(["plan", config, f"runs_dir={tmp_path}", *layout])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "traced 3 of 45 layers" in out and "optimizer_offload True" in out
    plan = json.loads((tmp_path / "hg38-1m" / "plan.json").read_text())
    for key in (
        "fits",
        "peak_gib_per_rank",
        "host_gib_per_node",
        "flops_per_token",
        "comm_bytes_per_step",
        "tokens_per_s_projected",
        "assumptions",
    ):
        assert key in plan
    assert plan["gpus"] == 64 and plan["peak_gib_per_rank"] > 0 and plan["tokens_per_s_projected"] > 0


class _StubTraces(TraceCache):
    """One synthetic trace (no tracing): 8 MiB of activations, 1 MiB kept and 1 MiB offloaded per traced
    layer, no FLOPs."""

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        layers = reduced_layers(model_config)
        numel = model_numel(model_config)
        self.layers = layers
        self.trace = StepTrace(
            tokens_per_rank=0,
            cp=1,
            layers=layers,
            param_numel={**{f"layers.{i}": numel[f"layers.{i}"] for i in layers}, "rest": numel["rest"]},
            step_peak={"Activation": 8 << 20},
            optimizer_peak={"Optstate": 1},
            kept={i: 1 << 20 for i in layers},
            transients={"lm_head": 0},
            flops={**{f"layers.{i}": 0 for i in layers}, "rest": 0},
            host_bytes=len(layers) << 20,
        )

    def prefetch(self, *args, **kwargs) -> None:
        pass

    def get(self, run, model_config, tokens, layers, optimizer=False) -> StepTrace:
        return dataclasses.replace(self.trace, tokens_per_rank=tokens, cp=run.parallel.cp)


def _stub_plan(
    dp: int = 2,
    cp: int = 2,
    ep: int = 2,
    recomputed: dict[str, int] | None = None,
    row_bytes: int = 0,
    flops: dict[str, float] | None = None,
    **settings,
):
    """The plan of dp x cp x ep (given apart from the run's settings, as the layout search does);
    `recomputed`, `row_bytes`, `flops`: the stub trace's bytes held by each feed-forward module's recompute,
    saved by the experts per row, and its FLOPs by part."""
    config = TrainConfig.from_args(["model=tiny", "seq=1024"]).replace(**settings)
    model_config = ModelConfig.preset("tiny")
    numel = model_numel(model_config)
    traces = _StubTraces(model_config)
    if recomputed:
        traces.trace.recomputed = recomputed
        traces.trace.transients |= dict.fromkeys(recomputed, 0)
    traces.trace.expert_row_bytes = row_bytes
    if flops:
        traces.trace.flops = flops
    plan = plan_layout(config, dp, cp, ep, Assumptions(), traces, model_config, numel)
    return plan, model_config, numel


def test_fsdp_and_expert_sharding_arithmetic():
    """FSDP2 over dp*cp: every parameter / (dp*cp) x (4 + 4 + 8) B; experts over ep, then FSDP over dp*cp/ep;
    without FSDP the experts alone are split (over ep)."""
    plan, model_config, numel = _stub_plan()
    total = sum(v for k, v in numel.items() if k != "experts")
    experts = numel["experts"]
    assert experts > 0 and plan.fsdp
    dev = {k: v * GIB for k, v in plan.device_gib.items()}
    assert dev["parameters (fp32)"] == pytest.approx(4 * total / 4)
    assert dev["gradients (fp32)"] == pytest.approx(4 * total / 4)
    assert dev["optimizer state (AdamW, 2 x fp32)"] == pytest.approx(8 * total / 4)
    sparse = [i for i, t in enumerate(model_config.mlp_layer_types) if t == "sparse"]
    per_layer = experts / len(sparse)
    layers = range(model_config.num_hidden_layers)
    largest = max(numel[f"layers.{i}"] - per_layer / 2 * (i in sparse) for i in layers)
    assert dev["FSDP buffers (2 bf16 layers gathered, bf16 + fp32 gradient)"] == pytest.approx(10 * largest)
    # fsdp_prefetch=2: three gathered layers (the running one and two ahead), the rest as it was
    ahead, _, _ = _stub_plan(fsdp_prefetch=2)
    ahead_dev = {k: v * GIB for k, v in ahead.device_gib.items()}
    assert ahead_dev["FSDP buffers (3 bf16 layers gathered, bf16 + fp32 gradient)"] == pytest.approx(
        12 * largest
    )
    assert (allocated_gib(ahead) - allocated_gib(plan)) * GIB == pytest.approx(2 * largest)
    # reduce_dtype=bf16: the reduce-scatter's copy in bf16 (2 B, not 4) and half its bytes over the links
    halved, _, _ = _stub_plan(reduce_dtype="bf16")
    halved_dev = {k: v * GIB for k, v in halved.device_gib.items()}
    assert halved_dev["FSDP buffers (2 bf16 layers gathered, bf16 + bf16 gradient)"] == pytest.approx(
        8 * largest
    )
    fp32_bytes = plan.comm_bytes_per_step["fsdp reduce_scatter (fp32 gradients)"]
    assert halved.comm_bytes_per_step["fsdp reduce_scatter (bf16 gradients)"] == pytest.approx(fp32_bytes / 2)
    assert "fsdp reduce_scatter (fp32 gradients)" not in halved.comm_bytes_per_step
    same = {k: v for k, v in plan.comm_bytes_per_step.items() if "reduce_scatter (fp32" not in k}
    assert same == {k: v for k, v in halved.comm_bytes_per_step.items() if "reduce_scatter (bf16" not in k}
    assert halved.roofline["overlapped_s"] < plan.roofline["overlapped_s"]
    replicated, _, _ = _stub_plan(fsdp=False)
    assert replicated.device_gib["parameters (fp32)"] * GIB == pytest.approx(4 * (total - experts / 2))
    assert replicated.device_gib["optimizer step peak (separate phase)"] > 0
    # expert parallel all-to-all: tokens x top-k x hidden x 2 B each way, forward + recompute + backward,
    # x imbalance; started ahead (ep_overlap): all but the backward's dispatch on the side
    tokens = 1024 // 2
    rows = tokens * model_config.num_experts_per_tok
    per_exchange = rows * model_config.hidden_size * 2 / 2 * len(sparse) * 4.0  # (ep - 1) / ep = 1 / 2

    def exchanges(plan):
        return {k: v for k, v in plan.comm_bytes_per_step.items() if k.startswith("ep all_to_all")}

    ahead = "ep all_to_all started ahead (dispatch + combine; forward, recompute; backward combine)"
    assert exchanges(plan) == {
        ahead: pytest.approx(5 * per_exchange),
        "ep all_to_all (backward dispatch)": pytest.approx(per_exchange),
    }
    blocking, _, _ = _stub_plan(ep_overlap=False)
    label = "ep all_to_all (dispatch + combine; forward, recompute, backward)"
    assert exchanges(blocking) == {label: pytest.approx(6 * per_exchange)}
    hidden = blocking.assumptions["comm_s"] - plan.assumptions["comm_s"]
    assert hidden > 0
    assert plan.assumptions["overlapped_s"] - blocking.assumptions["overlapped_s"] == pytest.approx(hidden)
    assert plan.assumptions["sharding"].startswith("bytes per rank") and plan.assumptions["imbalance"] == 4.0


def test_fp8_expert_gemms_cost_their_rate_their_quantisation_and_their_transient():
    """expert_precision=fp8_rowwise (the tiny model's widths are multiples of 16, not of MXFP8's 32), dp 2 x
    cp 2 x ep 2, 512 tokens per rank in one chunk, the stub's imbalance 4: the stub trace has no kernels,
    so the window's compute grows by torchao's quantisation and the alignment copies alone, counted by hand;
    the MoE transient by the fp8 copies; the grouped GEMM's rate x 1.1 / the padding; MXFP8 refused on
    H200."""
    from genomelm.plan.layouts import Layout
    from genomelm.plan.low_precision import expert_peaks, expert_quantisation
    from genomelm.plan.rates import peaks

    plan, model_config, _ = _stub_plan()
    fp8, _, _ = _stub_plan(expert_precision="fp8_rowwise")
    d, i, moe_layers, local_experts = 32, 16, 3, 4  # hidden, moe_intermediate, MoE layers, 8 experts / ep 2
    weights = local_experts * 3 * d * i * 3  # one chunk: quantised once per pass, read bf16 + written fp8
    rows = 512 * 2 * 4.0  # tokens x top-2 x imbalance
    forward = weights + rows * (3 * (d + i) + 10 * d + 14 * i)
    backward = weights + rows * (3 * (3 * d + 5 * i) + 10 * d + 16 * i)
    launches = 3 * 16 * moe_layers * 7e-6  # three passes, 16 kernels per MoE layer and chunk
    added = moe_layers * (2 * forward + backward) / 6.52e12 + launches
    assert fp8.roofline["compute_s"] - plan.roofline["compute_s"] == pytest.approx(added)
    assert fp8.comm_bytes_per_step == plan.comm_bytes_per_step
    held = local_experts * 2 * i * d + 512 * 2 * 4.0 * (1 + local_experts * 7.5 / 1024) * 2 * i * 4
    for k, v in plan.transients_gib.items():
        extra = held if k.endswith(".mlp") and k != "layers.0.mlp" else 0.0  # layer 0 is dense
        assert (fp8.transients_gib[k] - v) * GIB == pytest.approx(extra)
    b200 = peaks("b200")
    layout = Layout(2, 2, 2, True, False)
    rate = expert_peaks(b200, model_config, layout, "fp8_rowwise", 512, 4096).compute["grouped_gemm_bf16"]
    assert rate == pytest.approx(450e12 * 1.1 / (1 + local_experts * 7.5 / 1024))
    low = expert_peaks(peaks("b200", case="low"), model_config, layout, "mxfp8", 512, 4096)
    assert low.compute["grouped_gemm_bf16"] == pytest.approx(450e12 * 0.8 / (1 + local_experts * 15.5 / 1024))
    assert expert_peaks(b200, model_config, layout, "bf16", 512, 4096) is b200
    passes = expert_quantisation(model_config, layout, "fp8_rowwise", 512, 4096, b200, 4.0)
    assert sum(c.bytes for c in passes) == pytest.approx(moe_layers * (2 * forward + backward))
    assert passes[1].recompute_seconds == passes[1].seconds > 0 and passes[2].backward
    alone = expert_quantisation(model_config, layout, "fp8_rowwise", 512, 4096, b200, 4.0, recompute=False)
    assert alone[1].seconds == 0 and alone[0].seconds == passes[0].seconds
    assert expert_quantisation(model_config, layout, "bf16", 512, 4096, b200, 4.0) == []
    with pytest.raises(ValueError, match="mxfp8 has no kernel on h200"):
        expert_peaks(peaks("h200"), model_config, layout, "mxfp8", 512, 4096)


def test_the_plan_gives_a_range_and_what_the_event_model_leaves_exposed():
    plan, _, _ = _stub_plan()
    low, expected, high = (plan.range[case] for case in ("low", "expected", "high"))
    assert (
        low["tokens_per_s"] < expected["tokens_per_s"] == plan.tokens_per_s_projected < high["tokens_per_s"]
    )
    assert high["peak_gib"] < expected["peak_gib"] == plan.peak_gib_per_rank < low["peak_gib"]
    parts = plan.roofline["exposed_parts"]
    assert "FSDP2 copy-outs (compute stream)" in parts and "forward all-gathers" in parts
    assert sum(parts.values()) == pytest.approx(plan.assumptions["exposed_overlap_s"])
    assert {r["key"]: r["spread"] for r in plan.roofline["rates"]}["atomics"] == (0.5, 1.07)


def test_the_router_run_ahead_of_the_chunks_is_counted_under_expert_parallelism():
    """`planned_routes`: with ep > 1 each MoE layer routes its chunks once more before the first (one fp32
    GEMM per chunk on the rank's own tokens): 2 x T x D x E FLOPs per layer, executed but not model FLOPs,
    at the fp32 GEMM rate, and twice with ep_overlap's recompute; nothing at ep 1."""
    from genomelm.plan.layouts import Layout
    from genomelm.plan.timing import device_peaks, planned_routes

    config = ModelConfig.preset("glm-5.3-flash")
    peaks = device_peaks(Assumptions().resolved("b200"), "b200")
    assert planned_routes(config, Layout(2, 32, 1, True, False), 32768, 8192, peaks) == []
    (route,) = planned_routes(config, Layout(2, 32, 2, True, False), 32768, 8192, peaks)
    moe = sum(t == "sparse" for t in config.mlp_layer_types)
    assert route.count == 4 * moe and route.model_flops == 0
    assert route.flops == 2 * 32768 * config.hidden_size * config.n_routed_experts * moe
    assert route.rate == "gemm_fp32" and route.seconds >= route.flops / peaks.flops_rate("gemm_fp32", "fp32")
    (twice,) = planned_routes(config, Layout(2, 32, 2, True, False), 32768, 8192, peaks, routings=2)
    assert (twice.count, twice.flops) == (2 * route.count, 2 * route.flops)
    assert twice.seconds == pytest.approx(2 * route.seconds)


def test_moe_transient_adds_every_chunk_a_layer_recompute_holds():
    """recompute without recompute_chunks (`MOE_RULE`): the MoE's transient adds what its recompute holds, as
    traced but with the traced bf16 expert-weight copies (one per chunk, every expert) replaced by the
    layout's (E/ep per chunk, none with FSDP) and the busiest rank's (imbalance - 1) x tokens x top-k rows
    more; its backward then adds one chunk's gradients. recompute_chunks holds one chunk: the rule alone."""
    config = ModelConfig.preset("tiny")
    tokens, chunks, rest, row_bytes = 512, 512 // 128, 3000, 256  # dp 2 x cp 2, ep 2; chunks of 128 tokens
    copy = config.n_routed_experts * 3 * config.hidden_size * config.moe_intermediate_size * 2
    recomputed = {"layers.1.mlp": chunks * copy + rest}
    busiest = (4.0 - 1) * tokens * config.num_experts_per_tok * row_bytes  # imbalance 4
    per_row = (2 * config.hidden_size + 3 * config.moe_intermediate_size) * 2
    gradients = 4.0 * 128 * config.num_experts_per_tok * per_row
    for fsdp, copies in ((True, 0), (False, chunks * copy / 2)):
        plan, _, _ = _stub_plan(recomputed=recomputed, row_bytes=row_bytes, moe_chunk_tokens=128, fsdp=fsdp)
        held = rest + copies + busiest
        assert plan.transients_gib["layers.1.mlp"] * GIB == pytest.approx(held + gradients)
    one_chunk, _, _ = _stub_plan(
        recomputed=recomputed, row_bytes=row_bytes, moe_chunk_tokens=128, recompute_chunks=True
    )
    assert one_chunk.transients_gib["layers.1.mlp"] * GIB == pytest.approx(2 * gradients)


def test_optimizer_offload_and_layer_input_offload_move_bytes_to_the_host():
    plan, _, numel = _stub_plan(optimizer_offload=True)
    total = sum(v for k, v in numel.items() if k != "experts")
    assert plan.optimizer_offload and plan.device_gib["optimizer state (AdamW, 2 x fp32)"] == 0
    assert plan.device_gib["parameters (fp32)"] == 0 and plan.device_gib["gradients (fp32)"] == 0
    host = plan.host_gib_per_node["optimizer offload: fp32 parameters, gradients, AdamW (pinned)"] * GIB
    assert host == pytest.approx(16 * total / 4 * 4)  # 4 ranks on the node
    on, _, _ = _stub_plan(offload=True)
    off, _, _ = _stub_plan(offload=False)
    inputs = on.host_gib_per_node["offloaded layer inputs (pinned)"] / 4  # per rank
    assert "offloaded layer inputs (pinned)" not in off.host_gib_per_node
    assert off.device_gib["saved activations (all layers)"] == pytest.approx(
        on.device_gib["saved activations (all layers)"] + inputs
    )
    single, _, _ = _stub_plan(dp=1, cp=1, ep=1, optimizer_offload=True)
    assert not single.optimizer_offload and not single.fsdp and "ignored" in single.notes[0]


def test_optimizer_offload_counts_the_host_work_as_it_runs():
    """With optimizer offload, per window: the PCIe copies of gradients and parameters once per optimizer
    step, every micro-batch after the first adding its gradient to the host's inside the backward (a
    blocking copy and a host add, `HOST_ACCUMULATE_BYTES_PER_PARAMETER`), and the host AdamW step, each at
    its rate (`rates.RATES`: pcie, host_memory over the node's GPUs)."""
    from genomelm.plan import rates
    from genomelm.plan.timing import HOST_ACCUMULATE_BYTES_PER_PARAMETER, HOST_ADAMW_BYTES_PER_PARAMETER

    accum = 4
    on, _, numel = _stub_plan(optimizer_offload=True, grad_accum=accum)
    off, _, _ = _stub_plan(optimizer_offload=False, grad_accum=accum)
    local = sum(v for k, v in numel.items() if k != "experts") / 4  # FSDP over dp*cp = 4 ranks
    pcie, host = 50e9, 430e9 / 8
    assert rates.rate("pcie").on("b200") == pcie and rates.rate("host_memory").on("b200") == 430e9
    parts = on.roofline["host_parts"]
    assert parts["optimizer offload copies"] == pytest.approx(2 * 4 * local / accum / pcie)
    accumulate = (accum - 1) / accum * local * (4 / pcie + HOST_ACCUMULATE_BYTES_PER_PARAMETER / host)
    assert parts["gradient accumulation on the host"] == pytest.approx(accumulate)
    assert parts["AdamW step on the host"] == pytest.approx(
        HOST_ADAMW_BYTES_PER_PARAMETER * local / accum / host
    )
    added = on.assumptions["host_copy_s"] - off.assumptions["host_copy_s"]
    assert added == pytest.approx(sum(parts.values())) and off.roofline["host_parts"] == {}
    single, _, _ = _stub_plan(optimizer_offload=True, grad_accum=1)
    assert single.roofline["host_parts"]["gradient accumulation on the host"] == 0


def test_refusal_names_the_best_fitting_layout(monkeypatch):
    """What `make train` prints when the run does not fit: check_fits raises exactly `refusal`'s message."""
    plan, _, _ = _stub_plan()
    too_big = dataclasses.replace(plan, fits=False, peak_gib_per_rank=250.0)
    slow = dataclasses.replace(plan, dp=4, cp=1, ep=4, tokens_per_s_projected=10.0, peak_gib_per_rank=90.0)
    fast = dataclasses.replace(
        plan, dp=1, cp=4, ep=2, offload=False, tokens_per_s_projected=20.0, peak_gib_per_rank=120.0
    )
    config = TrainConfig.from_args(["model=tiny", "seq=1024", "dp=2", "cp=2", "ep=2"])
    message = refusal(config, too_big, rank([too_big, slow, fast]))
    assert message.startswith("run ") and "250.0 GiB per rank > 178 GiB usable on B200" in message
    assert "best layout that fits 4 x B200: dp=1 cp=4 ep=2 offload=false optimizer_offload=false" in message
    assert message.endswith("force=true trains anyway")
    monkeypatch.setattr(planner, "make_plan", lambda config, traces=None: too_big)
    monkeypatch.setattr(planner, "search", lambda config, traces=None: [too_big, slow, fast])
    with pytest.raises(PlanError) as raised:
        check_fits(config)
    assert str(raised.value) == refusal(config, too_big, [too_big, slow, fast])
    assert check_fits(config.replace(force=True)) is too_big
    assert planner.describe_run(config).endswith("\n\n" + refusal(config, too_big, [too_big, slow, fast]))
    assert "no layout of 4 x B200 fits (best: 250.0 GiB" in refusal(config, too_big, [too_big])


@pytest.mark.slow
def test_trainer_logs_tracked_peak_next_to_the_plan(tmp_path):
    """`track_memory=true`: the trainer logs `peak_tracked_gb` (MemTracker on the real step) and the host peak
    RSS; at the second step (AdamW state live) the tracked peak is within 10% of the plan for the same run."""
    from genomelm.commands.train import main as train_main

    data = fly_windows(tmp_path / "fly", "1-2048", 512, heldout="200001-200512")
    settings = [
        f"data={data}",
        "seq=512",
        "model=tiny",
        "run=tracked",
        f"runs_dir={tmp_path / 'runs'}",
        "steps=2",
        "warmup_steps=1",
        "wandb=disabled",
        "track_memory=true",
        *SMALL_CHUNKS,
    ]
    assert train_main(settings) == 0
    metrics = tmp_path / "runs" / "tracked" / "metrics.jsonl"
    rows = [json.loads(row) for row in metrics.read_text().splitlines()]
    assert all(row["peak_tracked_gb"] > 0 and row["host_peak_rss_gb"] > 0 for row in rows)
    planned = allocated_gib(make_plan(TrainConfig.from_args(settings), traces=TRACES))
    assert abs(rows[-1]["peak_tracked_gb"] - planned) <= 0.10 * rows[-1]["peak_tracked_gb"], (rows, planned)


def test_fake_forward_equals_real_forward_on_one_rank():
    """The evaluator's forward (no_grad, bf16 parameters, per-token losses) on fake tensors holds and counts
    what the same forward holds on real ones."""
    run = TrainConfig.from_args(["model=tiny", *SMALL_CHUNKS])  # precision auto: bf16 on the GPUs planned
    model = ModelConfig.preset("tiny")
    fake = trace_forward(run, model, 256, fake=True)
    real = trace_forward(run, model, 256, fake=False)
    assert fake.step_peak == real.step_peak and fake.flops == real.flops and sum(fake.flops.values()) > 0
    assert fake.step_peak["Gradient"] == 0 and not fake.optimizer_peak and not fake.recomputed
    assert fake.kept == real.kept
    streams = 256 * model.hc_mult * model.hidden_size * 2  # a layer's input, bf16
    assert all(0 <= kept < streams for kept in fake.kept.values())  # no layer keeps even its input


def test_eval_plan_holds_less_than_the_training_step_and_passes_check_fits():
    """tiny at dp 2 x cp 2, ep 2: the evaluator's forward (traced, not the training step's) peaks lower, with
    no gradients, AdamW state or saved activations, and runs a quarter of the step's FLOPs (the step: the
    forward, its recompute and a backward of twice its cost); `check_fits` of `config.replace(stage="eval")`
    (what the evaluator calls) plans it."""
    config = TrainConfig.from_args(["model=tiny", "seq=512", "dp=2", "cp=2", "ep=2", "bucket=128"])
    train = make_plan(config, traces=TRACES)
    evaluation = check_fits(config.replace(stage="eval"))
    assert train.stage == "train" and evaluation.stage == "eval" and evaluation.fits
    assert 0 < evaluation.peak_gib_per_rank < train.peak_gib_per_rank
    assert not any("gradient" in k or "optimizer" in k or "saved" in k for k in evaluation.device_gib)
    live = evaluation.device_gib["live as the peak's module starts (streams, inputs)"]
    assert 0 < live < train.device_gib["saved activations (all layers)"]
    key = next(k for k in evaluation.device_gib if k.startswith("transient of "))
    assert evaluation.device_gib[key] == evaluation.transients_gib[key.removeprefix("transient of ")] > 0
    assert sum(evaluation.device_gib.values()) == pytest.approx(evaluation.peak_gib_per_rank)
    assert 0.2 < evaluation.flops_per_token / train.flops_per_token < 0.3
    assert evaluation.comm_bytes_per_step["cp all_gather"] > 0  # the layers' exchanges and the losses
    assert evaluation.evaluation.cut_tokens == 256 and evaluation.evaluation.cut_s > 0


@pytest.mark.parametrize(("precision", "fsdp"), [("auto", True), ("fp32", True), ("auto", False)])
def test_eval_parameters_are_the_stored_build_sharded(precision, fsdp):
    """The evaluator stores the parameters in bf16 (auto on the GPU), those the model declares fp32 in fp32,
    or all in fp32 (precision=fp32); with FSDP2 each rank holds 1 / (dp*cp) of them and gathers the root and
    two decoder layers (experts / ep), without it every parameter but the other ep ranks' experts."""
    plan, model_config, numel = _stub_plan(stage="eval", precision=precision, fsdp=fsdp)
    model = GlmForCausalLM.from_config(model_config, RunOptions(), torch.bfloat16, "meta")
    fp32 = set(fp32_declared(model)) if precision == "auto" else {n for n, _ in model.named_parameters()}
    assert fp32 and len(fp32) <= len(list(model.parameters()))

    def stored(names: list[str]) -> int:
        return sum(model.get_parameter(n).numel() * (4 if n in fp32 else 2) for n in names)

    names = [n for n, _ in model.named_parameters()]
    experts = stored([n for n in names if ".mlp.experts." in n])
    total = stored(names)
    assert total != 2 * sum(v for k, v in numel.items() if k != "experts")  # the fp32 ones count 4 B
    kind = "bf16, fp32 where declared" if precision == "auto" else "fp32"
    dev = {k: v * GIB for k, v in plan.device_gib.items()}
    key = "FSDP gathered: root (embedding, norm, head) + 2 decoder layers"
    if fsdp:
        assert dev[f"parameters ({kind})"] == pytest.approx(total / 4)  # dp 2 x cp 2
        layers = [stored([n for n in names if n.startswith(f"layers.{i}.")]) for i in range(4)]
        local = [  # each MoE layer's experts / ep
            b - stored([n for n in names if n.startswith(f"layers.{i}.mlp.experts.")]) / 2
            for i, b in enumerate(layers)
        ]
        root = total - sum(layers)
        assert dev[key] == pytest.approx(root + 2 * max(local))
    else:
        assert dev[f"parameters ({kind})"] == pytest.approx(total - experts / 2) and key not in dev
    assert plan.host_gib_per_node == {} and not plan.optimizer_offload


def test_eval_time_arithmetic(tmp_path):
    """One window's forward and the context cut's (seq - last_bucket_start + bucket tokens), each by its
    FLOPs and collectives; the whole evaluation: 2 models x ceil(windows / dp) x (window + cut), the windows
    counted in the prepared folder's manifest (eval_windows capping them), else estimated from hg38 chr22."""
    from data_fixtures import fly_windows

    from genomelm.data import WindowDataset
    from genomelm.run.scoring import last_bucket_start

    model_config = ModelConfig.preset("tiny")
    traced = reduced_layers(model_config)
    flops = {f"layers.{i}": (k + 1) * 1e15 for k, i in enumerate(traced)} | {"rest": 5e14}
    plan, _, _ = _stub_plan(stage="eval", bucket=256, flops=flops)
    e = plan.evaluation
    seq, cut = 1024, 1024 - last_bucket_start(1024, 256) + 256
    assert e.cut_tokens == cut == 512 and e.models == 2
    assert e.windows == math.ceil(39_159_782 / seq) and e.windows_source.startswith("estimated: hg38 chr22")
    assert e.per_replica == math.ceil(e.windows / 2)  # dp 2
    assert e.total_s == pytest.approx(2 * e.per_replica * (e.window_s + e.cut_s))
    a = plan.assumptions
    kinds = {layer_kind(model_config, i): i for i in traced}
    layers = range(model_config.num_hidden_layers)
    busiest = flops["rest"] + sum(flops[f"layers.{kinds[layer_kind(model_config, i)]}"] for i in layers)
    assert a["flat_compute_s"] == pytest.approx(busiest / (a["tflops"] * 1e12 * a["mfu"]))  # no expert FLOPs
    # the stub trace records no kernels: the roofline costs the expert exchange's copies and the router run
    # ahead of the chunks alone (both counted)
    from genomelm.plan.layouts import Layout
    from genomelm.plan.timing import device_peaks, exchange_copies, planned_routes

    layout = Layout(2, 2, 2, True, False)
    peaks = device_peaks(Assumptions().resolved("b200"), "b200")
    copies = exchange_copies(model_config, layout, seq // 2, 1, peaks, 4.0)
    chunk_tokens = TrainConfig.from_args(["model=tiny"]).model_options.moe_chunk_tokens
    routes = planned_routes(model_config, layout, seq // 2, chunk_tokens, peaks)
    assert routes and copies
    assert a["compute_s"] == pytest.approx(sum(c.seconds for c in copies + routes))
    assert e.window_s == pytest.approx(a["compute_s"] + a["comm_s"] + a["exposed_overlap_s"]) and e.cut_s > 0
    # the forward's collectives: every unit gathered once (bf16 as stored), the experts' all-to-all once
    moe = sum(t == "sparse" for t in model_config.mlp_layer_types)
    rows = seq // 2 * model_config.num_experts_per_tok
    a2a = rows * model_config.hidden_size * 2 / 2 * 2 * moe * 4.0  # (ep-1)/ep, both ways, imbalance 4
    assert plan.comm_bytes_per_step[
        "ep all_to_all started ahead (dispatch + combine; forward)"
    ] == pytest.approx(a2a)
    blocking, _, _ = _stub_plan(stage="eval", bucket=256, flops=flops, ep_overlap=False)
    assert blocking.comm_bytes_per_step["ep all_to_all (dispatch + combine; forward)"] == pytest.approx(a2a)
    assert "fsdp reduce_scatter (fp32 gradients)" not in plan.comm_bytes_per_step
    uncut, _, _ = _stub_plan(stage="eval", bucket=256, context_cut=False, flops=flops)
    assert uncut.evaluation.cut_tokens == 0 and uncut.evaluation.cut_s == 0
    assert uncut.evaluation.total_s == pytest.approx(2 * e.per_replica * e.window_s)
    data = fly_windows(tmp_path / "fly", "1-2048", 512, heldout="200001-201536")
    heldout = len(WindowDataset(data, "heldout"))
    counted, _, _ = _stub_plan(stage="eval", seq="512", bucket=128, data=str(data), flops=flops)
    assert counted.evaluation.windows == heldout == 3 and "manifest.json" in counted.evaluation.windows_source
    assert counted.evaluation.per_replica == 2  # ceil(3 / dp 2)
    capped, _, _ = _stub_plan(stage="eval", seq="512", bucket=128, data=str(data), eval_windows=1)
    assert capped.evaluation.windows == 1 and capped.evaluation.per_replica == 1


def test_check_fits_refuses_an_evaluation_that_does_not_fit():
    """GLM-5.3-Flash on one B200: its 313B parameters alone, in bf16, are 583.6 GiB. The evaluator's check
    (`config.replace(stage="eval")`) refuses it, naming the layout and the evaluation's own switches."""
    config = TrainConfig.from_args(
        ["model=glm-5.3-flash", "seq=256", "gpus=1", "moe_chunk_tokens=256", "loss_chunk_tokens=256"]
    )
    with pytest.raises(PlanError) as refused:
        check_fits(config.replace(stage="eval"))
    message = str(refused.value)
    pattern = r"the evaluation of run run does not fit: ([\d.]+) GiB per rank > 178 GiB usable on B200 "
    found = re.match(pattern + r"\(dp=1 cp=1 ep=1\); no layout of 1 x B200 fits", message)
    assert found and float(found.group(1)) > 583.6 and message.endswith("force=true evaluates anyway")


def test_plan_command_prints_and_writes_the_evaluation(tmp_path, capsys):
    """`genomelm plan ... stage=eval device=cpu`: the evaluation's peak, seconds per window, the held-out
    windows with their source and the hours for before + after, in plan-eval.json beside the training's."""
    from genomelm.commands.plan import main

    settings = ["model=tiny", "seq=512", "bucket=128", "gpus=4", "dp=2", "cp=2", "ep=2", "eval_windows=3"]
    assert main([*settings, "stage=eval", "device=cpu", f"runs_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "plan run, evaluation: 512-token windows on 4 x B200 (dp 2 x cp 2, ep 2" in out
    assert "context cut (256 tokens)" in out and "held-out windows: 3 (" in out
    assert "whole evaluation: 2 models x 2 windows per dp replica (ceil 3 / dp 2)" in out
    written = json.loads((tmp_path / "run" / "plan-eval.json").read_text())
    assert written["stage"] == "eval" and written["evaluation"]["windows"] == 3
    assert written["evaluation"]["total_s"] == pytest.approx(
        2 * 2 * (written["evaluation"]["window_s"] + written["evaluation"]["cut_s"])
    )
    assert not (tmp_path / "run" / "plan.json").exists()


def test_gpu_gib_caps_what_a_rank_may_use(tmp_path):
    """`gpu_gib` (a memory budget, e.g. the published recipe's 144.5 GiB) replaces the GPU's usable memory in
    the verdict: the same plan fits B200's 178 GiB and not a budget below its peak."""
    settings = ["model=tiny", "seq=512", f"runs_dir={tmp_path}", *SMALL_CHUNKS]
    plain = make_plan(TrainConfig.from_args(settings), traces=TRACES)
    assert plain.fits and plain.usable_gib == 178.0
    budget = plain.peak_gib_per_rank / 2
    capped = make_plan(TrainConfig.from_args([*settings, f"gpu_gib={budget}"]), traces=TRACES)
    assert capped.usable_gib == budget and not capped.fits
    assert capped.peak_gib_per_rank == plain.peak_gib_per_rank
    with pytest.raises(ValueError, match="gpu_gib=-1"):
        TrainConfig.from_args([*settings, "gpu_gib=-1"])


def test_a_runs_logged_expert_load_sets_the_imbalance_of_its_layouts_ep(tmp_path):
    """`tiny` (8 experts) at dp=2 x ep=2: the plan takes the busiest/mean its run's expert_load.json gives
    the static blocks at ep=2 (all the load on rank 0's four experts: 2x), and the busiest rank's time with
    it."""
    settings = ["model=tiny", "seq=512", "dp=2", "ep=2", "run=r", f"runs_dir={tmp_path}", *SMALL_CHUNKS]
    assumed = make_plan(TrainConfig.from_args([*settings, "imbalance=1"]), traces=TRACES)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "expert_load.json").write_text(
        json.dumps(
            {"through_step": 1, "steps": 1, "counts": {str(i): [4, 3, 2, 1, 0, 0, 0, 0] for i in (1, 2, 3)}}
        )
    )
    logged = make_plan(TrainConfig.from_args(settings), traces=TRACES)
    assert logged.assumptions["imbalance"] == 2.0
    assert "the static blocks at ep=2; placed by load 1.00" in logged.assumptions["imbalance_source"]
    assert logged.tokens_per_s_projected < assumed.tokens_per_s_projected  # the busiest rank's extra rows
    # the run places its experts by load: the imbalance after placement, as the even load's
    placed = make_plan(TrainConfig.from_args([*settings, "expert_placement=balanced"]), traces=TRACES)
    assert placed.assumptions["imbalance"] == 1.0
    assert placed.tokens_per_s_projected == pytest.approx(assumed.tokens_per_s_projected)
    # a copy slot per rank: at ep=2 the owners alone are even, so no layer uses it and nothing more moves
    copies = ["expert_placement=balanced", "expert_copies=1"]
    assert (
        make_plan(TrainConfig.from_args([*settings, *copies]), traces=TRACES).comm_bytes_per_step
        == placed.comm_bytes_per_step
    )
    # at ep=4 the owners alone leave 1.6x ([4 | 3 | 2+1 | 0]) and copies 1.13x; the owner of expert 0 sends
    # its weights to two copies and holds one copy: 3 experts' weights per MoE layer and pass (bf16), in the
    # forward, the recompute and the backward of 3 layers; memory still sized for the static blocks' 2.8x
    at4 = [*settings[:2], "dp=4", "ep=4", *settings[4:]]
    static4 = make_plan(TrainConfig.from_args(at4), traces=TRACES)
    with_copies = make_plan(TrainConfig.from_args([*at4, *copies]), traces=TRACES)
    assert with_copies.assumptions["imbalance"] == pytest.approx(17 / 15)
    one_expert = 3 * 32 * 16 * 2  # tiny: hidden 32, expert width 16, bf16
    copy_label = "ep copies' weights (forward, recompute) and gradients (backward)"
    assert with_copies.comm_bytes_per_step[copy_label] == pytest.approx(3 * one_expert * 3 * 3)
    assert with_copies.peak_gib_per_rank >= static4.peak_gib_per_rank
    assert with_copies.tokens_per_s_projected > static4.tokens_per_s_projected


def test_a_module_whose_peak_moment_changes_with_size_is_not_understated():
    """The DSA layer's torch path peaks, at small windows, in its sparse attention's per-block temporaries
    (a constant size) and, at large ones, in the indexer's per-block scores ([block, heads, P]: P grows with
    the window). A line through the layer's own peaks at 256 and 512 tokens misses the change; the plan reads
    each forward moment (by module and function) on its own line and takes the largest."""
    from genomelm.plan.memory import ScaledTraces, chunked_transients

    config = ModelConfig.preset("tiny")
    args = ["model=tiny", "seq=4096", "offload=false", "indexer_backend=torch", "dsa_backend=sparse"]
    run = TrainConfig.from_args(args)
    layers = reduced_layers(config)
    lo, hi, direct = (
        trace_step(run, config, t, layers, fake=True, optimizer=False) for t in (256, 512, 4096)
    )
    steps = ScaledTraces(lo, hi, 256, 512, 4096, layers, {})
    dsa = next(f"layers.{i}.self_attn" for i in layers if config.layer_types[i] == "indexed_attention")
    measured = direct.transients[dsa]
    assert steps.line(lo.transients[dsa], hi.transients[dsa]) < 0.6 * measured  # the layer's own line
    assert measured <= chunked_transients(run, steps)[dsa] <= 1.3 * measured
    assert any(key.endswith(":_block_scores") for key in hi.moments[dsa])  # the indexer's blocks, by name


# ------------------------------------------------------------------ the shipped configs: the plan's choice
def _plan_table():
    return benchmark("plan_table")


SHIPPED = [case for case in _plan_table().CASES if case.shipped]


@pytest.mark.slow
@pytest.mark.parametrize("case", SHIPPED, ids=[case.config for case in SHIPPED])
def test_shipped_config_is_the_plans_first_choice_and_fits_its_budget(case) -> None:
    """The shipped hg38 run configs carry the layout the planner ranks first for their own case (64 B200
    within the published recipe's 144.5 GiB per GPU): `benchmarks/plan_table.py`'s cases, searched as a
    reader runs `genomelm plan configs/train/hg38-<seq>.yaml search=true`; and the config's own plan fits the
    budget it names."""
    table = _plan_table()
    traces = TRACES  # the plan command's test traced hg38-1m's cp=16 pair already
    best = table.first_choice(case, traces)
    assert table.layout_of(best) == table.shipped_layout(case), (
        f"configs/train/{case.config}.yaml drifted from the plan's first choice: "
        "run `python benchmarks/plan_table.py --check` and copy the first layout into the config"
    )
    shipped = TrainConfig.load(ROOT / "configs" / "train" / f"{case.config}.yaml", ["device=cpu"])
    plan = shipped.plan  # the config names the GPUs and the budget its layout was chosen for
    assert (plan.gpus, plan.gpu, plan.gpu_gib) == (64, case.gpu, case.gpu_gib)
    own = make_plan(shipped, traces=traces)
    assert own.fits and own.peak_gib_per_rank <= case.gpu_gib


def _real_state_bytes(preset: str, optimizer: str) -> dict[str, int]:
    """One process's weights, gradients and moments after one optimizer step with zero gradients on the CPU
    (`store_weights`, `make_optimizer`): bytes as allocated, torchao's 8-bit moments as codes (1 B) and
    scales (4 B)."""
    from genomelm.train.lowbit import OptimState8bit
    from genomelm.train.optimizer import make_optimizer, store_weights

    precision = ["precision=bf16"] if optimizer == "adamw_bf16" else []
    config = TrainConfig.from_args([f"model={preset}", f"optimizer={optimizer}", *precision])
    model = GlmForCausalLM.from_config(ModelConfig.preset(preset), config.model_options)
    store_weights(model, config.optim)
    optim = make_optimizer(model, config.optim, torch.device("cpu"))
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optim.step()

    def size(tensor: torch.Tensor) -> int:
        if isinstance(tensor, OptimState8bit):
            return tensor.codes.numel() + 4 * tensor.scale.numel()
        return tensor.numel() * tensor.element_size()

    params = list(model.parameters())
    return {
        "weights": sum(size(p) for p in params),
        "gradients": sum(size(p.grad) for p in params),
        "moments": sum(size(optim.state[p][k]) for p in params for k in ("exp_avg", "exp_avg_sq")),
    }


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adamw_bf16"])
def test_optimizer_bytes_per_tensor_equal_a_real_optimizer_step(optimizer):
    """The planner's per-tensor count of one process (no FSDP) for each optimizer: the weights, gradients and
    moments of a real step on `tiny` (its 8-bit moments quantised where a tensor has >= 4096 values in whole
    blocks of 256: 43% of its values; the rest in the weight's dtype), byte for byte."""
    from genomelm.plan.layouts import Layout
    from genomelm.plan.optimizer_bytes import state_bytes

    config = TrainConfig.from_args(["model=tiny"])
    model_config = ModelConfig.preset("tiny")
    state = state_bytes(
        model_config, config.model_options, optimizer, Layout(1, 1, 1, False, False, optimizer)
    )
    real = _real_state_bytes("tiny", optimizer)
    assert (state.weights, state.gradients, state.moments) == (
        real["weights"],
        real["gradients"],
        real["moments"],
    )
    assert state.padding == 0 and state.values == sum(
        v for k, v in model_numel(model_config).items() if k != "experts"
    )
    if optimizer != "adamw":
        assert 0 < state.unquantised < 1  # norms, gates, biases and small projections stay unquantised


def test_sharded_optimizer_bytes_keep_adamws_numbers_and_count_the_padding_apart():
    """With FSDP over 4 ranks (experts over 2, then over 2): AdamW's even share is 16 B x total / 4 as before;
    the largest rank's extra rows (ceil(dim0 / shards)) are counted apart; low-bit moments are quantised by
    the local shard's size."""
    from genomelm.plan.layouts import Layout
    from genomelm.plan.optimizer_bytes import local_numel, parameter_specs, state_bytes

    config = TrainConfig.from_args(["model=small"])
    model_config = ModelConfig.preset("small")
    total = sum(v for k, v in model_numel(model_config).items() if k != "experts")
    layout = Layout(2, 2, 2, True, False)
    adamw = state_bytes(model_config, config.model_options, "adamw", layout)
    assert adamw.total == pytest.approx(16 * total / 4) and adamw.values == pytest.approx(total / 4)
    specs = parameter_specs(model_config, config.model_options)
    largest = sum(local_numel(spec, 4, 2, True)[1] for spec in specs)
    assert adamw.padding == pytest.approx(16 * (largest - total / 4)) and adamw.padding > 0
    low = state_bytes(model_config, config.model_options, "adamw8bit", layout)
    bf16 = state_bytes(model_config, config.model_options, "adamw_bf16", layout)
    assert bf16.total < low.total < adamw.total
    assert low.weights == adamw.weights and bf16.weights < low.weights and 0 < bf16.fp32_weights < 0.5


def test_search_plans_every_optimizer_and_the_low_bit_ones_hold_less():
    """The training search plans each layout for adamw, adamw8bit and adamw_bf16 (precision auto: bf16 on the
    GPUs planned for); for the same layout adamw_bf16 needs fewer bytes than adamw8bit, and adamw8bit than
    adamw; on the GPU the low-bit update is one fused kernel per parameter (fewer bytes than AdamW's loop),
    on the host torchao's eager update (more)."""
    from genomelm.plan.search import search
    from genomelm.plan.timing import HOST_LOWBIT_BYTES_PER_PARAMETER

    model_config = ModelConfig.preset("small")
    config = TrainConfig.from_args(["model=small", "seq=1024", "gpus=4"])
    plans = search(config, Assumptions(), _StubTraces(model_config))
    assert {p.optimizer for p in plans} == {"adamw", "adamw8bit", "adamw_bf16"}
    assert len(plans) % 3 == 0

    def of(optimizer: str, **switches):
        layout = {"dp": 2, "cp": 2, "ep": 2, "offload": True, "optimizer_offload": False} | switches
        (plan,) = [
            p
            for p in plans
            if p.optimizer == optimizer and all(getattr(p, k) == v for k, v in layout.items())
        ]
        return plan

    adamw, low, bf16 = of("adamw"), of("adamw8bit"), of("adamw_bf16")
    assert bf16.peak_gib_per_rank < low.peak_gib_per_rank < adamw.peak_gib_per_rank
    assert "parameters (bf16, fp32-declared in fp32)" in bf16.device_gib
    assert any(k.startswith("optimizer state (8-bit moments") for k in low.device_gib)
    assert bf16.assumptions["compute_s"] < low.assumptions["compute_s"] < adamw.assumptions["compute_s"]
    offloaded = of("adamw_bf16", optimizer_offload=True)
    host = offloaded.roofline["host_parts"]["adamw_bf16 step on the host"]
    adamw_host = of("adamw", optimizer_offload=True).roofline["host_parts"]["AdamW step on the host"]
    assert host == pytest.approx(adamw_host * HOST_LOWBIT_BYTES_PER_PARAMETER["adamw_bf16"] / 100)
    assert layout_args(offloaded).endswith("optimizer_offload=true optimizer=adamw_bf16")
    replicated = {
        opt: plan_layout(
            config.replace(fsdp=False, optimizer=opt, precision="bf16"),
            1,
            4,
            1,
            Assumptions(),
            _StubTraces(model_config),
            model_config,
            model_numel(model_config),
        ).device_gib["optimizer step peak (separate phase)"]
        for opt in ("adamw", "adamw8bit", "adamw_bf16")
    }
    assert replicated["adamw_bf16"] < replicated["adamw8bit"] < replicated["adamw"]
