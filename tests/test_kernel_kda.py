"""KDA on fla, everything a CPU can check: the gate formula fla's kernel applies equals `ForgetGate`, what the
layer hands fla (dtypes, gate, conv state; through recording stand-ins that compute fla's contract in torch),
the packed-value summary against the torch summary, the context-parallel path on the fla route, and the
simulated cp=2 step through the simulation's stand-ins. fla's kernels themselves run on a GPU only
(`benchmarks/kernel_kda.py`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from model_helpers import randomise_, tiny_config
from torch import Tensor

from genomelm.model import RunOptions, kda_chunk
from genomelm.model import kda as kda_module
from genomelm.model.kda import KDAttention
from genomelm.model.kda_chunk import (
    FlaGate,
    chunk_kda_torch,
    fla_gate_reference,
    fla_kda,
    fla_segment_summary,
    kda_chunk_transforms,
    kda_segment_summary,
)
from genomelm.model.kda_naive import reference_segment_summary

CHUNK = 16
SIMULATED_ROUTE = (
    "kda: fla chunk_kda (cuda, bf16 q/k/v, gate in kernel; conv: fla causal_conv1d), cp summaries on fla "
    "chunk_kda ([0 | v] from [I | 0]) + context parallel (zigzag, cp 2)"
)


class RecordingFla:
    """fla's `chunk_kda` and `causal_conv1d` as their contracts state them, computed in torch on the CPU, with
    every call's arguments recorded."""

    def __init__(self) -> None:
        self.kda_calls: list[dict[str, Any]] = []
        self.conv_calls: list[dict[str, Any]] = []

    def chunk_kda(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        initial_state: Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        use_gate_in_kernel: bool = False,
        safe_gate: bool = False,
        lower_bound: float | None = None,
        A_log: Tensor | None = None,
        dt_bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        self.kda_calls.append(
            dict(
                dtypes={name: t.dtype for name, t in dict(q=q, k=k, v=v, g=g, beta=beta).items()},
                state_dtype=None if initial_state is None else initial_state.dtype,
                v_width=v.shape[-1],
                initial_state=initial_state,
                g=g,
                autocast=torch.is_autocast_enabled("cpu"),
                options=dict(
                    output_final_state=output_final_state,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    use_gate_in_kernel=use_gate_in_kernel,
                    safe_gate=safe_gate,
                    lower_bound=lower_bound,
                ),
                A_log=A_log,
                dt_bias=dt_bias,
            )
        )
        assert use_qk_l2norm_in_kernel and output_final_state
        if use_gate_in_kernel:
            assert A_log is not None and dt_bias is not None and lower_bound is not None
            g = fla_gate_reference(g, FlaGate(A_log, dt_bias, lower_bound))
        out, state = chunk_kda_torch(
            q.float(), k.float(), v.float(), g.float(), beta.float(), initial_state, CHUNK, 5.0
        )
        return out.to(q.dtype), state  # fla: o.type_as(q), the state in fp32

    def causal_conv1d(
        self,
        x: Tensor,
        weight: Tensor,
        initial_state: Tensor,
        activation: str | None = None,
        backend: str = "triton",
    ) -> tuple[Tensor, None]:
        """fla's forward kernel read as written: y[t] = sum over i_w in [-W+1, 0] of weight[:, i_w + W - 1]
        times x[t + i_w], or initial_state[:, :, t + i_w + W] where t + i_w < 0; then SiLU; out in x's
        dtype."""
        self.conv_calls.append(dict(x_dtype=x.dtype, weight_dtype=weight.dtype, activation=activation))
        assert activation == "silu" and initial_state.shape == (x.shape[0], x.shape[2], weight.shape[1])
        steps, width = x.shape[1], weight.shape[1]
        y = torch.zeros(x.shape, dtype=torch.float32)
        for i_w in range(-width + 1, 1):
            # the -i_w rows with t + i_w < 0
            before = initial_state[:, :, width + i_w : width].transpose(1, 2)
            shifted = torch.cat([before, x[:, : max(steps + i_w, 0)]], dim=1)[:, :steps]
            y = y + shifted.float() * weight[:, i_w + width - 1].float()
        return F.silu(y).to(x.dtype), None


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)  # the inputs drawn with torch.randn below


