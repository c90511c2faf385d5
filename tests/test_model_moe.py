"""MoE: grouped = loop reference, chunked = unchunked, routing properties, dense MLP clamping."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_helpers import randomise_, tiny_config

from genomelm.model import RunOptions
from genomelm.model.mlp import clamped_swiglu
from genomelm.model.moe import MoE


def _moe(backend: str, chunk: int, **changes: object) -> MoE:
    config = dataclasses.replace(tiny_config(), **changes)
    moe = MoE(config, RunOptions(moe_backend=backend, moe_chunk_tokens=chunk))
    randomise_(moe, seed=2)
    return moe


def _run(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = moe(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = {n: p.grad for n, p in moe.named_parameters()}
    return out.detach(), grads, x.grad


@pytest.mark.parametrize("changes", [{}, {"n_group": 1, "topk_group": 1}, {"n_group": 4, "topk_group": 2}])
def test_grouped_equals_loop_and_chunked_equals_unchunked(changes: dict) -> None:
    # seeded: fp32 sums over other chunkings differ by up to ~1e-5, so inputs the test order leaves may flake
    x = torch.randn(2, 37, tiny_config().hidden_size, generator=torch.Generator().manual_seed(0))
    reference = _run(_moe("loop", 10_000, **changes), x)
    for backend, chunk in [("grouped", 10_000), ("grouped", 7), ("loop", 5)]:
        got = _run(_moe(backend, chunk, **changes), x)
        torch.testing.assert_close(got[0], reference[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[2], reference[2], atol=1e-5, rtol=1e-5)
        for name, grad in reference[1].items():
            torch.testing.assert_close(got[1][name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_tokens_per_expert_and_group_limit() -> None:
    moe = _moe("grouped", 16)
    x = torch.randn(3, 20, tiny_config().hidden_size)
    with torch.no_grad():
        moe(x)
        ids, weights = moe.gate(x.flatten(0, 1))
    config = tiny_config()
    assert moe.tokens_per_expert.sum() == 60 * config.num_experts_per_tok
    assert torch.equal(
        moe.tokens_per_expert, torch.bincount(ids.flatten(), minlength=config.n_routed_experts)
    )
    group_size = config.n_routed_experts // config.n_group
    assert all(len(set((row // group_size).tolist())) <= config.topk_group for row in ids)
    torch.testing.assert_close(weights.sum(-1), torch.full((60,), config.routed_scaling_factor))


def test_correction_bias_steers_choice_not_weights() -> None:
    moe = _moe("grouped", 64, n_group=1, topk_group=1)
    x = torch.randn(50, tiny_config().hidden_size)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.zero_()
        moe.gate.e_score_correction_bias[3] = 10.0
        ids, weights = moe.gate(x)
        scores = torch.sigmoid(x @ moe.gate.weight.T)
    assert (ids == 3).any(-1).all()
    expected = scores.gather(1, ids)
    torch.testing.assert_close(
        weights, expected / expected.sum(-1, keepdim=True) * moe.gate.routed_scaling_factor
    )


def test_clamped_swiglu() -> None:
    gate = torch.tensor([-20.0, 0.0, 30.0])
    up = torch.tensor([-30.0, 2.0, 30.0])
    expected = torch.nn.functional.silu(torch.tensor([-20.0, 0.0, 10.0])) * torch.tensor([-10.0, 2.0, 10.0])
    torch.testing.assert_close(clamped_swiglu(gate, up, 10.0), expected)


def test_unknown_backend_refused() -> None:
    with pytest.raises(ValueError, match="moe_backend"):
        MoE(tiny_config(), RunOptions(moe_backend="scatter"))


def test_dense_mlp_chunked_equals_unchunked() -> None:
    from genomelm.model.mlp import MLP

    config = tiny_config()
    whole, chunked = MLP(config), MLP(config, chunk_tokens=7)
    randomise_(whole, seed=3)
    chunked.load_state_dict(whole.state_dict())
    assert "chunks of 7 tokens" in chunked.route
    x = torch.randn(2, 37, config.hidden_size)
    got = [_run(m, x) for m in (whole, chunked)]
    torch.testing.assert_close(got[1][0], got[0][0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1][2], got[0][2], atol=1e-6, rtol=1e-6)
    for name, grad in got[0][1].items():
        # weight gradients sum over tokens chunk by chunk: same numbers up to summation order
        torch.testing.assert_close(got[1][1][name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_grouped_fallback_without_grouped_gemm_equals_loop() -> None:
    """In fp64 (no grouped GEMM) the grouped backend slices one `unbind` of the weights: same numbers as the
    loop."""
    x = torch.randn(
        2, 37, tiny_config().hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(5)
    )
    reference = _run(_moe("loop", 10_000).double(), x)
    got = _run(_moe("grouped", 9).double(), x)
    # the router runs in fp32 whatever the model's dtype: its weights differ in the last fp32 bits between a
    # 9-token chunk and the whole sequence (other matmul kernels), so fp32-level tolerances (gradients are
    # ~10)
    torch.testing.assert_close(got[0], reference[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[2], reference[2], rtol=1e-6, atol=1e-6)
    for name, grad in reference[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-5, atol=2e-5, msg=name)


@pytest.mark.parametrize("backend", ["grouped", "loop"])
def test_the_shared_expert_run_beside_the_experts_gives_the_same_layer(backend: str) -> None:
    """Where the experts run the shared expert beside them (`Experts.runs_beside`, set by expert parallelism
    to overlap its exchanges), the MoE's output and every gradient are the same bit for bit."""
    x = torch.randn(2, 37, tiny_config().hidden_size, generator=torch.Generator().manual_seed(0))
    after = _run(_moe(backend, 16), x)
    beside = _moe(backend, 16)
    beside.experts.runs_beside = True
    got = _run(beside, x)
    assert torch.equal(got[0], after[0]) and torch.equal(got[2], after[2])
    for name, grad in after[1].items():
        assert torch.equal(got[1][name], grad), name
