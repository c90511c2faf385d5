"""The optimizer choices (`optimizer=adamw|adamw8bit|adamw_bf16`): what each keeps, exact resume in one
process and on a dp2 x ep2 FSDP2 mesh, a reshard to dp2 x cp2, and a checkpoint of another optimizer
refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from data_fixtures import fly_windows
from run_fixtures import short_run, train_until_first_save
from test_parallel_mesh import train_losses

from genomelm.model import GlmForCausalLM, ModelConfig
from genomelm.parallel.fsdp import fp32_declared
from genomelm.run.config import OptimConfig, TrainConfig
from genomelm.train.guards import RunMismatch
from genomelm.train.loop import train
from genomelm.train.optimizer import make_optimizer, store_weights

LOW_BIT = ("adamw8bit", "adamw_bf16")


def precision_of(optimizer: str) -> list[str]:
    return ["precision=bf16"] if optimizer == "adamw_bf16" else []


@pytest.fixture(scope="module")
def windows(tmp_path_factory) -> Path:
    """32 training windows of 128 bases."""
    return fly_windows(tmp_path_factory.mktemp("data") / "many", "300001-304096", 128)


def config(tmp_path: Path, data: Path, optimizer: str, **overrides) -> TrainConfig:
    return short_run(tmp_path, data, *precision_of(optimizer), optimizer=optimizer, **overrides)


def test_low_bit_choices_keep_torchao_8bit_moments_and_bf16_weights_with_the_fp32_declared_kept() -> None:
    from genomelm.train.lowbit import OptimState8bit

    for optimizer in LOW_BIT:
        model = GlmForCausalLM.from_config(ModelConfig.preset("tiny"))
        optim = OptimConfig(optimizer=optimizer)
        store_weights(model, optim)
        opt = make_optimizer(model, optim, torch.device("cpu"))
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        opt.step()
        kept_fp32 = set(fp32_declared(model))
        for name, param in model.named_parameters():
            bf16 = optimizer == "adamw_bf16" and name not in kept_fp32
            assert param.dtype == (torch.bfloat16 if bf16 else torch.float32), name
            moment = opt.state[param]["exp_avg"]
            quantised = param.numel() >= 4096 and param.numel() % 256 == 0  # torchao's rule
            assert isinstance(moment, OptimState8bit) == quantised, name
        plain = opt.state_dict()["state"]
        assert all(entry["exp_avg"].dtype == torch.float32 for entry in plain.values())
        assert not any(isinstance(entry["exp_avg"], OptimState8bit) for entry in plain.values())


def test_adamw_bf16_asks_for_bf16_precision(tmp_path) -> None:
    with pytest.raises(ValueError, match="add precision=bf16"):
        TrainConfig.load(None, ["optimizer=adamw_bf16", "precision=auto"])
    with pytest.raises(ValueError, match="optimizer must be one of adamw, adamw8bit, adamw_bf16"):
        TrainConfig.load(None, ["optimizer=adam"])


@pytest.mark.parametrize("optimizer", LOW_BIT)
def test_one_process_resume_equals_the_uninterrupted_run(tmp_path, windows, optimizer, monkeypatch) -> None:
    whole = config(tmp_path / "a", windows, optimizer)
    reference = train(whole, progress=False)["losses"]
    assert reference[-1] < reference[0]
    interrupted = config(tmp_path / "b", windows, optimizer)
    train_until_first_save(interrupted, monkeypatch)
    resumed = train(interrupted, progress=False)
    assert resumed["start_step"] == 3
    assert resumed["losses"] == reference[3:]  # bit for bit: the quantised moments come back as kept


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path, windows) -> None:
    train(config(tmp_path, windows, "adamw", steps=3), progress=False)
    with pytest.raises(RunMismatch, match="optimizer: 'adamw' then, 'adamw8bit' now") as refused:
        train(config(tmp_path, windows, "adamw8bit", steps=6), progress=False)
    assert "resume=never run=<new name>" in str(refused.value)


@pytest.fixture(scope="module")
def mesh_data(tmp_path_factory) -> Path:
    return fly_windows(tmp_path_factory.mktemp("mesh") / "fly", "1-8192", 512)


def resumed_from_step_2(runs: Path, full: str, name: str, *settings: str) -> list[float]:
    """A copy of run `full` without its step-4 checkpoint, continued with `settings` (steps 3 and 4)."""
    shutil.copytree(runs / full, runs / name)
    shutil.rmtree(runs / name / "checkpoints" / "step-0000004")
    metrics = runs / name / "metrics.jsonl"
    rows = [json.loads(row) | {"copied": True} for row in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    losses = train_losses(runs.parent / "data", runs, name, *settings)
    rows = [json.loads(row) for row in metrics.read_text().splitlines()]
    # continued from step 2: the rows it kept are the copied ones, steps 3 and 4 its own
    assert [(row["step"], "copied" in row) for row in rows] == [(1, True), (2, True), (3, False), (4, False)]
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", LOW_BIT)
def test_sharded_resume_is_exact_and_reshards_to_context_parallel(mesh_data, tmp_path, optimizer) -> None:
    """dp2 x ep2 under FSDP2 (two meshes: the experts' and the rest's), 4 steps saved at 2 and 4; continued
    from step 2 on the same layout (equal losses, bit for bit), and on dp2 x cp2 (the fp32 moments of the
    checkpoint resharded by DCP, then quantised on the new shards)."""
    runs = tmp_path / "runs"
    (tmp_path / "data").symlink_to(mesh_data)
    common = [
        "steps=4",
        "save_every=2",
        "keep_checkpoints=0",
        f"optimizer={optimizer}",
        *precision_of(optimizer),
    ]
    full = train_losses(mesh_data, runs, "full", "dp=2", "ep=2", *common)
    same = resumed_from_step_2(runs, "full", "same", "dp=2", "ep=2", *common)
    assert same == full
    resharded = resumed_from_step_2(runs, "full", "cp", "dp=2", "cp=2", "ep=2", *common)
    tolerance = 4 * 2**-8 if optimizer == "adamw_bf16" else 1e-5  # bf16 weights: cp2's own rounding
    assert resharded[:2] == full[:2]
    assert resharded[2:] == pytest.approx(full[2:], rel=tolerance)


def test_the_compiled_update_a_gpu_runs_equals_the_eager_one_on_local_8bit_moments() -> None:
    """The update GPUs compile (torchao's `single_param_adam` through torch.compile, here inductor's CPU
    backend) on a quantised parameter's local tensors equals the eager update the CPU runs."""
    from genomelm.train.lowbit import LowBitAdamW, single_param_adam

    torch.manual_seed(0)
    results = []
    for update in (single_param_adam, torch.compile(single_param_adam, fullgraph=True, dynamic=False)):
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(32, 256))
        opt = LowBitAdamW([{"params": [param], "weight_decay": 0.1}], compiled=False, lr=1e-2)
        for _ in range(3):
            param.grad = torch.randn_like(param)
            opt._update(update, param, opt.param_groups[0])
        state = opt.state[param]
        results.append(
            (param.detach().clone(), state["exp_avg"].dequantize(), state["exp_avg_sq"].dequantize())
        )
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