def _assert_near(got: Tensor, expected: Tensor, name: str, tolerance: float = 1e-4) -> None:
    """Largest difference within `tolerance` of the largest entry: fp32 rounding, summed in another order."""
    error = ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
    assert error < tolerance, f"{name}: {error:.2e}"


@pytest.fixture
def fla(monkeypatch: pytest.MonkeyPatch) -> RecordingFla:
    """The recording stand-ins installed as fla, and KDA's backend choice answering "fla" as on CUDA."""
    recorder = RecordingFla()
    for module in (kda_module, kda_chunk):
        monkeypatch.setattr(module, "fla_chunk_kda", lambda: recorder.chunk_kda)
        monkeypatch.setattr(module, "fla_causal_conv1d", lambda: recorder.causal_conv1d)
    select = kda_module.select_kda_backend

    def as_on_cuda(requested: str, device_type: str, available: bool) -> str:
        return "fla" if requested == "fla" else select(requested, "cpu", False)

    monkeypatch.setattr(kda_module, "select_kda_backend", as_on_cuda)
    return recorder


def _layers(gate_in_kernel: bool = False) -> tuple[KDAttention, KDAttention]:
    """A layer on the fla route and the same weights on the torch route."""
    config = tiny_config()
    fla_layer = KDAttention(
        config, 0, RunOptions(kda_backend="fla", kda_chunk_size=CHUNK, kda_gate_in_kernel=gate_in_kernel)
    )
    randomise_(fla_layer, seed=3)
    torch_layer = KDAttention(config, 0, RunOptions(kda_backend="torch", kda_chunk_size=CHUNK))
    torch_layer.load_state_dict(fla_layer.state_dict())
    return fla_layer, torch_layer


def _state(layer: KDAttention, batch: int, seed: int) -> kda_module.KDAState:
    gen = torch.Generator().manual_seed(seed)
    zero = layer.initial_state(batch, torch.float32, torch.device("cpu"))
    return kda_module.KDAState(
        0.3 * torch.randn(zero.recurrent.shape, generator=gen),
        torch.randn(zero.conv_tail.shape, generator=gen),
    )


