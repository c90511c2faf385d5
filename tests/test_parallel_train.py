"""Training under context parallelism (gloo, 2 and 4 local processes) equals one process: the loss, every
parameter gradient, the per-step losses of `genomelm train cp=N` and the buckets of `genomelm eval cp=N`, on
real fly DNA."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from data_fixtures import fly_windows

from genomelm.parallel import launch
from genomelm.parallel.layout import LayoutError
from genomelm.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
CODES = {"A": 1, "C": 2, "G": 3, "T": 4}
TIMEOUT_S = 240


def fly_rows(length: int) -> list[torch.Tensor]:
    """[1, S] input_ids, labels (next base) and loss weights (1, 0 at the last position) of real DNA."""
    from Bio import SeqIO

    with gzip.open(ROOT / "data" / "dmel_chr4.fa.gz", "rt") as handle:
        bases = str(next(SeqIO.parse(handle, "fasta")).seq[300_000 : 300_000 + length]).upper()
    ids = torch.tensor([[CODES.get(b, 5) for b in bases]])
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    weights = (labels != -100).float()
    return [ids, labels, weights]


def step_on_rank(preset: str, length: int, kind: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One trainer micro-batch (recompute, offload, kept selections) on this rank; the window's loss and the
    gradients summed over the group (the same on every rank)."""
    from genomelm.model import load_model
    from genomelm.parallel.context import apply_context_parallel
    from genomelm.parallel.training import ContextRun
    from genomelm.train.memory import LayerRunner
    from genomelm.train.step import window_loss

    torch.manual_seed(0)
    model = load_model(preset)
    context = ContextRun.from_environment(kind)
    if context is not None:
        apply_context_parallel(model, context.group, context.kind)
    loss, _ = window_loss(model, fly_rows(length), LayerRunner(True, True, True), context)
    loss.backward()
    total = loss.detach()
    if context is not None:
        context.sum_gradients(model)
        total = context.global_sum(total)
    return float(total), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("cp,kind", [(2, "zigzag"), (4, "zigzag"), (2, "contiguous")])
def test_train_step_under_cp_equals_one_process(cp: int, kind: str) -> None:
    """`tiny` has every block type (KDA, DSA with k-pool 4, dense MLP, MoE, mHC); 512 tokens is 32x its
    index_topk, so the sparse selection matters."""
    loss, grads = step_on_rank("tiny", 512, kind)
    results = launch(step_on_rank, cp, "tiny", 512, kind, timeout_s=TIMEOUT_S)
    for cp_loss, cp_grads in results:
        assert cp_loss == pytest.approx(loss, rel=1e-5)
        assert cp_grads.keys() == grads.keys()
        for name, grad in grads.items():
            scale = float(grad.abs().max())
            torch.testing.assert_close(cp_grads[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.slow
def test_genomelm_train_cp2_equals_cp1(tmp_path) -> None:
    from genomelm.commands.train import main as train_main

    data = fly_windows(tmp_path / "fly", "1-4096", 512)
    losses = {}
    for cp in (1, 2):
        run = [
            f"data={data}",
            "seq=512",
            "model=tiny",
            f"run=cp{cp}",
            f"runs_dir={tmp_path / 'runs'}",
            "steps=3",
            "warmup_steps=1",
            "lr=3e-3",
            "wandb=disabled",
            f"cp={cp}",
            "rc_aug=0.5",
        ]
        assert train_main(run) == 0
        rows = (tmp_path / "runs" / f"cp{cp}" / "metrics.jsonl").read_text().splitlines()
        losses[cp] = [json.loads(row)["loss"] for row in rows]
    assert losses[2] == pytest.approx(losses[1], rel=1e-5)

    from genomelm.commands.eval import main as eval_main

    buckets = {}
    for cp in (1, 2):  # the cp=1 run's models, scored in 1 and 2 processes
        results = tmp_path / f"results-cp{cp}"
        assert (
            eval_main(
                [
                    f"data={data}",
                    "seq=512",
                    "model=tiny",
                    "run=cp1",
                    f"runs_dir={tmp_path / 'runs'}",
                    f"results_dir={results}",
                    "bucket=128",
                    f"cp={cp}",
                ]
            )
            == 0
        )
        buckets[cp] = json.loads((results / "cp1" / "buckets.json").read_text())["buckets"]
    assert len(buckets[1]) == len(buckets[2]) == 4
    for one, two in zip(buckets[1], buckets[2], strict=True):
        for model in ("before", "after"):
            assert two[model]["loss"] == pytest.approx(one[model]["loss"], rel=1e-6)


def test_bad_context_parallel_settings_refused_before_launch() -> None:
    from genomelm.run.launchers import check_layout

    with pytest.raises(LayoutError, match="multiple of 384 tokens"):
        check_layout(TrainConfig.load(None, ["model=tiny", "seq=16k", "cp=3"]))
    with pytest.raises(LayoutError, match="does not split"):  # more ranks than the window has chunks
        check_layout(TrainConfig.load(None, ["model=tiny", "seq=256", "cp=4"]))
    with pytest.raises(LayoutError, match="a window of 64 tokens"):  # a warm-up crop that cannot split
        check_layout(
            TrainConfig.load(
                None, ["model=tiny", "seq=1024", "cp=2", "seq_warmup_steps=4", "seq_warmup_start=64"]
            )
        )
    with pytest.raises(ValueError, match="cp=0"):
        check_layout(TrainConfig.load(None, ["model=tiny", "cp=0"]))
