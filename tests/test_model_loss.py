"""Chunked cross-entropy equals plain F.cross_entropy (values and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from genomelm.model.loss import chunked_cross_entropy, token_nll


def _case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 23, 16, generator=gen, dtype=torch.float64).requires_grad_(True)
    weight = torch.randn(11, 16, generator=gen, dtype=torch.float64).requires_grad_(True)
    labels = torch.randint(0, 11, (2, 23), generator=gen)
    labels[0, :4] = -100
    labels[1, -1] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [1, 5, 46, 1000])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_plain_cross_entropy(chunk: int, reduction: str) -> None:
    hidden, weight, labels = _case()
    probe = torch.rand(2, 23, dtype=torch.float64)
    expected = F.cross_entropy(
        (hidden @ weight.T).transpose(1, 2), labels, reduction=reduction, ignore_index=-100
    )
    got = chunked_cross_entropy(hidden, weight, labels, chunk, reduction)
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-6)
    objective = (lambda t: (t * probe).sum()) if reduction == "none" else (lambda t: t)
    grads_expected = torch.autograd.grad(objective(expected), (hidden, weight))
    grads_got = torch.autograd.grad(objective(got), (hidden, weight))
    for e, g in zip(grads_expected, grads_got):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-6)


def test_token_nll_is_negative_logprob_and_zero_at_ignored() -> None:
    hidden, weight, labels = _case(1)
    with torch.no_grad():
        nll = token_nll(hidden, weight, labels, chunk_tokens=7)
        logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    torch.testing.assert_close(nll.double(), torch.where(labels == -100, 0.0, -logp), atol=1e-6, rtol=1e-6)


def test_all_ignored_mean_is_zero() -> None:
    hidden, weight, _ = _case(2)
    labels = torch.full((2, 23), -100)
    assert chunked_cross_entropy(hidden, weight, labels, 8).item() == 0.0


def test_bad_arguments() -> None:
    hidden, weight, labels = _case()
    with pytest.raises(ValueError, match="reduction"):
        chunked_cross_entropy(hidden, weight, labels, 8, "max")
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        chunked_cross_entropy(hidden, weight, labels, 0)
