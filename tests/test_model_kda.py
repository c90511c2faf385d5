"""KDA: chunked delta rule vs the token-by-token reference, state hand-over, backend selection."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from model_helpers import randomise_, tiny_config

from genomelm.model import RunOptions, kda_chunk
from genomelm.model import kda as kda_module
from genomelm.model.kda import KDAttention
from genomelm.model.kda_chunk import chunk_kda_torch, select_kda_backend
from genomelm.model.kda_naive import recurrent_kda


def _inputs(batch: int, seq_len: int, heads: int, dim: int, bound: float | None, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq_len, heads, dim, generator=gen) for _ in range(3))
    if bound is None:  # unbounded gate: some tokens decay by up to e^-30 per channel
        g = -(torch.rand(batch, seq_len, heads, dim, generator=gen) ** 4) * 30
    else:
        g = -bound * torch.rand(batch, seq_len, heads, dim, generator=gen)
    beta = torch.rand(batch, seq_len, heads, generator=gen)
    state = torch.randn(batch, heads, dim, dim, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("bound", [5.0, None])
@pytest.mark.parametrize("seq_len,chunk", [(1, 64), (63, 16), (150, 64), (200, 32)])
def test_chunked_matches_recurrent(bound: float | None, seq_len: int, chunk: int) -> None:
    q, k, v, g, beta, state = _inputs(2, seq_len, 3, 16, bound, seed=seq_len)
    expected, expected_state = recurrent_kda(q, k, v, g, beta, state)
    got, got_state = chunk_kda_torch(q, k, v, g, beta, state, chunk_size=chunk, gate_bound=bound)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_state, expected_state, atol=2e-5, rtol=1e-4)


def test_chunked_gradients_match_recurrent() -> None:
    inputs = [t.double().requires_grad_(True) for t in _inputs(1, 80, 2, 8, 5.0, seed=3)]
    weights = torch.randn(1, 80, 2, 8, dtype=torch.float64)
    out, state = recurrent_kda(*inputs)
    expected = torch.autograd.grad((out * weights).sum() + state.sum(), inputs)
    out, state = chunk_kda_torch(*inputs, chunk_size=32, gate_bound=5.0)
    got = torch.autograd.grad((out * weights).sum() + state.sum(), inputs)
    for e, g in zip(expected, got):  # fp64 inputs run in fp64
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10)


def test_chunked_runs_in_fp64_for_fp64_inputs() -> None:
    q, k, v, g, beta, state = (t.double() for t in _inputs(2, 150, 3, 16, 5.0, seed=8))
    expected, expected_state = recurrent_kda(q, k, v, g, beta, state)
    got, got_state = chunk_kda_torch(q, k, v, g, beta, state, chunk_size=32, gate_bound=5.0)
    assert got.dtype == got_state.dtype == expected_state.dtype == torch.float64
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got_state, expected_state, atol=1e-12, rtol=1e-12)


def test_core_from_the_summary_transforms_equals_the_plain_core() -> None:
    """The layer's steps as the parallel code calls them: `summarise` builds the chunk transforms once, `core`
    reuses them, and the result equals `forward` (whose core builds its own)."""
    layer = _layer("torch")
    x = torch.randn(2, 70, tiny_config().hidden_size)
    state = layer.initial_state(2, x.dtype, x.device)
    with torch.no_grad():
        expected, expected_state = layer(x, state)
        q, k, v = layer.convolve(layer.project(x), state.conv_tail.transpose(1, 2), x.dtype)
        g, beta = layer.gates(x)
        summary, transforms = layer.summarise(q, k, v, g, beta)
        core, final = layer.core(q, k, v, g, beta, state.recurrent, transforms)
        got = layer.output(x, core)
    assert summary.shape == (2, layer.num_heads, layer.head_dim, 2 * layer.head_dim)
    torch.testing.assert_close(got, expected, atol=0.0, rtol=0.0)
    torch.testing.assert_close(final, expected_state.recurrent, atol=0.0, rtol=0.0)
    torch.testing.assert_close(summary[..., layer.head_dim :], final)  # zero start: S_ext is the final state


def _layer(backend: str) -> KDAttention:
    config = tiny_config()
    layer = KDAttention(config, 0, RunOptions(kda_backend=backend, kda_chunk_size=16))
    randomise_(layer, seed=11)
    return layer


@pytest.mark.parametrize("backend", ["torch", "recurrent"])
def test_two_halves_with_state_equal_whole(backend: str) -> None:
    layer = _layer(backend)
    x = torch.randn(2, 70, tiny_config().hidden_size)
    with torch.no_grad():
        whole, whole_state = layer(x)
        first, state = layer(x[:, :37])
        second, end_state = layer(x[:, 37:], state)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end_state.recurrent, whole_state.recurrent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end_state.conv_tail, whole_state.conv_tail)
    assert end_state.conv_tail.shape == (2, 3 * layer.num_heads * layer.head_dim, layer.kernel - 1)


def test_pieces_shorter_than_conv_width() -> None:
    layer = _layer("torch")
    x = torch.randn(1, 9, tiny_config().hidden_size)
    with torch.no_grad():
        whole, _ = layer(x)
        state, pieces = None, []
        for piece in x.split(2, dim=1):
            out, state = layer(piece, state)
            pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=1e-5)


def test_layer_backends_agree() -> None:
    x = torch.randn(1, 40, tiny_config().hidden_size)
    with torch.no_grad():
        chunked, _ = _layer("torch")(x)
        recurrent, _ = _layer("recurrent")(x)
    torch.testing.assert_close(chunked, recurrent, atol=1e-5, rtol=1e-5)


def test_backend_selection() -> None:
    assert select_kda_backend("auto", "cuda", fla_available=True) == "fla"
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[gpu\]'.*kda_backend=torch"):
        select_kda_backend("auto", "cuda", fla_available=False)
    assert select_kda_backend("auto", "cpu", fla_available=True) == "torch"
    assert select_kda_backend("recurrent", "cuda", fla_available=True) == "recurrent"
    assert select_kda_backend("fla", "cuda", fla_available=True) == "fla"
    with pytest.raises(RuntimeError, match="fla-core"):
        select_kda_backend("fla", "cpu", fla_available=True)
    with pytest.raises(RuntimeError, match="not installed"):
        select_kda_backend("fla", "cuda", fla_available=False)
    with pytest.raises(ValueError, match="kda_backend"):
        select_kda_backend("triton", "cpu", fla_available=False)


def test_layer_resolves_backend_once_and_reports_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_fla():
        calls.append(1)
        return lambda *a, **k: (_ for _ in ()).throw(AssertionError("fla must not run on CPU"))

    monkeypatch.setattr(kda_module, "fla_chunk_kda", fake_fla)
    layer = _layer("auto")
    x = torch.randn(1, 5, tiny_config().hidden_size)
    with torch.no_grad():
        layer(x)
        layer(x)
    assert layer.backend == "torch" and layer.route == "kda: torch chunked (chunk 16)"
    assert len(calls) == 1


def test_fla_import_is_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the fla package the loader answers None (so "auto" picks torch) instead of raising."""
    monkeypatch.setitem(sys.modules, "fla", None)  # makes `import fla...` raise ImportError
    monkeypatch.setitem(sys.modules, "fla.ops", None)
    monkeypatch.setitem(sys.modules, "fla.ops.kda", None)
    kda_chunk.fla_chunk_kda.cache_clear()
    try:
        assert kda_chunk.fla_chunk_kda() is None
    finally:
        kda_chunk.fla_chunk_kda.cache_clear()


def test_unbounded_gate_layer_matches_recurrent() -> None:
    config = dataclasses.replace(tiny_config(), linear_lower_bound=None)
    layers = [
        KDAttention(config, 0, RunOptions(kda_backend=b, kda_chunk_size=16)) for b in ("torch", "recurrent")
    ]
    for layer in layers:
        randomise_(layer, seed=4)
    x = torch.randn(1, 50, config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(layers[0](x)[0], layers[1](x)[0], atol=1e-5, rtol=1e-5)
