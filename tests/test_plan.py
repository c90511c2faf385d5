"""`genomelm plan`: a step traced on fake tensors holds what the same step holds on real tensors, and the plan
scaled from one layer of each kind predicts the measured peak of the whole model at 1, 2 and 4 ranks."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from genomelm.model import ModelConfig
from genomelm.train.config import TrainConfig
from genomelm.train.plan import (
    GIB,
    PlanError,
    _extrapolate,
    _quadratic,
    check_fits,
    load_assumptions,
    make_plan,
)
from genomelm.train.plan_trace import _grouped_mm_flops, reduced_layers, sub_config, trace_step

ROOT = Path(__file__).resolve().parents[1]
SMALL_CHUNKS = ["offload=false", "moe_chunk_tokens=64", "loss_chunk_tokens=64", "indexer_query_block=32",
                "attention_query_block=32"]


def test_reduced_layers_cover_every_kind():
    config = ModelConfig.preset("glm-5.3-flash")
    layers = reduced_layers(config)
    kinds = {(config.layer_types[i], config.mlp_layer_types[i], config.indexer_types[i])
             for i in range(config.num_hidden_layers)}
    assert len(layers) == len(kinds) and layers == sorted(layers)
    sub = sub_config(config, layers)
    assert sub.num_hidden_layers == len(layers) and sub.hidden_size == config.hidden_size


def test_extrapolation_is_exact_on_lines_and_quadratics():
    line = lambda t: 3 * t + 7
    assert _extrapolate(line(1024), line(2048), 1024, 2048, 65536) == pytest.approx(line(65536))
    quad = lambda t: 5 * t + 0.25 * t * t
    assert _quadratic(quad(1024), quad(2048), 1024, 2048, 65536) == pytest.approx(quad(65536))


def test_grouped_mm_flops_match_the_sliced_matmuls():
    tokens, dim, out, groups = 96, 16, 24, 4
    x, w = torch.randn(tokens, dim), torch.randn(groups, out, dim)
    assert _grouped_mm_flops(x.shape, w.transpose(-2, -1).shape, out_shape=(tokens, out)) == 2 * tokens * dim * out
    # weight gradient: [dim, T] x [T, out] -> [groups, dim, out]; each token's column once
    assert _grouped_mm_flops((dim, tokens), (tokens, out), out_shape=(groups, dim, out)) == 2 * dim * out * tokens


def test_assumptions_from_settings_and_from_the_runs_metrics(tmp_path):
    config = TrainConfig(run="r", runs_dir=str(tmp_path), extra={"mfu": "0.5", "optimizer_offload": "true"})
    assumptions = load_assumptions(config)
    assert assumptions.mfu == 0.5 and assumptions.optimizer_offload and assumptions.imbalance == 4.0
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "router/3/max_over_mean": 2.5, "router/4/max_over_mean": 3.25}) + "\n")
    measured = load_assumptions(dataclasses.replace(config, extra={}))
    assert measured.imbalance == 3.25 and "measured" in measured.imbalance_source


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


def _real_step(config: TrainConfig, preset: str, tokens: int):
    torch.set_num_threads(1)
    return trace_step(config, ModelConfig.preset(preset), tokens, fake=False)


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "seq", "cp"), [("tiny", 512, 1), ("tiny", 1024, 2), ("tiny", 2048, 4),
                                                   ("small", 2048, 1)])
def test_planned_peak_equals_measured_peak(preset, seq, cp):
    """The plan (one layer of each kind traced on fake tensors, scaled to all layers) against the whole model's
    real step, measured with the same tracker on every rank."""
    from genomelm.parallel.launch import launch

    config = TrainConfig.from_args([f"model={preset}", f"seq={seq}", f"cp={cp}", *SMALL_CHUNKS])
    plan = make_plan(config)
    assert plan.fits and plan.built and plan.cp == cp
    if cp == 1:
        measured = [_real_step(config, preset, seq)]
    else:
        measured = launch(_real_step, cp, config, preset, seq // cp, timeout_s=600)
    peak = max(m.peak_total for m in measured)
    assert abs(plan.peak_gib_per_rank * GIB - peak) <= 0.10 * peak, (plan.peak_gib_per_rank * GIB, peak)
    if cp > 1:
        traced = sum(sum(c.values()) for c in measured[-1].comm.values())
        assert traced > 0 and plan.comm_bytes_per_step["cp all_gather"] > 0


@pytest.mark.slow
def test_check_fits_refuses_with_the_layouts_it_tried_unless_forced():
    config = TrainConfig.from_args(["model=glm-5.3-flash", "seq=4096", "gpus=1",
                                    "moe_chunk_tokens=256", "loss_chunk_tokens=256"])
    config = dataclasses.replace(config, extra={"trace_tokens": "256"})
    with pytest.raises(PlanError, match="does not fit.*no layout of 1 GPUs fits.*force=true"):
        check_fits(config)
    plan = check_fits(dataclasses.replace(config, force=True))
    assert not plan.fits and plan.peak_gib_per_rank > 178


@pytest.mark.slow
def test_plan_command_full_model_on_the_cpu(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "genomelm.cli", "plan", "configs/train/hg38-1m.yaml", f"runs_dir={tmp_path}",
         "dp=4", "cp=16", "ep=32", "optimizer_offload=true"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "not built yet" in out.stdout and "traced 3 of 45 layers" in out.stdout
    plan = json.loads((tmp_path / "hg38-1m" / "plan.json").read_text())
    for key in ("fits", "peak_gib_per_rank", "host_gib_per_node", "flops_per_token", "comm_bytes_per_step",
                "tokens_per_s_projected", "assumptions"):
        assert key in plan
    assert plan["gpus"] == 64 and plan["peak_gib_per_rank"] > 0 and plan["tokens_per_s_projected"] > 0
