"""Training loop on real DNA with the `tiny` preset: learning, exact resume, crash safety, memory switches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from data_fixtures import fly_windows
from run_fixtures import short_run, short_run_settings, train_until_first_save

from genomelm.model import load_model
from genomelm.parallel.checkpoint import TMP_PREFIX, Checkpointer
from genomelm.run.config import TrainConfig
from genomelm.run.models import model_config_of
from genomelm.train.loop import NonFiniteLoss, train
from genomelm.train.memory import LayerRunner

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def one_window(tmp_path_factory) -> Path:
    """One 256-base training window of real fly DNA."""
    return fly_windows(tmp_path_factory.mktemp("data") / "one", "100001-100256", 256)


@pytest.fixture(scope="module")
def many_windows(tmp_path_factory) -> Path:
    """32 training windows of 128 bases."""
    return fly_windows(tmp_path_factory.mktemp("data") / "many", "300001-304096", 128)


def metrics(cfg: TrainConfig) -> list[dict]:
    return [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_overfits_one_repeated_window(tmp_path, one_window):
    cfg = short_run(
        tmp_path,
        one_window,
        seq=256,
        steps=50,
        lr=5e-3,
        warmup_steps=5,
        min_lr_ratio=1.0,
        weight_decay=0.0,
        save_every=1000,
    )
    losses = train(cfg, progress=False)["losses"]
    assert len(losses) == 50
    assert min(losses) < 0.2 * losses[0], losses


def test_resume_reproduces_uninterrupted_losses(tmp_path, many_windows, monkeypatch):
    whole = short_run(tmp_path / "a", many_windows)
    reference = train(whole, progress=False)["losses"]

    interrupted = short_run(tmp_path / "b", many_windows)
    train_until_first_save(interrupted, monkeypatch)  # Ctrl-C right after the step-3 checkpoint
    assert Checkpointer(interrupted.run_dir).latest().name == "step-0000003"

    resumed = train(interrupted, progress=False)
    assert resumed["start_step"] == 3
    assert resumed["losses"] == reference[3:]  # bit-for-bit on the CPU
    logged = [row["loss"] for row in metrics(interrupted)]
    assert logged == reference
    # the routed totals continue from the checkpoint: the same as the uninterrupted run's, each token of
    # the 6 steps' windows (128 bases) counted top_k times in every MoE layer
    load = json.loads((interrupted.run_dir / "expert_load.json").read_text())
    assert load == json.loads((whole.run_dir / "expert_load.json").read_text())
    top_k = model_config_of(whole.model).num_experts_per_tok
    assert load["through_step"] == load["steps"] == 6 and load["counts"]
    assert all(sum(counts) == 6 * 128 * top_k for counts in load["counts"].values())


def test_kill_during_checkpoint_write_leaves_last_checkpoint_loadable(tmp_path, many_windows):
    overrides = short_run_settings(tmp_path, many_windows, steps=10_000, save_every=1, keep_checkpoints=2)
    cfg = TrainConfig.load(None, overrides)
    checkpointer = Checkpointer(cfg.run_dir)
    root = checkpointer.root

    def half_written() -> bool:
        return root.is_dir() and any(p.name.startswith(TMP_PREFIX) for p in root.iterdir())

    for _attempt in range(5):  # the kill can land just after a rename; then try again
        proc = subprocess.Popen(
            [sys.executable, "-m", "genomelm.cli", "train", *overrides],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=ROOT,
        )
        deadline = time.monotonic() + 300
        try:
            # wait for one complete checkpoint, then kill while the next one is being written
            while checkpointer.latest() is None or not half_written():
                assert proc.poll() is None and time.monotonic() < deadline, "training wrote no checkpoint"
                time.sleep(0.0005)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        if half_written():
            break
    assert any(p.name.startswith(TMP_PREFIX) for p in root.iterdir())
    last = checkpointer.latest()
    assert last is not None
    model = load_model(str(last / "model"))
    state = torch.load(last / "trainer.pt", weights_only=False)
    assert state["step"] == int(last.name.split("-")[1])
    assert sum(p.numel() for p in model.parameters()) > 0
    # a resumed run removes the half-written folder and continues from the last good step
    resumed = train(cfg.replace(steps=state["step"] + 1), progress=False)
    assert resumed["start_step"] == state["step"]
    assert not any(p.name.startswith(TMP_PREFIX) for p in root.iterdir())


@pytest.mark.parametrize(
    "recompute,offload,keep_selection",
    [(True, False, False), (True, False, True), (False, True, True), (True, True, True)],
)
def test_memory_switches_do_not_change_numbers(recompute, offload, keep_selection, monkeypatch):
    from genomelm.model.indexer import Indexer

    torch.manual_seed(0)
    model = load_model("tiny")
    ids = torch.randint(1, 5, (2, 100))  # longer than index_topk, so the sparse selection matters
    labels = torch.randint(1, 5, (2, 100))

    def loss_and_grads(runner: LayerRunner | None):
        model.zero_grad(set_to_none=True)
        loss = model.loss(ids, labels, layer_runner=runner)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    base_loss, base_grads = loss_and_grads(None)
    calls = []
    real_select = Indexer.select
    monkeypatch.setattr(Indexer, "select", lambda self, *a: calls.append(1) or real_select(self, *a))
    loss, grads = loss_and_grads(
        LayerRunner(recompute=recompute, offload=offload, keep_selection=keep_selection)
    )
    runs_indexer_twice = recompute and not keep_selection
    assert len(calls) == len(model.config.dsa_layers) * (2 if runs_indexer_twice else 1)
    assert torch.equal(loss, base_loss)
    assert grads.keys() == base_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, base_grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_non_finite_steps_are_skipped_then_stop(tmp_path, many_windows, monkeypatch):
    from genomelm.model.model import GlmForCausalLM

    real_forward = GlmForCausalLM.forward
    monkeypatch.setattr(
        GlmForCausalLM, "forward", lambda self, *a, **k: real_forward(self, *a, **k) * float("nan")
    )
    cfg = short_run(tmp_path, many_windows, steps=10, max_bad_steps=3)
    with pytest.raises(NonFiniteLoss, match="3 non-finite steps in a row"):
        train(cfg, progress=False)
    rows = metrics(cfg)
    assert [row["skipped"] for row in rows] == [True, True, True]
    assert Checkpointer(cfg.run_dir).latest() is None


def test_trained_checkpoint_loads_in_transformers(tmp_path, many_windows):
    from transformers import Glm5NextForConditionalGeneration

    cfg = short_run(tmp_path, many_windows, steps=2, save_every=2)
    path = train(cfg, progress=False)["checkpoint"] / "model"
    ours = load_model(str(path)).eval()
    theirs = Glm5NextForConditionalGeneration.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = torch.randint(1, 5, (1, 64))
    with torch.no_grad():
        expected = torch.log_softmax(theirs(input_ids=ids).logits.float(), -1)[0, :-1].gather(
            -1, ids[0, 1:, None]
        )[:, 0]
        got = ours.token_logprobs(ids)[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_dry_run_full_model_without_gpu():
    out = subprocess.run(
        [sys.executable, "-m", "genomelm.cli", "train", "configs/train/hg38-512k.yaml", "dry_run=true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "313.3" in text and "34 KDA + 11 DSA" in text
    layer_rows = [line for line in text.splitlines() if line.strip()[:2].strip().isdigit() and "|" in line]
    assert len(layer_rows) == 45
    assert "dense S x S" not in text
    assert "recompute: full, per layer" in text and "offload of saved layer inputs: on" in text
    # the plan of the run's own layout, the one the planner ranks first for 64 B200 within 144.5 GiB
    assert "64 x B200 (dp 4 x cp 16, ep 2" in text and "FITS" in text and "DOES NOT FIT" not in text
    assert "traced 3 of 45 layers" in text and "FLOPs per token" in text
