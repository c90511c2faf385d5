"""Training policy from outside the model: recompute counts, the indexer's KL through recompute, expert-bias
balancing, and the guards a user meets before the first step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from genomelm.commands.data import main as data_main
from genomelm.model import GlmForCausalLM, RunOptions, load_model, save_model
from genomelm.model.moe import Experts
from genomelm.run.config import TrainConfig
from genomelm.train.guards import RunMismatch
from genomelm.train.loop import train
from genomelm.train.memory import LayerRunner, set_chunk_recompute

ROOT = Path(__file__).resolve().parents[1]
GENOME = ROOT / "data" / "dmel_chr4.fa.gz"


@pytest.fixture(scope="module")
def windows(tmp_path_factory) -> Path:
    """16 training windows of 256 bases of real fly DNA."""
    out = tmp_path_factory.mktemp("data") / "fly"
    assert (
        data_main(
            [
                "--fasta",
                str(GENOME),
                "--genome",
                "fly",
                "--train",
                "NC_004353.4:400001-404096",
                "--heldout",
                "NC_004353.4:200001-201024",
                "--seq",
                "256",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    return out


def settings(tmp_path: Path, data: Path, **overrides) -> TrainConfig:
    values = {
        "run": "t",
        "model": "tiny",
        "data": str(data),
        "seq": "256",
        "steps": 4,
        "lr": 3e-3,
        "warmup_steps": 1,
        "save_every": 100,
        "wandb": "disabled",
        "runs_dir": str(tmp_path / "runs"),
        "results_dir": str(tmp_path / "results"),
    }
    values.update(overrides)
    return TrainConfig.load(None, [f"{k}={v}" for k, v in values.items()])


def fly_batch(model: GlmForCausalLM, data: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from genomelm.data import WindowDataset

    row = WindowDataset(data, "train")[0]
    return row.input_ids[None], row.labels[None]


@pytest.mark.parametrize("recompute_chunks,expected", [(False, 2), (True, 3)])
def test_expert_forward_runs_once_per_recompute(windows, recompute_chunks, expected) -> None:
    """Recompute is decided once: per-layer recompute runs each expert chunk twice per step; adding per-chunk
    recompute (a memory switch) makes it three."""
    torch.manual_seed(0)
    model = GlmForCausalLM(load_model("tiny").config, RunOptions(moe_chunk_tokens=64))
    set_chunk_recompute(model, recompute_chunks)
    calls = []
    for module in model.modules():
        if isinstance(module, Experts):
            module.register_forward_hook(lambda *_: calls.append(1))
    ids, labels = fly_batch(model, windows)
    model(ids, labels, layer_runner=LayerRunner(recompute=True, offload=True)).backward()
    moe_layers = sum(1 for t in model.config.mlp_layer_types if t == "sparse")
    assert len(calls) == expected * moe_layers * (ids.numel() // 64)


def test_indexer_trains_through_recompute(windows) -> None:
    """train_indexer with the trainer's recompute: the KL term has a graph, and its gradient equals the one
    without recompute."""
    torch.manual_seed(0)
    model = GlmForCausalLM(load_model("tiny").config, RunOptions(train_indexer=True))
    ids, labels = fly_batch(model, windows)
    grads = {}
    for name, runner in (("plain", None), ("recompute", LayerRunner(recompute=True, offload=True))):
        model.zero_grad(set_to_none=True)
        model(ids, labels, layer_runner=runner).backward()
        assert model.last_indexer_loss, name
        grads[name] = model.layers[3].self_attn.indexer.wq_b.weight.grad.clone()
    assert grads["recompute"].abs().sum() > 0
    torch.testing.assert_close(grads["recompute"], grads["plain"], rtol=1e-5, atol=1e-8)


def skewed_tiny(folder: Path) -> Path:
    """The tiny preset with routers that tell tokens apart (weights of a trained scale, N(0, 1/D)), every one
    biased towards experts 0 and 4 (one per group), saved as a folder."""
    torch.manual_seed(0)
    model = load_model("tiny")
    with torch.no_grad():
        for layer in model.layers:
            if hasattr(layer.mlp, "gate"):
                gate = layer.mlp.gate
                gate.weight.normal_(0.0, gate.weight.shape[1] ** -0.5)
                gate.e_score_correction_bias[[0, 4]] = 0.3
    save_model(model, folder)
    return folder


def balance(cfg: TrainConfig) -> list[float]:
    train(cfg, progress=False)
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [max(v for k, v in row.items() if k.endswith("max_over_mean")) for row in rows]


def test_expert_bias_balances_a_skewed_router(tmp_path, windows) -> None:
    model = skewed_tiny(tmp_path / "skewed")
    common = {"model": str(model), "steps": 8, "lr": 0.0}  # lr 0: only the bias update can change routing
    on = balance(settings(tmp_path / "on", windows, expert_bias_speed=0.03, **common))
    off = balance(settings(tmp_path / "off", windows, expert_bias_speed=0.0, **common))
    assert off[0] == on[0] > 2.5  # the same skewed start: most tokens on the two biased experts
    assert on[-1] < 0.6 * on[0], on
    assert max(off) / min(off) < 1.2, off  # without the update the skew stays (the windows differ)


def test_random_full_size_preset_is_refused(tmp_path, windows) -> None:
    with pytest.raises(
        RunMismatch, match=r"313\.\dB parameters of random weights.*MODEL=/path/to/GLM-5.3-Flash"
    ):
        train(settings(tmp_path, windows, model="glm-5.3-flash"), progress=False)
    with pytest.raises(RunMismatch, match="no model.*MODEL=/path/to/GLM-5.3-Flash"):
        train(settings(tmp_path, windows, model="null"), progress=False)


def test_vocabulary_mismatch_names_both_and_the_fix(tmp_path, windows) -> None:
    """The data uses the built-in ids (pad 0); a model with another padding id gets a clear error."""
    from genomelm.model.config import ModelConfig

    config = ModelConfig.preset("tiny")
    config.pad_token_id = 7
    folder = tmp_path / "other-vocab"
    save_model(GlmForCausalLM(config), folder)
    with pytest.raises(
        RunMismatch, match=r"built-in vocabulary \(ids pad=0.*padding id 7.*make data TOKENIZER="
    ):
        train(settings(tmp_path, windows, model=str(folder)), progress=False)


def test_resume_refuses_a_different_run(tmp_path, windows) -> None:
    train(settings(tmp_path, windows, steps=2, save_every=2), progress=False)
    other = tmp_path / "other-model"
    save_model(load_model("tiny"), other)
    with pytest.raises(RunMismatch, match=r"model: 'tiny' then, '.*other-model' now.*run=<new name>"):
        train(settings(tmp_path, windows, steps=4, model=str(other)), progress=False)


def test_steps_from_epochs(tmp_path, windows) -> None:
    cfg = settings(tmp_path, windows, steps=0, epochs=0.5, grad_accum=2)
    assert cfg.total_steps(16) == 4  # 8 windows in 2-window steps
    assert settings(tmp_path, windows, steps=3).total_steps(16) == 3


def test_kda_on_cuda_without_fla_is_refused(tmp_path, windows, monkeypatch) -> None:
    """On CUDA, KDA 'auto' without fla-core stops before the first step with the install command."""
    from genomelm.model import kda

    monkeypatch.setattr(kda, "fla_chunk_kda", lambda: None)
    layer = load_model("tiny").layers[0].self_attn
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[gpu\]'"):
        layer.resolve_backend(torch.device("cuda"))
