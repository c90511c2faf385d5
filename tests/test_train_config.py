"""Run settings: groups by owner, flat and dotted keys, YAML sections, one set of defaults, validation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from genomelm.model import RunOptions
from genomelm.run.config import TrainConfig, setting_names

ROOT = Path(__file__).resolve().parents[1]


def test_flat_and_dotted_keys_reach_the_same_group() -> None:
    flat = TrainConfig.from_args(["lr=2e-5", "cp=2", "moe_chunk_tokens=512", "kda_backend=torch"])
    dotted = TrainConfig.from_args(
        [
            "optim.lr=2e-5",
            "parallel.cp=2",
            "model_options.moe_chunk_tokens=512",
            "model_options.kda_backend=torch",
        ]
    )
    assert flat == dotted
    assert flat.optim.lr == 2e-5 and flat.parallel.cp == 2 and flat.model_options.moe_chunk_tokens == 512
    with pytest.raises(ValueError, match="unknown run setting 'optim.cp'"):
        TrainConfig.from_args(["optim.cp=2"])
    with pytest.raises(ValueError, match="unknown run setting 'fault_at_step'"):
        TrainConfig.from_args(["fault_at_step=3"])


def test_yaml_sections_flat_keys_and_later_files_override(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text("run: r\noptim:\n  lr: 3.0e-3\n  steps: 4\nmemory:\n  offload: false\nsave_every: 7\n")
    extra = tmp_path / "extra.yaml"
    extra.write_text("parallel:\n  launcher: ray\noptim:\n  steps: 9\n")
    config = TrainConfig.from_args([str(base), str(extra), "warmup_steps=2"])
    assert (config.run, config.optim.lr, config.optim.steps, config.optim.warmup_steps) == ("r", 3e-3, 9, 2)
    assert (
        not config.memory.offload and config.checkpoint.save_every == 7 and config.parallel.launcher == "ray"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  recompute: true\n")
    with pytest.raises(ValueError, match=r"bad.yaml: unknown run setting 'optim.recompute'"):
        TrainConfig.load(bad)


def test_chunk_sizes_have_one_set_of_defaults() -> None:
    """The trainer's chunk sizes are the model's `RunOptions`: no second set of defaults to bridge."""
    assert TrainConfig().model_options == RunOptions()


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("precision=fp16", "precision must be one of auto, bf16, fp32"),
        ("wandb=yes", "wandb must be one of offline, online, disabled"),
        ("cp_layout=spiral", "cp_layout must be one of zigzag, contiguous"),
        ("grad_accum=0", "grad_accum=0"),
        ("ep=3", r"ep=3 does not divide dp\*cp=1"),
        ("optimizer_offload=true", "needs fsdp=true and dp\\*cp > 1"),
        ("max_failures=1", "restarts are Ray's"),
        ("collective_timeout_s=0", "collective_timeout_s=0.0: give the seconds a collective may wait"),
        ("gpu=a100", "gpu must be one of b200, h200"),
        ("device=gpu", "device must be one of auto, cpu, cuda"),
        ("bucket=0", "bucket=0"),
        ("save_every=0", "save_every=0"),
        ("run=a/b", "without '/'"),
        ("run=..", "without '/'"),
        ("grad_clip=0", "grad_clip=0.0: give a gradient norm > 0, or none"),
        ("grad_clip=-1", "grad_clip=-1.0"),
        ("weight_decay=-1", "weight_decay=-1.0: give a decay >= 0"),
        ("lr=-1", "lr=-1.0"),
        ("min_lr_ratio=5", r"min_lr_ratio=5.0: give a ratio in \[0, 1\]"),
        ("log_every=0", "log_every=0"),
        ("seq_warmup_steps=-1", "seq_warmup_steps=-1"),
        (
            "model=nosuch",
            r"model=nosuch: no such checkpoint folder or preset.*\(demo, glm-5.3-flash, small, tiny\)",
        ),
        ("seq=12q", "12q"),
    ],
)
def test_each_group_validates_itself(setting: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_args([setting])


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("epochs=inf", "epochs=inf: expected a finite number"),
        ("lr=inf", "lr=inf: expected a finite number"),
        ("lr=nan", "lr=nan: expected a finite number"),
        ("lr=.inf", "lr=inf: expected a finite number"),  # YAML's own spelling of infinity
        ("collective_timeout_s=inf", "collective_timeout_s=inf: expected a finite number"),
        ("steps=true", "steps=true: expected a whole number"),
        ("steps=2.5", "steps=2.5: expected a whole number"),
        ("grad_accum=1e400", "grad_accum=1e400: expected a whole number"),
        ("fsdp=maybe", "fsdp=maybe: expected true or false"),
        ("betas=[0.9]", r"betas=\[0.9\]: expected a list of 2 finite numbers, e.g. \[0.9, 0.95\]"),
        ("betas=[0.9,0.95,0.99]", "expected a list of 2 finite numbers"),
        ("betas=[0.9,inf]", "expected a list of 2 finite numbers"),
        ("betas=0.9", "expected a list of 2 finite numbers"),
    ],
)
def test_numbers_are_finite_and_of_their_kind(setting: str, message: str) -> None:
    """What passed the range checks before and failed later (an OverflowError, a diverged run that exited 0,
    an IndexError after `init/` was written, one step for `steps=true`) is refused as the setting is read."""
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_args([setting])


def test_whole_numbers_written_as_floats_and_pairs_as_lists_are_taken() -> None:
    config = TrainConfig.from_args(["steps=4.0", "betas=[0.8, 0.9]", "lr=3e-3", "fsdp=off"])
    assert (config.optim.steps, config.optim.betas, config.optim.lr) == (4, (0.8, 0.9), 3e-3)
    assert config.parallel.fsdp is False


def test_none_turns_clipping_off() -> None:
    assert TrainConfig.from_args(["grad_clip=none"]).optim.grad_clip is None


def test_replace_finds_each_settings_group() -> None:
    config = TrainConfig().replace(steps=3, cp=2, bucket=8, run="x")
    assert (config.optim.steps, config.parallel.cp, config.eval.bucket, config.run) == (3, 2, 8, "x")
    assert TrainConfig().optim.steps == 0  # a copy, not a change
    with pytest.raises(ValueError, match="unknown run setting 'nonsense'"):
        TrainConfig().replace(nonsense=1)


def test_shipped_run_configs_load() -> None:
    for path in sorted((ROOT / "configs" / "train").glob("*.yaml")):
        TrainConfig.load(path)
    cluster = TrainConfig.load([ROOT / "configs/train/hg38-1m.yaml", ROOT / "configs/cluster/b200x64.yaml"])
    assert (cluster.parallel.dp, cluster.parallel.cp, cluster.parallel.ep) == (2, 32, 2)
    assert cluster.parallel.launcher == "ray" and cluster.plan.gpus == 64


def test_settings_doc_lists_every_setting() -> None:
    doc = (ROOT / "docs" / "settings.md").read_text()
    rows = {name: group for group, name in re.findall(r"^\| (\S+) \| `(\w+)` \|", doc, flags=re.M)}
    expected = {name: group or "(top)" for name, group in setting_names().items()}
    assert rows == expected


def test_a_resume_keeps_the_windows_per_step_or_refuses_and_says_what_changed() -> None:
    """A dp=2 ep=2 run resumed as one process trains two windows per step as before (grad_accum raised, with
    a line); a dp that cannot keep them is refused with the choices; a cp or ep change says it is exact."""
    from genomelm.train.guards import RunMismatch, same_step

    saved = TrainConfig().replace(dp=2, ep=2, grad_accum=1).to_dict()
    step = Path("step-0000004")
    resumed, line = same_step(TrainConfig(), saved, step)
    assert resumed.optim.grad_accum == 2
    assert line is not None
    assert (
        "(dp=2 cp=1 ep=2 -> dp=1 cp=1 ep=1): 2 windows per optimizer step as before; grad_accum=1 -> 2"
        in line
    )
    assert same_step(TrainConfig().replace(dp=2, ep=2), saved, step) == (
        TrainConfig().replace(dp=2, ep=2),
        None,
    )
    resharded, line = same_step(TrainConfig().replace(dp=2, cp=2, ep=4), saved, step)
    assert (
        resharded.optim.grad_accum == 1 and "dp=2 cp=2 ep=4): 2 windows per optimizer step as before," in line
    )
    with pytest.raises(
        RunMismatch, match=r"trained 2 windows per optimizer step .* dp=4 cannot keep"
    ) as refused:
        same_step(TrainConfig().replace(dp=4), saved, step)
    assert "resume=never run=<new name>" in str(refused.value)


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "run.yaml"
    bad.write_text("optim:\n  lr: 1e-4\n  betas: [0.9, 0.95\nrun: x\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}:4:4: not valid YAML \(.*line 3\)"):
        TrainConfig.from_args([str(bad)])
    with pytest.raises(ValueError, match=r"override 'betas=\[0.9': its value is not valid YAML"):
        TrainConfig.from_args(["betas=[0.9"])