def _grads(layer: KDAttention, x: Tensor, state: kda_module.KDAState, weights: Tensor) -> dict[str, Tensor]:
    layer.zero_grad()
    y, final = layer(x, state)
    ((y * weights).sum() + final.recurrent.square().sum()).backward()
    return {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fla_gate_formula_equals_forget_gate(dtype: torch.dtype) -> None:
    """fla's in-kernel gate (its formula as fla's source states it) is our ForgetGate, to rounding."""
    layer, _ = _layers()
    gate = layer.forget_gate.to(dtype)
    x = torch.randn(2, 33, tiny_config().hidden_size, dtype=dtype)
    with torch.no_grad():
        ours = gate(x)
        raw = gate.raw(x)
        theirs = fla_gate_reference(raw, gate.fla_gate())
        # the tempting misreading, bias outside the rate, is a different gate on these parameters
        heads = raw.shape[-2]
        misread = gate.lower_bound * torch.sigmoid(
            gate.A_log.view(heads, 1).exp() * raw + gate.dt_bias.view(heads, -1)
        )
    torch.testing.assert_close(theirs.to(dtype), ours, atol=1e-6, rtol=1e-6)
    assert (misread - ours).abs().max() > 1e-2
    assert ours.min() > gate.lower_bound and ours.max() < 0


def test_in_kernel_gate_needs_a_safe_lower_bound() -> None:
    config = tiny_config(linear_lower_bound=None)
    with pytest.raises(ValueError, match="lower bound in \\[-5, 0\\)"):
        KDAttention(config, 0, RunOptions(kda_gate_in_kernel=True))
    with pytest.raises(ValueError, match="lower bound only"):
        KDAttention(config, 0, RunOptions()).forget_gate.fla_gate()
    q = torch.randn(1, 16, 2, 8)
    gate = FlaGate(torch.zeros(2), torch.zeros(16), -6.0)
    with pytest.raises(ValueError, match="in \\[-5, 0\\)"):
        fla_kda(q, q, q, q, q[..., 0], None, 5.0, gate)
    with pytest.raises(ValueError, match="fla backend only"):
        kda_chunk.kda_core("torch", q, q, q, q, q[..., 0], None, 16, 5.0, None, gate)


def test_chunk_kda_is_fed_the_compute_dtype_under_autocast(fla: RecordingFla) -> None:
    """Under bf16 autocast fla gets bf16 q/k/v/beta, the log decay in fp32 and the state in fp32, with its
    safe gate at GLM's bound; the conv goes to fla's causal_conv1d; the layer's output keeps x's dtype and
    matches the torch route within bf16 rounding."""
    fla_layer, torch_layer = _layers()
    x = torch.randn(2, 40, tiny_config().hidden_size)
    state = _state(fla_layer, 2, seed=4)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, got_state = fla_layer(x, state)
        expected, expected_state = torch_layer(x, state)
    (call,) = fla.kda_calls
    assert call["dtypes"] == dict(
        q=torch.bfloat16, k=torch.bfloat16, v=torch.bfloat16, g=torch.float32, beta=torch.bfloat16
    )
    assert call["state_dtype"] == torch.float32 and not call["autocast"]
    assert call["options"] == dict(
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=False,
        safe_gate=True,
        lower_bound=-5.0,
    )
    assert fla.conv_calls == [dict(x_dtype=torch.bfloat16, weight_dtype=torch.float32, activation="silu")]
    assert got.dtype == expected.dtype and got_state.recurrent.dtype == torch.float32
    assert fla_layer.route == "kda: fla chunk_kda (cuda, bf16 q/k/v; conv: fla causal_conv1d)"
    for ours, reference in ((got, expected), (got_state.recurrent, expected_state.recurrent)):
        assert (ours - reference).abs().max() < 3e-2 * reference.abs().max()


def test_fla_route_equals_torch_route_forward_and_gradients(fla: RecordingFla) -> None:
    """In fp32 the fla route (conv state from the halo, core from the incoming state) is the torch route:
    output, final state, conv tail and every parameter's gradient."""
    fla_layer, torch_layer = _layers()
    x = torch.randn(2, 37, tiny_config().hidden_size)
    state = _state(fla_layer, 2, seed=5)
    weights = torch.randn(x.shape)
    with torch.no_grad():
        got, got_state = fla_layer(x, state)
        expected, expected_state = torch_layer(x, state)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state.recurrent, expected_state.recurrent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state.conv_tail, expected_state.conv_tail)
    grads, expected_grads = _grads(fla_layer, x, state, weights), _grads(torch_layer, x, state, weights)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        _assert_near(grad, expected_grads[name], name)


def test_gate_in_kernel_hands_fla_the_raw_gate_and_the_parameters(fla: RecordingFla) -> None:
    """With kda_gate_in_kernel fla gets f (not g), A_log and dt_bias themselves and GLM's bound; the result
    and the gradients of A_log, dt_bias and the gate projections equal the torch route's."""
    fla_layer, torch_layer = _layers(gate_in_kernel=True)
    x = torch.randn(1, 35, tiny_config().hidden_size)
    state = _state(fla_layer, 1, seed=6)
    weights = torch.randn(x.shape)
    grads, expected_grads = _grads(fla_layer, x, state, weights), _grads(torch_layer, x, state, weights)
    (call,) = fla.kda_calls
    assert call["options"]["use_gate_in_kernel"] and call["options"]["safe_gate"]
    assert call["options"]["lower_bound"] == -5.0
    assert call["A_log"] is fla_layer.forget_gate.A_log and call["dt_bias"] is fla_layer.forget_gate.dt_bias
    torch.testing.assert_close(call["g"], fla_layer.forget_gate.raw(x).detach())
    assert fla_layer.route == "kda: fla chunk_kda (cuda, fp32 q/k/v, gate in kernel; conv: fla causal_conv1d)"
    for name in ("forget_gate.A_log", "forget_gate.dt_bias", "forget_gate.f_b_proj.weight", "q_proj.weight"):
        _assert_near(grads[name], expected_grads[name], name)


