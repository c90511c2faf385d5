"""benchmarks/pretrain_copy.py's reference copier: every pairing of local path and attention is causal and
trains, its DSA layer starts at the initialisation it names, and the measured share of the preceding bases in
the attention's input follows the local path; a stage started from a saved one keeps the chain's
provenance."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from benchmark_modules import benchmark
from torch import nn


def _pretrain_copy():
    return benchmark("pretrain_copy")


@pytest.mark.parametrize(
    ("local", "attention"), [("convs", "softmax"), ("conv", "dsa"), ("kda", "dsa"), ("kda", "softmax")]
)
def test_every_pairing_is_causal_and_takes_gradient(local: str, attention: str) -> None:
    bench = _pretrain_copy()
    torch.manual_seed(0)
    model = bench.ReferenceCopier(local, attention, seq=64)
    ids = torch.randint(1, 5, (2, 64))
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    nll = model(ids, labels)
    assert nll.shape == (2, 64) and torch.isfinite(nll).all()
    nll[:, :-1].mean().backward()
    # every matrix of the attention takes gradient, but the DSA indexer's: its selection here is all tokens
    matrices = [p for name, p in model.attention.named_parameters() if p.ndim == 2 and "indexer" not in name]
    assert matrices and all(p.grad is not None and p.grad.abs().sum() > 0 for p in matrices)

    changed = ids.clone()
    changed[:, 40] = 5 - changed[:, 40]  # another base at position 40
    changed_labels = torch.cat([changed[:, 1:], torch.full_like(changed[:, :1], -100)], dim=1)
    with torch.no_grad():
        before, after = model(ids, labels), model(changed, changed_labels)
    # positions before 39 neither see base 40 nor predict it
    torch.testing.assert_close(before[:, :39], after[:, :39])
    assert not torch.allclose(before[:, 40:], after[:, 40:])


def test_the_dsa_layer_starts_at_fan_in_or_at_the_glm_initialisation() -> None:
    bench = _pretrain_copy()
    torch.manual_seed(0)
    stds = {}
    for init in ("fan-in", "reference"):
        dsa = bench.ReferenceCopier("convs", "dsa", init, seq=64).attention.layer
        stds[init] = float(dsa.q_b_proj.weight.detach().std())
        assert isinstance(dsa.q_b_proj, nn.Linear)
    fan_in = dsa.q_b_proj.in_features
    assert stds["fan-in"] == pytest.approx((3 * fan_in) ** -0.5, rel=0.1)  # uniform(+-1/sqrt(fan_in))
    assert stds["reference"] == pytest.approx(0.02, rel=0.1)


def test_preceding_share_is_what_the_local_path_adds_and_scales_with_it() -> None:
    bench = _pretrain_copy()
    torch.manual_seed(0)
    ids = torch.randint(1, 5, (4, 128))
    model = bench.ReferenceCopier("convs", "softmax", seq=128)
    current, with_preceding = bench.preceding_share(model, ids)
    assert with_preceding - current > 0.1 and with_preceding > 0.95  # the convolutions' 6 bases back
    bench.scale_local_path(model, 0.0)  # the attention then reads the current base alone
    assert bench.preceding_share(model, ids) == pytest.approx((1.0, 1.0), abs=1e-9)

    kda = bench.ReferenceCopier("kda", "dsa", seq=128)
    weight = kda.local.layer.o_proj.weight.detach().clone()
    bench.scale_local_path(kda, 3.0)
    torch.testing.assert_close(kda.local.layer.o_proj.weight.detach(), 3 * weight)


def test_local_init_makes_each_kda_layer_read_its_last_bases() -> None:
    """After `local_init` a KDA layer's q and k are one map and its state forgets >99% per step: its output
    at a position moves with the bases just before it, and hardly with one 20 bases back."""
    bench = _pretrain_copy()
    torch.manual_seed(0)
    model = bench.ReferenceCopier("kda", "dsa", seq=64)
    bench.local_init(model)
    kda = model.local.layer
    torch.testing.assert_close(kda.q_proj.weight, kda.k_proj.weight)
    width = kda.conv1d.weight.shape[0] // 3
    torch.testing.assert_close(kda.conv1d.weight[:width], kda.conv1d.weight[width : 2 * width])
    x = torch.randn(1, 64, kda.q_proj.in_features)
    with torch.no_grad():
        assert float(kda.forget_gate(x).max()) < torch.log(torch.tensor(0.01))
        out = kda(x)[0][0, 50]
        moved = {}
        for back in (1, 20):
            changed = x.clone()
            changed[0, 50 - back] = torch.randn(kda.q_proj.in_features)
            moved[back] = float((kda(changed)[0][0, 50] - out).norm() / out.norm())
    assert moved[1] > 100 * moved[20]


def test_train_indexer_adds_the_kl_term_and_trains_the_indexer() -> None:
    """`--train-indexer`: the training loss carries the indexer's KL term, whose gradient reaches the
    indexer (the per-token losses alone leave it without one)."""
    bench = _pretrain_copy()
    torch.manual_seed(0)
    ids = torch.randint(1, 5, (1, 64))
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    grads = {}
    for train in (False, True):
        model = bench.demo_model(64, [], train_indexer=train)
        loss = bench.training_loss(model, model(ids, labels, reduction="none"), labels)
        loss.backward()
        indexer = model.layers[-1].self_attn.indexer
        grads[train] = sum(float(p.grad.abs().sum()) for p in indexer.parameters() if p.grad is not None)
    assert grads[False] == 0 and grads[True] > 0


def test_a_later_stage_saves_the_demo_topk_and_nests_its_starts_provenance(tmp_path, monkeypatch) -> None:
    """`--out` after `--init`: the saved config carries `--out-index-topk`, and its provenance nests the
    stage it started from, with that stage's curve (the chain `make pretrain-demo` writes)."""
    bench = _pretrain_copy()
    first, second = tmp_path / "1-first", tmp_path / "2-second"
    common = ["pretrain_copy.py", "--data", "synthetic", "--seq", "64", "--batch", "2", "--every", "1"]
    for argv in (
        [*common, "--steps", "2", "--out", str(first)],
        [*common, "--steps", "1", "--init", str(first), "--out", str(second), "--out-index-topk", "16"],
    ):
        monkeypatch.setattr(sys, "argv", argv)
        bench.main()
    config = json.loads((second / "config.json").read_text())["text_config"]
    assert config["index_topk"] == 16
    assert json.loads((first / "config.json").read_text())["text_config"]["index_topk"] == 64  # = seq
    provenance = json.loads((second / "provenance.json").read_text())
    assert f"--init {first}" in provenance["command"]
    assert f"--out {first}" in provenance["init"]["command"] and "init" not in provenance["init"]
    assert [row["step"] for row in provenance["init"]["curve"]] == ["1", "2"]
