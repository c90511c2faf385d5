"""The fused mHC kernels (`mhc_backend="triton"`) against the torch path, under Triton's interpreter.

Each kernel's forward and every gradient, the whole `HyperConnection` (weights, collapse, combine), a tiny
model's loss and gradients, the route strings, the refusals, and the fake / FLOP registrations the planner
uses. fp32 and fp16 streams only: bf16 loads are wrong in the interpreter (bf16 is checked by
`benchmarks/kernel_mhc.py` on a GPU). Odd token counts, widths below the tile and a non-power-of-two hc_mult
exercise the masks.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (decorated) below

import pytest  # noqa: E402
import torch  # noqa: E402
from model_helpers import random_tokens, randomise_, tiny_config  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from genomelm.model import GlmForCausalLM, RunOptions  # noqa: E402
from genomelm.model.mhc import HyperConnection, _NormedMix, hc_combine  # noqa: E402

pytest.importorskip("triton")
mhc_triton = pytest.importorskip("genomelm.model.mhc_triton")

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the kernels run on CPU tensors only under the interpreter",
)

DTYPES = [torch.float32, torch.float16]
SHAPES = [(37, 4, 64), (21, 3, 40)]  # tokens, hc_mult, hidden


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Kernel vs torch path: fp32 summation order only; fp16 outputs one rounding apart."""
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-3}


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert actual.dtype == expected.dtype, what
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance(dtype), msg=what)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "n", "hidden"), SHAPES)
def test_mix_forward_and_gradients(dtype: torch.dtype, tokens: int, n: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(0)
    m = (2 + n) * n
    x = torch.randn(tokens, n * hidden, generator=gen).to(dtype)
    fn = torch.randn(m, n * hidden, generator=gen) * 0.02
    grad = torch.randn(tokens, m, generator=gen)
    ours_x, ours_fn = leaf(x), leaf(fn)
    mixes, inv_rms = mhc_triton.mhc_mix(ours_x, ours_fn, 1e-6)
    ref_x, ref_fn = leaf(x), leaf(fn)
    reference = _NormedMix.apply(ref_x.float(), ref_fn, 1e-6)
    close(mixes, reference, torch.float32, "mixes")
    expected_inv_rms = torch.rsqrt(x.float().square().mean(-1) + 1e-6)
    close(inv_rms, expected_inv_rms, torch.float32, "inv_rms")
    mixes.backward(grad)
    reference.backward(grad)
    close(ours_x.grad, ref_x.grad, dtype, "d x")
    close(ours_fn.grad, ref_fn.grad, torch.float32, "d fn")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "n", "hidden"), SHAPES)
def test_collapse_forward_and_gradients(dtype: torch.dtype, tokens: int, n: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(1)
    streams = torch.randn(tokens, n, hidden, generator=gen).to(dtype)
    pre = torch.rand(tokens, n, generator=gen)
    grad = torch.randn(tokens, hidden, generator=gen)
    ours = [leaf(streams), leaf(pre)]
    out = mhc_triton.mhc_collapse(*ours)
    ref = [leaf(streams), leaf(pre)]
    expected = torch.matmul(ref[1][:, None, :], ref[0].float()).squeeze(1)  # the torch path's collapse
    close(out, expected, torch.float32, "block input")
    out.backward(grad)
    expected.backward(grad)
    for name, a, b in zip(("d streams", "d pre"), ours, ref, strict=True):
        close(a.grad, b.grad, dtype if name == "d streams" else torch.float32, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "n", "hidden"), SHAPES)