def test_packed_summary_equals_the_torch_summary(fla: RecordingFla) -> None:
    """The fla summary (final state of [0 | v] from [I | 0]) is the torch path's [M | S_ext] and the token
    loop's, and so are its gradients."""
    gen = torch.Generator().manual_seed(7)
    batch, seq, heads, dk = 2, 48, 2, 8
    q, k, v = (torch.randn(batch, seq, heads, dk, generator=gen, requires_grad=True) for _ in range(3))
    g = (-5.0 * torch.rand(batch, seq, heads, dk, generator=gen)).requires_grad_()
    beta = torch.rand(batch, seq, heads, generator=gen).requires_grad_()
    inputs = (q, k, v, g, beta)
    weights = torch.randn(batch, heads, dk, 2 * dk, generator=gen)

    got = fla_segment_summary(*inputs, 5.0, None)
    expected = kda_segment_summary(kda_chunk_transforms(*inputs, CHUNK, 5.0, with_queries=False))
    (call,) = fla.kda_calls
    assert call["v_width"] == 2 * dk
    eye = torch.eye(dk).expand(batch, heads, dk, dk)
    torch.testing.assert_close(call["initial_state"], F.pad(eye, (0, dk)))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(got, reference_segment_summary(*inputs), atol=1e-5, rtol=1e-5)
    state_inputs = inputs[1:]  # the state does not depend on the queries
    grads = torch.autograd.grad((got * weights).sum(), state_inputs)
    expected_grads = torch.autograd.grad((expected * weights).sum(), state_inputs)
    for name, a, b in zip("k v g beta".split(), grads, expected_grads, strict=True):
        _assert_near(a, b, name)


