"""What is planned is what is trained: `genomelm plan` traces the trainer's own `TrainStep`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from data_fixtures import fly_windows

from genomelm.model import ModelConfig
from genomelm.plan.recording import OpCounter
from genomelm.plan.trace import trace_step
from genomelm.run.config import TrainConfig

CHUNKS = ["moe_chunk_tokens=64", "loss_chunk_tokens=64", "indexer_query_block=32", "attention_query_block=32"]


def _trainer_collectives(config: TrainConfig) -> dict[str, int]:
    """Bytes per collective kind of one optimizer step as the training loop builds and runs it on this
    rank."""
    from genomelm.train.loop import build_run, step_windows

    torch.set_num_threads(1)
    run = build_run(config)
    counter = OpCounter(lambda: "step")
    with counter:
        outcome = run.step.run(1e-3, step_windows(run, 0, []))
    assert outcome.finite
    return counter.bytes["step"]


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [True, False])
def test_planner_traces_the_collectives_a_real_two_rank_step_dispatches(
    tmp_path: Path, recompute: bool
) -> None:
    """The planner's fake-tensor trace of one cp=2 rank dispatches the same collectives, of the same sizes, as
    the trainer's step on two real processes (gloo): the forward's exchanges, their recompute, the backward's
    reduce-scatters, the loss and token-weight sums, the gradient all-reduce and the clipping norm."""
    from genomelm.parallel.launch import launch

    data = fly_windows(tmp_path / "fly", "1-4096", 1024)
    config = TrainConfig.from_args(
        [
            f"data={data}",
            "seq=1024",
            "model=tiny",
            "cp=2",
            "fsdp=false",
            "precision=bf16",
            "offload=false",
            f"recompute={recompute}",
            f"runs_dir={tmp_path / 'runs'}",
            "wandb=disabled",
            *CHUNKS,
        ]
    )
    real = launch(_trainer_collectives, 2, config, timeout_s=600)
    traced = trace_step(config, ModelConfig.preset("tiny"), 512, fake=True)
    planned: dict[str, int] = {}
    for part in traced.comm.values():
        for kind, size in part.items():
            planned[kind] = planned.get(kind, 0) + size
    assert planned.get("all_gather", 0) > 0 and planned.get("all_reduce", 0) > 0
    assert real[0] == real[1] == planned


def _nan_training(config: TrainConfig) -> tuple[str, str] | None:
    """Train with a model whose every loss is NaN; the error this rank raised, by type name and message."""
    from genomelm.model.model import GlmForCausalLM
    from genomelm.train.loop import train

    real_forward = GlmForCausalLM.forward
    GlmForCausalLM.forward = lambda self, *a, **k: real_forward(self, *a, **k) * float("nan")
    try:
        train(config, progress=False)
    except Exception as exc:  # noqa: BLE001 - the test reads every rank's failure
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.slow
def test_non_finite_stop_is_the_same_error_on_every_rank(tmp_path: Path) -> None:
    """At cp=2 both ranks skip the non-finite steps and then raise `NonFiniteLoss` naming the metrics file
    (rank 1 has no metrics log of its own)."""
    from genomelm.parallel.launch import launch

    data = fly_windows(tmp_path / "fly", "1-2048", 512)
    config = TrainConfig.from_args(
        [
            f"data={data}",
            "seq=512",
            "model=tiny",
            "cp=2",
            "steps=6",
            "max_bad_steps=2",
            f"runs_dir={tmp_path / 'runs'}",
            "wandb=disabled",
            *CHUNKS,
        ]
    )
    failures = launch(_nan_training, 2, config, timeout_s=600)
    metrics = tmp_path / "runs" / "run" / "metrics.jsonl"
    for name, message in failures:
        assert name == "NonFiniteLoss" and "2 non-finite steps in a row at step 2" in message
        assert str(metrics) in message
    assert [line.count('"skipped": true') for line in metrics.read_text().splitlines()] == [1, 1]