def test_combine_forward_and_gradients(dtype: torch.dtype, tokens: int, n: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(2)
    post = 2 * torch.rand(tokens, n, generator=gen)
    comb = torch.rand(tokens, n, n, generator=gen)
    out = torch.randn(tokens, hidden, generator=gen).to(dtype)
    residual = torch.randn(tokens, n, hidden, generator=gen).to(dtype)
    grad = torch.randn(tokens, n, hidden, generator=gen).to(dtype)
    ours = [leaf(t) for t in (post, comb, out, residual)]
    new = mhc_triton.mhc_combine(*ours)
    ref = [leaf(t) for t in (post, comb, out, residual)]
    expected = hc_combine(*ref)
    close(new, expected, dtype, "new streams")
    new.backward(grad)
    expected.backward(grad)
    for name, a, b in zip(("d post", "d comb", "d out", "d residual"), ours, ref, strict=True):
        close(a.grad, b.grad, dtype, name)


def hyper_connections(n: int = 4, hidden: int = 48) -> tuple[HyperConnection, HyperConnection]:
    """(torch path, Triton path) with the same random weights."""
    config = tiny_config(hidden_size=hidden, hc_mult=n)
    torch_hc = HyperConnection(config, RunOptions(mhc_backend="torch"))
    randomise_(torch_hc, seed=3)
    triton_hc = HyperConnection(config, RunOptions(mhc_backend="triton"))
    triton_hc.load_state_dict(torch_hc.state_dict())
    return torch_hc, triton_hc


def hc_round_trip(hc: HyperConnection, streams: torch.Tensor, autocast: bool = False) -> torch.Tensor:
    """Collapse, a stand-in block (a fixed nonlinearity), combine: a decoder layer's work around one block."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        post, comb, x = hc(streams)
        block_output = torch.tanh(x).to(streams.dtype)
        new = hc.combine(post, comb, block_output, streams)
    return torch.cat([post.flatten(), comb.flatten(), x.flatten(), new.float().flatten()])


@pytest.mark.parametrize("dtype", DTYPES)
def test_hyper_connection_matches_the_torch_path(dtype: torch.dtype) -> None:
    torch_hc, triton_hc = hyper_connections()
    gen = torch.Generator().manual_seed(4)
    streams = torch.randn(2, 19, 4, 48, generator=gen).to(dtype)
    ours, ref = leaf(streams), leaf(streams)
    out, expected = hc_round_trip(triton_hc, ours), hc_round_trip(torch_hc, ref)
    close(out, expected, dtype, "post, comb, block input, new streams")
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    expected.backward(grad)
    close(ours.grad, ref.grad, dtype, "d streams")
    for (name, a), b in zip(triton_hc.named_parameters(), torch_hc.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4, msg=name)
    assert triton_hc.route == f"mhc: triton fused ({'fp32' if dtype == torch.float32 else 'fp16'} streams)"
    assert torch_hc.route == "mhc: torch (fp32 copies)"


def test_fp32_arithmetic_holds_under_autocast() -> None:
    """bf16 autocast does not reach the kernels' fp32 math: the same numbers with it on or off."""
    _, triton_hc = hyper_connections()
    streams = torch.randn(1, 23, 4, 48, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(
            hc_round_trip(triton_hc, streams, autocast=True),
            hc_round_trip(triton_hc, streams),
            rtol=0,
            atol=0,
        )


def test_tiny_model_loss_and_gradients_match() -> None:
    """Two layers of `tiny` (KDA + dense, DSA + MoE), loss and every parameter's gradient."""
    config = tiny_config(
        num_hidden_layers=2,
        layer_types=["linear_attention", "indexed_attention"],
        mlp_layer_types=["dense", "sparse"],
        indexer_types=["full", "full"],
    )
    models = {}
    for backend in ("torch", "triton"):
        model = GlmForCausalLM(config, RunOptions(mhc_backend=backend))
        randomise_(model, seed=6)
        models[backend] = model
    ids = random_tokens(2, 24, config.vocab_size, seed=7)
    losses = {}
    for backend, model in models.items():
        losses[backend] = model(ids, ids)
        losses[backend].backward()
    torch.testing.assert_close(losses["triton"], losses["torch"], rtol=1e-5, atol=1e-6)
    grads = {name: p.grad for name, p in models["torch"].named_parameters() if p.grad is not None}
    assert len(grads) > 40
    for name, p in models["triton"].named_parameters():
        if name in grads:
            # fp32 rounding grows through the layers' random weights: in 4 layers the torch path is itself
            # ~7e-5 (of each gradient's largest entry) from an fp64 run, the kernels ~1.3e-4
            error = (p.grad - grads[name]).abs().max() / grads[name].abs().max()
            assert error < 5e-4, (name, error.item())
    for layer in models["triton"].layers:
        assert layer.route.endswith(" | mhc: triton fused (fp32 streams)"), layer.route
    for layer in models["torch"].layers:
        assert layer.route.endswith(" | mhc: torch (fp32 copies)"), layer.route


def test_routes_before_the_first_forward_and_auto_on_the_cpu() -> None:
    model = GlmForCausalLM(tiny_config(), RunOptions(mhc_backend="triton"))
    assert model.layers[0].route.endswith(" | mhc: triton (resolved at the first forward)")
    auto = HyperConnection(tiny_config(), RunOptions())
    auto.resolve_backend(torch.zeros(1, 1, 4, 32))
    assert auto.backend == "torch" and auto.route == "mhc: torch (fp32 copies)"


def test_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config()
    with pytest.raises(ValueError, match=r"mhc_backend must be 'auto' or one of \('triton', 'torch'\)"):
        HyperConnection(config, RunOptions(mhc_backend="fused")).resolve_backend(torch.zeros(1, 1, 4, 32))
    _, triton_hc = hyper_connections()
    with pytest.raises(
        ValueError, match=r"fp32/fp16/bf16 streams, got torch.float64 of shape \(1, 5, 4, 48\)"
    ):
        triton_hc.double()(torch.zeros(1, 5, 4, 48, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"at most 8 streams, got hc_mult=9 \(streams \(1, 5, 9, 8\)\)"):
        mhc_triton.combine(
            torch.zeros(1, 5, 9), torch.zeros(1, 5, 9, 9), torch.zeros(1, 5, 8), torch.zeros(1, 5, 9, 8)
        )
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="mhc_backend=triton runs on CUDA tensors"):
        HyperConnection(config, RunOptions(mhc_backend="triton")).resolve_backend(torch.zeros(1, 1, 4, 32))


def test_fake_tensors_and_flop_formulas() -> None:
    """The planner's view: the ops trace on fake tensors (no kernel runs) and FlopCounterMode counts each by
    its formula, forward and backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    n, hidden, tokens = 4, 4096, 1 << 16
    config = tiny_config(hidden_size=hidden, hc_mult=n)
    with FakeTensorMode():
        hc = HyperConnection(config, RunOptions(mhc_backend="triton"))
        streams = torch.empty(1, tokens, n, hidden, dtype=torch.bfloat16, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            post, comb, x = hc(streams)
            new = hc.combine(post, comb, x.bfloat16(), streams)
            new.sum().backward()
        assert new.shape == streams.shape and new.dtype == torch.bfloat16
        assert x.shape == (1, tokens, hidden) and x.dtype == torch.float32
        assert streams.grad.dtype == torch.bfloat16 and hc.fn.grad.shape == hc.fn.shape
    counts = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    width, m = n * hidden, (2 + n) * n
    assert counts["genomelm.mhc_mix"] == 2 * tokens * width * (m + 1)
    assert counts["genomelm.mhc_mix_backward"] == 4 * tokens * width * m + 2 * tokens * width
    assert counts["genomelm.mhc_collapse"] == 2 * tokens * width
    assert (
        counts["genomelm.mhc_combine_backward"]
        == 2 * counts["genomelm.mhc_combine"]
        == 4 * tokens * width * 5
    )
    forward, backward = mhc_triton.combine_traffic(tokens, n, hidden, 2, 2)
    assert forward == 2 * tokens * width * 2 + tokens * hidden * 2 and backward > forward


def test_no_fp32_copy_of_the_streams() -> None:
    """The planner's memory view (fake tensors, MemTracker): the Triton path's forward allocates its outputs
    only, and keeps no copy of the streams for the backward; the torch path holds fp32 copies."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    tokens, n, hidden = 4096, 4, 256
    config = tiny_config(hidden_size=hidden, hc_mult=n)
    streams_bytes = tokens * n * hidden * 2  # bf16
    measured = {}
    for backend in ("torch", "triton"):
        with FakeTensorMode():
            hc = HyperConnection(config, RunOptions(mhc_backend=backend))
            streams = torch.empty(1, tokens, n, hidden, dtype=torch.bfloat16, requires_grad=True)
            tracker = MemTracker()
            with tracker:
                post, comb, x = hc(streams)
                new = hc.combine(post, comb, x.bfloat16(), streams)
                peak = tracker.get_tracker_snapshot("peak")[new.device]["Total"]
                live = tracker.get_tracker_snapshot()[new.device]["Total"]
        # the tracker counts the streams' storage when it first sees it (a view of it enters the mix)
        measured[backend] = (peak - streams_bytes) / streams_bytes, (live - streams_bytes) / streams_bytes
    # outputs: block input fp32 (1/2 of the streams' bytes), its bf16 cast (1/4), new streams (1): 1.75, plus
    # the per-token weights' small [T, (2+N)*N]-sized tensors (0.19 at this width, 16x less at D = 4096)
    triton_peak, triton_live = measured["triton"]
    assert 1.75 <= triton_live <= triton_peak < 2, measured
    torch_peak, torch_live = measured["torch"]
    assert torch_peak > 10 and torch_live > 5, measured  # fp32 copies: 2x the streams' bytes each


@pytest.mark.parametrize(("n", "tokens", "iters"), [(4, 150, 20), (3, 37, 2), (4, 5, 1)])
def test_sinkhorn_kernel_matches_the_torch_path(n: int, tokens: int, iters: int) -> None:
    """`sinkhorn_triton.sinkhorn` against `mhc._Sinkhorn` (fp32): the normalised matrices and d m, over whole
    and partial token tiles, a non-power-of-two N (padded) and a single step."""
    from genomelm.model import sinkhorn_triton
    from genomelm.model.mhc import _Sinkhorn

    gen = torch.Generator().manual_seed(5)
    m = torch.softmax(3 * torch.randn(n, n, tokens, generator=gen), dim=1) + 1e-6
    grad = torch.randn(n, n, tokens, generator=gen)
    ours, ref = leaf(m), leaf(m)
    out = sinkhorn_triton.sinkhorn(ours, iters, 1e-6)
    expected = _Sinkhorn.apply(ref, iters, 1e-6)
    close(out, expected, torch.float32, "normalised")
    out.backward(grad)
    expected.backward(grad)
    close(ours.grad, ref.grad, torch.float32, "d m")
    torch.testing.assert_close(out.sum(0), torch.ones(n, tokens), atol=1e-4, rtol=0)  # columns last


def test_sinkhorn_traces_as_one_kernel_each_way() -> None:
    """On fake tensors (the planner's trace) the Triton path's Sinkhorn is one op forward and one backward,
    where the torch path dispatches three per step and more in its backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from genomelm.model import sinkhorn_triton
    from genomelm.model.mhc import _Sinkhorn

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    counts = {}
    with FakeTensorMode():
        for name, fold in (("triton", sinkhorn_triton.sinkhorn), ("torch", _Sinkhorn.apply)):
            m = torch.empty(4, 4, 1 << 16, requires_grad=True)
            with Ops() as ops:
                fold(m, 20, 1e-6).sum().backward()
            assert m.grad.shape == m.shape
            counts[name] = ops.names
    kernels = [name for name in counts["triton"] if "sinkhorn" in name]
    assert kernels == ["genomelm.mhc_sinkhorn", "genomelm.mhc_sinkhorn_backward"]
    assert len(counts["torch"]) > 10 * len(counts["triton"])
