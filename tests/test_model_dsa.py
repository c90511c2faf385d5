"""DSA layer and k-pool indexer against transformers' Glm5NextTextAttention / Glm5NextTextIndexer (fp32,
CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

from genomelm.model.config import DSA, ModelConfig, RunOptions
from genomelm.model.dsa import DSAAttention
from genomelm.model.dsa_naive import DenseTooLongError
from genomelm.model.indexer import Selection


def tiny_config(**overrides: object) -> ModelConfig:
    """Two DSA layers (indexer full then shared), 4 heads; 16 indexer heads keep index scores free of ties."""
    fields: dict[str, object] = {
        "vocab_size": 32,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_topk": 16,
        "index_kpool": 4,
        "layer_types": [DSA, DSA],
        "mlp_layer_types": ["dense", "dense"],
        "indexer_types": ["full", "shared"],
        "intermediate_size": 32,
        "pad_token_id": None,
    }
    fields.update(overrides)
    return ModelConfig(**fields)


def reference_attention(config: ModelConfig, layer_idx: int, seed: int) -> Glm5NextTextAttention:
    """A transformers attention module (eager) with every parameter randomised."""
    hf_config = Glm5NextTextConfig(**config.text_config_dict())
    hf_config._attn_implementation = "eager"
    module = Glm5NextTextAttention(hf_config, layer_idx)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif param.ndim == 1:  # norm weights
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif "index_kpool" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return module


def ours_from(
    reference: Glm5NextTextAttention, config: ModelConfig, layer_idx: int, **options: object
) -> DSAAttention:
    module = DSAAttention(config, layer_idx, RunOptions(**options))
    module.load_state_dict(reference.state_dict(), strict=True)
    return module


def run_reference(ref: Glm5NextTextAttention, x: torch.Tensor, prev: torch.Tensor | None = None):
    mask = torch.ones(x.shape[:2], dtype=torch.bool)
    return ref(hidden_states=x, attention_mask=mask, prev_topk_indices=prev)


def token_sets(indices: torch.Tensor) -> list[list[set[int]]]:
    return [[{int(t) for t in row if t >= 0} for row in batch] for batch in indices]


def grads_of(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: (None if p.grad is None else p.grad.clone()) for name, p in module.named_parameters()}


def assert_grads_close(ours: dict, ref: dict, rel: float = 1e-3) -> None:
    assert ours.keys() == ref.keys()
    for name, expected in ref.items():
        if expected is None:
            assert ours[name] is None or not ours[name].any(), name
            continue
        err = (ours[name] - expected).norm() / expected.norm()
        assert err <= rel, f"{name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("seq_len", [12, 100, 257])
def test_matches_transformers_outputs_grads_and_selection(batch: int, seq_len: int) -> None:
    config = tiny_config(attention_bias=True)
    ref = reference_attention(config, 0, seed=seq_len)
    ours = ours_from(ref, config, 0, indexer_query_block=32, attention_query_block=24)
    torch.manual_seed(batch)
    x = torch.randn(batch, seq_len, config.hidden_size)
    weight = torch.randn(batch, seq_len, config.hidden_size)

    x_ref = x.clone().requires_grad_()
    out_ref, _, _ = run_reference(ref, x_ref)
    (out_ref * weight).sum().backward()
    x_ours = x.clone().requires_grad_()
    out, selection = ours(x_ours)
    (out * weight).sum().backward()

    assert (out - out_ref).abs().max() <= 1e-5
    assert_grads_close(grads_of(ours), grads_of(ref))
    assert (x_ours.grad - x_ref.grad).norm() / x_ref.grad.norm() <= 1e-3
    with torch.no_grad():
        q_resid = ref.q_a_layernorm(ref.q_a_proj(x))
        ref_indices = ref.indexer(x, q_resid, torch.ones(batch, seq_len, dtype=torch.bool), None)
    assert token_sets(selection.token_indices()) == token_sets(ref_indices)
    assert selection.token_indices().shape[-1] == config.index_topk + config.index_kpool - 1
    assert ours.indexer_loss is None
    assert "sparse gather (19 slots)" in ours.route


def test_blocked_indexer_equals_unblocked() -> None:
    config = tiny_config()
    ref = reference_attention(config, 0, seed=1)
    x = torch.randn(2, 203, config.hidden_size)
    blocked = ours_from(ref, config, 0, indexer_query_block=8)
    whole = ours_from(ref, config, 0, indexer_query_block=4096)
    with torch.no_grad():
        _, sel_blocked = blocked(x)
        _, sel_whole = whole(x)
    assert torch.equal(sel_blocked.pools, sel_whole.pools)
    assert (sel_blocked.pools >= 0).sum() > 0


@pytest.mark.parametrize("block", [1, 7])
def test_attention_query_blocks_agree(block: int) -> None:
    config = tiny_config()
    ref = reference_attention(config, 0, seed=2)
    x = torch.randn(2, 29, config.hidden_size)
    weight = torch.randn(2, 29, config.hidden_size)
    results = []
    for size in (block, 29):
        module = ours_from(ref, config, 0, attention_query_block=size)
        out, _ = module(x)
        (out * weight).sum().backward()
        results.append((out.detach(), grads_of(module)))
    assert (results[0][0] - results[1][0]).abs().max() <= 1e-6
    assert_grads_close(results[0][1], results[1][1], rel=1e-5)


def test_shared_layer_matches_transformers_pair() -> None:
    config = tiny_config()
    refs = [reference_attention(config, i, seed=10 + i) for i in range(2)]
    ours = [ours_from(refs[i], config, i, attention_query_block=16) for i in range(2)]
    assert ours[1].indexer is None and "indexer" not in "".join(ours[1].state_dict())
    x0, x1 = torch.randn(2, 2, 90, config.hidden_size)
    out0_ref, _, topk = run_reference(refs[0], x0)
    out1_ref, _, _ = run_reference(refs[1], x1, prev=topk)
    out0, selection = ours[0](x0)
    out1, passed = ours[1](x1, shared_selection=selection)
    assert passed is selection
    assert (out0 - out0_ref).abs().max() <= 1e-5
    assert (out1 - out1_ref).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="shares its indexer"):
        ours[1](x1)


def test_dense_backend_equals_sparse_and_is_guarded() -> None:
    config = tiny_config()
    ref = reference_attention(config, 0, seed=3)
    x = torch.randn(1, 40, config.hidden_size)
    dense = ours_from(ref, config, 0, dsa_backend="dense", forbid_dense_above=64)
    sparse = ours_from(ref, config, 0)
    assert dense.route.startswith("dsa: dense S x S reference")
    with torch.no_grad():
        assert (dense(x)[0] - sparse(x)[0]).abs().max() <= 1e-5
    with pytest.raises(DenseTooLongError, match="forbid_dense_above=64"):
        dense(torch.randn(1, 65, config.hidden_size))


def test_indexer_kl_trains_only_the_indexer() -> None:
    config = tiny_config()
    ref = reference_attention(config, 0, seed=4)
    x = torch.randn(2, 77, config.hidden_size)
    weight = torch.randn(2, 77, config.hidden_size)
    plain = ours_from(ref, config, 0, attention_query_block=16)
    trained = ours_from(ref, config, 0, attention_query_block=16, train_indexer=True, indexer_query_block=8)

    out_plain, _ = plain(x)
    (out_plain * weight).sum().backward()
    out, _ = trained(x)
    loss = trained.indexer_loss
    assert loss is not None and loss.ndim == 0 and torch.isfinite(loss) and loss > 0
    assert torch.equal(out, out_plain)

    x_leaf = x.clone().requires_grad_()
    trained.zero_grad()
    trained(x_leaf)
    trained.indexer_loss.backward()
    grads = grads_of(trained)
    assert x_leaf.grad is None
    for name, grad in grads.items():
        if name.startswith("indexer."):
            assert grad is not None and grad.abs().sum() > 0, name
        else:
            assert grad is None or not grad.any(), name

    trained.zero_grad()
    out, _ = trained(x)
    ((out * weight).sum() + trained.indexer_loss).backward()
    main = {k: v for k, v in grads_of(trained).items() if not k.startswith("indexer.")}
    assert_grads_close(
        main, {k: v for k, v in grads_of(plain).items() if not k.startswith("indexer.")}, rel=1e-6
    )


def test_indexer_kl_matches_direct_formula() -> None:
    """The blocked, checkpointed KL equals KL computed directly from dense attention probabilities."""
    config = tiny_config()
    ref = reference_attention(config, 0, seed=5)
    module = ours_from(ref, config, 0, train_indexer=True, indexer_query_block=5)
    x = torch.randn(1, 33, config.hidden_size)
    module(x)
    with torch.no_grad():
        q_resid = module.q_a_layernorm(module.q_a_proj(x))
        latent = module.kv_a_layernorm(module.kv_a_proj_with_mqa(x))
        selection = module.indexer.select(x, q_resid)
        q = module.q_b_proj(q_resid).view(1, 33, 4, 16)
        k, _ = module.kv_b_proj(latent).view(1, 33, 4, 32).split([16, 16], dim=-1)
        scores = torch.einsum("bqhd,bkhd->bqhk", q, k) * module.scaling
        idx = selection.token_indices()
        allowed = torch.zeros(1, 33, 33, dtype=torch.bool)
        for t in range(33):
            allowed[0, t, idx[0, t][idx[0, t] >= 0]] = True
        probs = scores.masked_fill(~allowed[:, :, None], float("-inf")).softmax(-1).sum(2)  # [1, S, S]
        pool_keys = module.indexer.pool_keys(x)
        qi = module.indexer.wq_b(q_resid).view(1, 33, 16, 16)
        w = module.indexer.weights_proj(x) * 16**-0.5
        per_head = torch.relu(torch.einsum("bqhd,bpd->bqhp", qi, pool_keys) * 16**-0.5)
        index_scores = torch.einsum("bqh,bqhp->bqp", w, per_head)
        total, count = 0.0, 0
        for t in range(33):
            pools = [int(p) for p in selection.pools[0, t] if p >= 0]
            if not pools:
                continue
            mass = torch.stack([probs[0, t, p * 4 : p * 4 + 4].sum() for p in pools])
            target = mass / mass.sum()
            log_q = index_scores[0, t, pools].log_softmax(-1)
            total += float((target * (target.log() - log_q)).sum())
            count += 1
    assert count > 20
    assert abs(float(module.indexer_loss.detach()) - total / count) <= 1e-5


def test_selection_token_indices_layout() -> None:
    pools = torch.tensor([[[-1, -1], [-1, -1], [-1, -1], [0, -1], [0, -1], [1, 0]]], dtype=torch.int32)
    tokens = Selection(pools=pools, kpool=3, select_tail=True).token_indices()
    assert tokens.tolist()[0] == [
        [-1] * 6 + [0, -1],
        [-1] * 6 + [0, 1],
        [-1] * 6 + [-1, -1],
        [0, 1, 2, -1, -1, -1, 3, -1],
        [0, 1, 2, -1, -1, -1, 3, 4],
        [3, 4, 5, 0, 1, 2, -1, -1],
    ]


def test_refuses_tail_off() -> None:
    with pytest.raises(ValueError, match="always_select_tail"):
        DSAAttention(tiny_config(index_kpool_always_select_tail=False), 0, RunOptions())


def test_selection_of_some_queries_equals_whole_window_rows() -> None:
    """`select` for queries at given global positions (spans, as a context-parallel rank holds them) against
    the whole window's pooled keys selects exactly the whole-window selection's rows, ties included: with two
    indexer heads many index scores are exactly 0 (both ReLUs 0), and blocks then score rows of other lengths.
    Both sides of TOPK_SORT_RATIO: 128 pools < 64 * K=4 (rows scored in full), 192 pools >= 64 * K=2."""
    for seq_len, topk in ((512, 16), (768, 8)):
        config = tiny_config(index_n_heads=2, index_topk=topk)
        module = ours_from(reference_attention(config, 0, seed=6), config, 0, indexer_query_block=24)
        x = torch.randn(2, seq_len, config.hidden_size, generator=torch.Generator().manual_seed(seq_len))
        with torch.no_grad():
            q_resid = module.q_a_layernorm(module.q_a_proj(x))
            whole = module.indexer.select(x, q_resid)
            pool_keys = module.indexer.pool_keys(x)
            segment = seq_len // 8
            spans = ((segment, segment), (6 * segment, segment))  # zigzag rank 1 of 4
            rows = torch.cat([torch.arange(start, start + length) for start, length in spans])
            part = module.indexer.select(x[:, rows], q_resid[:, rows], pool_keys, spans)
            scores = module.indexer._block_scores(x, q_resid, pool_keys, 0)
        k = topk // config.index_kpool
        best = scores[:, 4 * (k + 1) :].topk(k + 1, dim=-1).values
        assert (best[..., k - 1] == best[..., k]).sum() >= 10  # ties at the selection boundary
        assert torch.equal(part.pools, whole.pools[:, rows])
        assert torch.equal(part.token_indices(), whole.token_indices()[:, rows])
        assert torch.equal(part.positions, rows)
