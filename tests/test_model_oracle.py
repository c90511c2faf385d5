"""genomelm's GlmForCausalLM against transformers' Glm5NextTextModel (+ lm_head), every parameter
randomised."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_helpers import build_pair, kda_moe_config, oracle_logprobs, random_tokens, tiny_config

from genomelm.model import RunOptions

CONFIGS = {"kda_moe": kda_moe_config, "tiny": tiny_config}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest):
    config = CONFIGS[request.param]()
    # small chunks so the 100-token cases cross several KDA, MoE, loss, indexer and attention chunks
    options = RunOptions(
        kda_chunk_size=32,
        moe_chunk_tokens=48,
        loss_chunk_tokens=40,
        indexer_query_block=24,
        attention_query_block=16,
    )
    return build_pair(config, options)


@pytest.mark.parametrize("batch,seq_len", [(1, 11), (2, 11), (1, 100), (2, 100)])
def test_token_logprobs_match_transformers(pair, batch: int, seq_len: int) -> None:
    ref, head, ours = pair
    ids = random_tokens(batch, seq_len, ours.config.vocab_size, seed=seq_len + batch)
    with torch.no_grad():
        expected = oracle_logprobs(ref, head, ids)
    got = ours.token_logprobs(ids)
    assert got.shape == (batch, seq_len - 1)
    assert expected.std() > 0.1  # the check is not vacuous
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_sparse_selection_matters() -> None:
    """With the tiny config, 100 tokens are several times index_topk: a dense-attention model would differ."""
    config = tiny_config()
    assert config.index_topk * 4 < 100
    ref, head, _ = build_pair(config, RunOptions())
    ids = random_tokens(1, 100, config.vocab_size, seed=5)
    with torch.no_grad():
        sparse = oracle_logprobs(ref, head, ids)
        ref.config.index_topk = 128  # every token selected
        for layer in ref.layers:
            if (
                layer.self_attn.__class__.__name__ == "Glm5NextTextAttention"
                and layer.self_attn.indexer is not None
            ):
                layer.self_attn.indexer.index_topk = 128
        dense = oracle_logprobs(ref, head, ids)
    assert (sparse - dense).abs().max() > 1e-3


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradients_match_transformers(name: str) -> None:
    config = CONFIGS[name]()
    ref, head, ours = build_pair(
        config, RunOptions(kda_chunk_size=32, moe_chunk_tokens=64, loss_chunk_tokens=50)
    )
    ids = random_tokens(2, 96, config.vocab_size, seed=7)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[0, :5] = -100
    head = head.clone().requires_grad_(True)
    hidden = ref(input_ids=ids, use_cache=False).last_hidden_state
    F.cross_entropy((hidden @ head.T).flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    ours.loss(ids, labels).backward()

    ref_grads = {n: p.grad for n, p in ref.named_parameters()} | {"lm_head.weight": head.grad}
    checked = 0
    for name_, param in ours.named_parameters():
        expected = ref_grads[name_]
        if expected is None:  # the reference indexer runs under no_grad
            assert param.grad is None or not param.grad.any(), name_
            continue
        assert param.grad is not None, name_
        error = (param.grad - expected).norm() / expected.norm().clamp_min(1e-12)
        assert error <= 1e-3, f"{name_}: relative gradient error {error:.2e}"
        checked += 1
    assert checked >= len(list(ours.parameters())) - 7 * len(config.dsa_layers)
