"""GlmForCausalLM plumbing: construction (meta, dtypes, init), dense guard, path table, router stats, indexer
loss, layer_runner hook."""

from __future__ import annotations

import logging

import pytest
import torch
from model_helpers import random_tokens, tiny_config
from torch.utils.checkpoint import checkpoint

from genomelm.model import GlmForCausalLM, ModelConfig, RunOptions

FP32_SUFFIXES = (
    "mlp.gate.weight",
    "e_score_correction_bias",
    "conv1d.weight",
    "dt_bias",
    "A_log",
    "hc.base",
    "hc.scale",
)


def test_full_config_builds_on_meta() -> None:
    config = ModelConfig.preset("glm-5.3-flash")
    model = GlmForCausalLM.from_config(config, dtype=torch.bfloat16, device="meta")
    total = sum(p.numel() for p in model.parameters())
    assert 300e9 < total < 340e9, total
    assert all(p.is_meta for p in model.parameters())
    assert [layer.layer_type for layer in model.layers].count("indexed_attention") == 11


def test_dtypes_and_init() -> None:
    config = tiny_config()
    model = GlmForCausalLM.from_config(config, dtype=torch.bfloat16)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        want = torch.float32 if name.endswith(FP32_SUFFIXES) else torch.bfloat16
        assert tensor.dtype == want, name
    kda = model.layers[0].self_attn
    assert not kda.forget_gate.A_log.any()  # lower bound set
    dt = torch.nn.functional.softplus(kda.forget_gate.dt_bias)
    assert dt.min() >= 1e-4 * 0.99 and dt.max() <= 0.1 * 1.01
    indexer = model.layers[3].self_attn.indexer
    assert (indexer.index_kpool_compress_gate == 1).all() and not indexer.index_kpool_compress_ape.any()
    assert not model.embed_tokens.weight[config.pad_token_id].any()
    hc = model.layers[1].ffn_hc
    assert not hc.base.any() and (hc.scale == 1).all() and 0.01 < hc.fn.float().std() < 0.03


def test_dense_guard() -> None:
    model = GlmForCausalLM(tiny_config(), RunOptions(dsa_backend="dense", forbid_dense_above=50))
    ids = random_tokens(1, 51, 8, seed=0)
    with pytest.raises(ValueError, match="forbid_dense_above=50.*dense"):
        model.token_logprobs(ids)
    model.token_logprobs(ids[:, :50])
    sparse = GlmForCausalLM(tiny_config(), RunOptions(forbid_dense_above=50))
    sparse.token_logprobs(ids)


def test_dense_and_sparse_dsa_agree() -> None:
    dense = GlmForCausalLM(tiny_config(), RunOptions(dsa_backend="dense"))
    sparse = GlmForCausalLM(tiny_config(), RunOptions())
    sparse.load_state_dict(dense.state_dict())
    ids = random_tokens(2, 60, 8, seed=1)
    torch.testing.assert_close(sparse.token_logprobs(ids), dense.token_logprobs(ids), atol=1e-5, rtol=1e-5)


def test_route_table_logged_once_and_router_stats(caplog: pytest.LogCaptureFixture) -> None:
    config = tiny_config()
    model = GlmForCausalLM(config, RunOptions(moe_chunk_tokens=32))
    ids = random_tokens(2, 30, 8, seed=2)
    with caplog.at_level(logging.INFO, logger="genomelm.model.model"):
        model.token_logprobs(ids)
        model.token_logprobs(ids)
    logged = [r for r in caplog.records if "routes" in r.getMessage()]
    assert len(logged) == 1
    table = model.route_table()
    assert table in logged[0].getMessage()
    assert table.count("kda: torch chunked (chunk 64)") == 3 and table.count("dsa: sparse") == 1
    assert "moe: grouped" in table and "chunks of 32 tokens" in table
    stats = model.router_stats()
    assert sorted(stats) == [1, 2, 3]
    assert all(int(s.sum()) == 60 * config.num_experts_per_tok for s in stats.values())


def test_loss_reductions() -> None:
    model = GlmForCausalLM(tiny_config(), RunOptions(loss_chunk_tokens=7))
    ids = random_tokens(2, 20, 8, seed=3)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    per_token = model.loss(ids, labels, reduction="none")
    assert per_token.shape == (2, 20) and (per_token[:, -1] == 0).all()
    torch.testing.assert_close(model.loss(ids, labels), per_token.sum() / 38)
    logprobs = model.token_logprobs(ids)
    torch.testing.assert_close(-logprobs, per_token[:, :-1].detach())


def test_indexer_loss_added_when_training_indexer() -> None:
    config = tiny_config()
    plain = GlmForCausalLM(config, RunOptions())
    trained = GlmForCausalLM(config, RunOptions(train_indexer=True))
    trained.load_state_dict(plain.state_dict())
    ids = random_tokens(1, 40, 8, seed=4)
    labels = torch.roll(ids, -1, 1)
    base = plain.loss(ids, labels)
    assert plain.last_indexer_loss == {}
    total = trained.loss(ids, labels)
    assert sorted(trained.last_indexer_loss) == config.dsa_layers
    torch.testing.assert_close(total, base + sum(trained.last_indexer_loss.values()), atol=1e-5, rtol=1e-5)
    total.backward()
    assert trained.layers[3].self_attn.indexer.wq_b.weight.grad.abs().sum() > 0


def test_layer_runner_hook_with_checkpoint() -> None:
    model = GlmForCausalLM(tiny_config(), RunOptions())
    ids = random_tokens(1, 40, 8, seed=5)
    labels = torch.roll(ids, -1, 1)
    calls = []

    def runner(layer, streams, selection):
        calls.append(layer.layer_idx)
        return checkpoint(layer, streams, selection, use_reentrant=False)

    model.loss(ids, labels).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.loss(ids, labels, layer_runner=runner).backward()
    assert calls == [0, 1, 2, 3]
    for name, grad in expected.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, atol=1e-6, rtol=1e-5)
