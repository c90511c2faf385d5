"""Checkpoint bytes are checked: every file's size and xxh3-128 are recorded when written, resume=auto and
eval verify them and fall back to the checkpoint before a damaged one, naming the damaged files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from data_fixtures import fly_windows, tiny_run

from genomelm.data.errors import file_system, out_of_space, size_text
from genomelm.parallel.checkpoint import Checkpointer, verify_checkpoint
from genomelm.run.config import TrainConfig
from genomelm.run.metrics import read_metrics
from genomelm.run.models import model_pair
from genomelm.train.loop import train


@pytest.fixture(scope="module")
def fly(tmp_path_factory) -> Path:
    return fly_windows(tmp_path_factory.mktemp("data") / "fly", "1-4096", 512)


def arguments(fly: Path, tmp_path: Path, **overrides) -> list[str]:
    """The run's `key=value` settings, as `genomelm train` takes them."""
    return tiny_run(fly, tmp_path / "runs", **({"steps": 4} | overrides))


def settings(fly: Path, tmp_path: Path, **overrides) -> TrainConfig:
    return TrainConfig.load(None, arguments(fly, tmp_path, **overrides))


def flip(path: Path, offset: int, count: int) -> None:
    """XOR `count` bytes of `path` from `offset` (the file keeps its size)."""
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_one_process_resume_falls_back_from_a_damaged_checkpoint(fly: Path, tmp_path: Path) -> None:
    config = settings(fly, tmp_path)
    losses = train(config, progress=False)["losses"]
    checkpointer = Checkpointer(config.run_dir)
    newest = checkpointer.latest()
    weights = sorted((newest / "model").glob("*.safetensors"))[0]
    flip(weights, weights.stat().st_size // 2, 400)
    assert verify_checkpoint(newest) == [
        f"{weights}: its bytes differ from those written (xxh3-128 mismatch)"
    ]
    with pytest.warns(
        UserWarning, match=f"{newest} is damaged.*set aside as step-0000004.damaged.*{weights.name}"
    ):
        resumed = train(config, progress=False)  # the same run again: continues from step 2, not from 4
    assert resumed["start_step"] == 2
    assert resumed["losses"] == losses[2:]
    assert [row["loss"] for row in read_metrics(config.run_dir / "metrics.jsonl")] == losses
    # the damaged copy is kept aside, never again the newest: the new step 4 is, and it is what the run names
    names = sorted(path.name for path in checkpointer.root.iterdir())
    assert names == ["step-0000002", "step-0000004", "step-0000004.damaged"]
    assert resumed["checkpoint"] == checkpointer.latest() == newest and not verify_checkpoint(newest)


def test_a_truncated_newest_checkpoint_is_skipped_and_eval_falls_back(fly: Path, tmp_path: Path) -> None:
    config = settings(fly, tmp_path)
    train(config, progress=False)
    checkpointer = Checkpointer(config.run_dir)
    first, newest = checkpointer.complete()
    trainer = newest / "trainer.pt"
    trainer.write_bytes(trainer.read_bytes()[:100])  # a disk full mid-write of a later copy
    assert checkpointer.latest_verified() == first
    weights = sorted((newest / "model").glob("*.safetensors"))[0]
    flip(weights, 64, 16)
    with pytest.warns(UserWarning, match=f"damaged, using {first} instead.*{weights.name}"):
        assert model_pair(config)[1] == str(first / "model")
    # model= naming another architecture than the run's is refused, not silently replaced by the run's own
    with pytest.raises(ValueError, match="model=demo is not the model run r trained .* --before PATH"):
        model_pair(config.replace(model="demo"))


def _sharded_summary(config: TrainConfig) -> dict:
    from genomelm.commands.train import launch_training

    return launch_training(config)


@pytest.mark.slow
def test_sharded_resume_falls_back_from_a_damaged_shard(fly: Path, tmp_path: Path) -> None:
    """16 bytes changed inside one rank's `.distcp` shard of the newest sharded checkpoint: both ranks verify
    their share of the files, agree, and resume from the checkpoint before it."""
    config = settings(fly, tmp_path, cp=2)
    losses = _sharded_summary(config)["losses"]
    newest = Checkpointer(config.run_dir).latest()
    shard = newest / "state" / "__1_0.distcp"
    flip(shard, shard.stat().st_size // 3, 16)
    resumed = _sharded_summary(config)
    assert resumed["start_step"] == 2
    assert resumed["losses"] == pytest.approx(losses[2:], rel=1e-6)


def test_a_checkpoint_set_aside_while_another_rank_lists_the_folder_is_not_in_the_way(
    tmp_path: Path, monkeypatch
) -> None:
    """A step folder that another rank renames to `.damaged` between this rank's listing and its look at the
    entry is gone, not a file standing where the run writes (the race the sharded fall-back test met)."""
    checkpointer = Checkpointer(tmp_path / "run")
    checkpointer.root.mkdir(parents=True)
    (checkpointer.root / "step-0000002").mkdir()
    listed = [checkpointer.root / "step-0000002", checkpointer.root / "step-0000004"]  # step 4: renamed since
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(listed))
    assert checkpointer.blocked(2, 6) == []
    (checkpointer.root / "step-0000004").write_text("")  # a file there is in the way
    assert checkpointer.blocked(2, 6) == [(checkpointer.root / "step-0000004", "the checkpoint of step 4")]


@pytest.mark.parametrize(
    "failure",
    [
        OSError(28, "No space left on device"),
        RuntimeError(
            "Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: ...}) os error 28"
        ),
    ],
)
def test_disk_full_while_checkpointing_names_the_device_and_keeps_the_previous(
    fly: Path, tmp_path: Path, monkeypatch, capsys, failure: Exception
) -> None:
    """A full disk during the step-4 checkpoint (an OSError, or safetensors' own error): one line saying where
    space ran out and how much the checkpoint needs, exit 1; step 2 stays the newest, intact, and no
    half-written folder is left."""
    from genomelm.commands.train import main as train_main
    from genomelm.parallel import checkpoint

    real_save_model, calls = checkpoint.save_model, []

    def save_model(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise failure
        real_save_model(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_model", save_model)
    config = settings(fly, tmp_path)
    assert train_main(arguments(fly, tmp_path)) == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    # what the previous checkpoint took on disk (its headers and trainer state too), or the state's bytes
    state = checkpoint.state_bytes(*_model_and_optimizer(config))
    needed = max(state, Checkpointer(config.run_dir).latest_bytes())
    assert needed > state
    assert message.startswith(f"genomelm train: no space left on {file_system(tmp_path)} writing ")
    assert f"(the checkpoint needs about {size_text(needed)}, " in message and " free)" in message
    assert message.endswith(checkpoint.SPACE_ADVICE)
    checkpointer = Checkpointer(config.run_dir)
    assert checkpointer.latest_verified().name == "step-0000002"
    assert not list(checkpointer.root.glob(".tmp-*"))


def _model_and_optimizer(config: TrainConfig) -> tuple:
    """A one-process run's model and optimizer, as a checkpoint holds them (AdamW state after a step)."""
    from genomelm.train.loop import build_run, train_one_step

    run = build_run(config.replace(run="sizes"))
    run.summary = {"losses": [], "skipped": 0}
    train_one_step(run, 0)
    return run.model, run.optimizer


def test_a_full_disk_is_recognised_in_every_form_it_takes() -> None:
    """torch.distributed.checkpoint reports each rank's failure wrapped in a CheckpointException; safetensors
    as text; a plain OSError by errno; other errors are not a full disk."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from genomelm.parallel import checkpoint

    full = OSError(28, "No space left on device")
    assert out_of_space(CheckpointException("save failed", {1: _wrap_exception(full)}))
    with pytest.raises(OSError, match="No space left") as info, checkpoint.dcp_failures():
        raise CheckpointException("save failed", {1: _wrap_exception(full), 0: _wrap_exception(full)})
    assert info.value.errno == 28 and "failed on ranks [0, 1]" in info.value.__notes__[0]
    assert out_of_space(RuntimeError("IoError(Os { code: 28, kind: StorageFull }) os error 28"))
    wrapped = RuntimeError("saving failed")
    wrapped.__cause__ = full
    assert out_of_space(wrapped)
    assert not out_of_space(CheckpointException("save failed", {0: _wrap_exception(ValueError("shape"))}))
    assert not out_of_space(OSError(13, "Permission denied"))


def test_pruning_leaves_a_checkpoint_a_live_reader_holds(tmp_path: Path) -> None:
    """`genomelm eval` on a run that trains holds the checkpoint it scores: pruning leaves it while the holder
    runs and removes it at a later save once the holder is gone (a hold a kill left counts no more)."""
    from genomelm.parallel.checkpoint_holds import hold

    checkpointer = Checkpointer(tmp_path / "run")
    for step in (2, 4, 6):
        model = checkpointer.step_dir(step) / "model"
        model.mkdir(parents=True)
        (model / "config.json").write_text("{}")
        (model.parent / "trainer.pt").write_bytes(b"")
    taken = hold(checkpointer.step_dir(2))
    assert checkpointer.prune(1) == [checkpointer.step_dir(4)]
    assert [p.name for p in checkpointer.complete()] == ["step-0000002", "step-0000006"]
    record = json.loads(taken.read_text())
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    taken.write_text(json.dumps(record | {"pid": gone.pid}))  # as a killed reader leaves it
    assert checkpointer.prune(1) == [checkpointer.step_dir(2)]
    assert not list(checkpointer.root.glob(".tmp-*"))