@pytest.fixture
def one_rank_group():
    """A one-process gloo group: zigzag cp=1 still runs two segments per rank through the exchanges."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_context_parallel_on_the_fla_route_equals_the_whole_window(
    fla: RecordingFla, one_rank_group: dist.ProcessGroup
) -> None:
    """Under context parallelism (zigzag, two segments as batch rows) the fla route summarises on fla, hands
    the state over and runs fla's core from it: output, final state and gradients equal the plain torch
    layer on the whole window; the route says where the summaries ran."""
    from genomelm.parallel import apply_context_parallel

    fla_layer, torch_layer = _layers(gate_in_kernel=True)
    apply_context_parallel(fla_layer, one_rank_group)
    x = torch.randn(1, 64, tiny_config().hidden_size)
    state = _state(fla_layer, 1, seed=8)
    weights = torch.randn(x.shape)
    grads, expected_grads = _grads(fla_layer, x, state, weights), _grads(torch_layer, x, state, weights)
    summary_call, core_call = fla.kda_calls
    dk = fla_layer.head_dim
    assert summary_call["v_width"] == 2 * dk and core_call["v_width"] == dk
    assert fla_layer.route == (
        "kda: fla chunk_kda (cuda, fp32 q/k/v, gate in kernel; conv: fla causal_conv1d), cp summaries on fla "
        "chunk_kda ([0 | v] from [I | 0]) + context parallel (zigzag, cp 1)"
    )
    with torch.no_grad():
        got, got_state = fla_layer(x, state)
        expected, expected_state = torch_layer(x, state)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state.recurrent, expected_state.recurrent, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        _assert_near(grad, expected_grads[name], name)


def test_torch_route_under_context_parallelism_names_its_summaries(one_rank_group: dist.ProcessGroup) -> None:
    from genomelm.parallel import apply_context_parallel, remove_context_parallel

    _, layer = _layers()
    apply_context_parallel(layer, one_rank_group)
    with torch.no_grad():
        layer(torch.randn(1, 32, tiny_config().hidden_size))
    assert layer.route == (
        "kda: torch chunked (chunk 16), cp summaries on torch chunked (chunk 16, fp64 solve) "
        "+ context parallel (zigzag, cp 1)"
    )
    remove_context_parallel(layer)
    assert layer.route == "kda: torch chunked (chunk 16)"


def test_simulation_stand_ins_check_what_fla_checks() -> None:
    from genomelm.plan.fla_stand_in import _causal_conv1d_call, _chunk_kda_call

    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match="fp32 initial state"):
        _chunk_kda_call(q, q, q, q, q[..., 0], initial_state=torch.zeros(1, 2, 8, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="safe_gate"):
        _chunk_kda_call(q, q, q, q, q[..., 0], safe_gate=True, lower_bound=-6.0)
    with pytest.raises(ValueError, match="A_log, dt_bias and safe_gate"):
        _chunk_kda_call(q, q, q, q, q[..., 0], use_gate_in_kernel=True)
    x = torch.randn(1, 16, 12)
    with pytest.raises(ValueError, match="activation None"):
        _causal_conv1d_call(x, torch.randn(12, 4), torch.zeros(1, 12, 4))


@pytest.mark.slow
def test_simulated_cp2_step_runs_kda_through_the_fla_stand_ins() -> None:
    """The training step on fake CUDA at cp=2 with the in-kernel gate: KDA takes the GPU's route (fla conv,
    fla summaries, fla core from the handed-over state) and the step completes through the stand-ins."""
    from genomelm.model import ModelConfig
    from genomelm.plan.simulate import simulate_step
    from genomelm.run.config import TrainConfig

    settings = ["model=tiny", "fsdp=false", "precision=bf16", "seq=512", "cp=2", "kda_gate_in_kernel=true"]
    chunks = ["loss_chunk_tokens=64", "indexer_query_block=32", "attention_query_block=32"]
    config = TrainConfig.from_args(settings + chunks)
    simulation = simulate_step(config, ModelConfig.preset("tiny"))
    assert len(simulation.ranks) == 2
    for rank in simulation.ranks:
        assert SIMULATED_ROUTE in rank.routes


def test_stand_ins_trace_on_fake_tensors_and_count_their_flops() -> None:
    """The simulation's chunk_kda stand-ins run on fake tensors (shapes and dtypes as fla's outputs, the
    backward's gradients shaped as the inputs) and FlopCounterMode counts `chunk_kda_flops` for them, twice
    that for the backward (an op of its own)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from genomelm.model.kda_chunk import chunk_kda_bytes, chunk_kda_flops
    from genomelm.plan.fla_stand_in import _causal_conv1d_call, _chunk_kda_call

    batch, seq, heads, dk, dv = 1, 256, 4, 32, 64
    with FakeTensorMode():
        q, k, g = (torch.randn(batch, seq, heads, dk, dtype=torch.bfloat16) for _ in range(3))
        v = torch.randn(batch, seq, heads, dv, dtype=torch.bfloat16, requires_grad=True)
        beta = torch.rand(batch, seq, heads, dtype=torch.bfloat16)
        A_log, dt_bias = torch.zeros(heads, requires_grad=True), torch.zeros(heads * dk, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            out, state = _chunk_kda_call(
                q,
                k,
                v,
                g,
                beta,
                use_gate_in_kernel=True,
                safe_gate=True,
                lower_bound=-5.0,
                A_log=A_log,
                dt_bias=dt_bias,
            )
        with FlopCounterMode(display=False) as backward_counter:
            (out.float().sum() + state.sum()).backward()
        rows = torch.randn(batch, seq, 3 * heads * dk, dtype=torch.bfloat16)
        conv, _ = _causal_conv1d_call(
            rows, torch.randn(3 * heads * dk, 4), torch.zeros(batch, 3 * heads * dk, 4), "silu"
        )
        assert out.shape == v.shape and out.dtype == torch.bfloat16 and conv.shape == rows.shape
        assert state.shape == (batch, heads, dk, dv) and state.dtype == torch.float32
        assert (
            v.grad.shape == v.shape
            and A_log.grad.shape == A_log.shape
            and dt_bias.grad.shape == dt_bias.shape
        )
    assert counter.get_total_flops() == chunk_kda_flops(batch, seq, heads, dk, dv) > 0
    assert backward_counter.get_total_flops() == 2 * chunk_kda_flops(batch, seq, heads, dk, dv)
    assert chunk_kda_bytes(batch, seq, heads, dk, dv) > 2 * (2 * dk + 2 * dv) * batch * seq * heads
