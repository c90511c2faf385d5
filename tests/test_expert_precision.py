"""FP8 / MXFP8 routed-expert GEMMs (`genomelm/model/expert_precision.py`) held to the bf16 path on the CPU,
where the same numerics run emulated (torchao's MXFP8 emulation; FP8 rowwise quantised with torchao's own
functions). Every tolerance is about twice the error measured (stated in each test); the GPU kernels are
benchmarks/gpu_check.py's to run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_helpers import tiny_config

from genomelm.model import GlmForCausalLM, RunOptions
from genomelm.model.expert_precision import (
    _aligned,
    _fake_e4m3,
    _fake_e4m3_per_group_columns,
    low_precision_grouped_linear,
)

LOW = ("fp8_rowwise", "mxfp8")


def _relative(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.detach().float() - y.detach().float()).norm() / y.detach().float().norm())


def test_groups_are_padded_to_the_kernels_alignment_on_the_device() -> None:
    """Each expert's rows start at a multiple of the alignment in a buffer whose size does not depend on the
    routing; the rows come back in order and the padding is zeros."""
    x = torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4)
    counts = torch.tensor([3, 0, 7])
    padded, ends, rows = _aligned(x, counts, 16)
    assert padded.shape == (64, 4)  # 10 + 3 x 15, rounded up to 16
    assert ends.tolist() == [16, 16, 32] and ends.dtype == torch.int32
    assert rows.tolist() == [0, 1, 2, *range(16, 23)]
    assert torch.equal(padded[rows], x) and padded.abs().sum() == x.abs().sum()


def test_emulated_fp8_rowwise_quantises_as_torchaos_reference() -> None:
    """The emulation's quantisers equal torchao's torch references bit for bit: the weight per row over the
    output dim (input gradient), each group's columns (weight gradient); the forward's per-row and
    per-column scales are torchao's `tensor_to_scale` itself."""
    from torchao.prototype.moe_training.utils import (
        torch_to_3d_rowwise_float8_transpose_rhs,
        torch_to_float8_per_group_colwise,
    )

    torch.manual_seed(0)
    weight_t = (
        torch.randn(3, 32, 48).transpose(-2, -1).contiguous().transpose(-2, -1)
    )  # [E, K, N] column-major
    data, scales = torch_to_3d_rowwise_float8_transpose_rhs(weight_t, round_scales_to_power_of_2=True)
    assert torch.equal(_fake_e4m3(weight_t, -1), (data.float() / scales).transpose(-2, -1))
    rows = torch.randn(48, 32) * torch.logspace(-2, 2, 48).unsqueeze(1)
    ends = torch.tensor([16, 24, 48], dtype=torch.int32)  # (its reference takes no empty group)
    data, scales = torch_to_float8_per_group_colwise(rows, ends, round_scales_to_power_of_2=True)
    group_of_row = torch.tensor([0] * 16 + [1] * 8 + [2] * 24)
    per_row = scales.reshape(3, 32)[group_of_row]
    assert torch.equal(_fake_e4m3_per_group_columns(rows, ends), data.float() / per_row)


@pytest.mark.parametrize("precision", LOW)
def test_one_grouped_gemm_is_within_5_percent_of_bf16(precision: str) -> None:
    """Random rows over 4 experts (group sizes not aligned, one empty): the output, the input gradient and the
    weight gradient within 5% (relative L2) of the bf16 grouped GEMM's (measured: 3.7-3.8% for both recipes,
    e4m3's 3 mantissa bits); mxfp8's 32-value blocks differ from fp8's per-row scales where a row's blocks
    differ in size."""
    torch.manual_seed(0)
    counts = torch.tensor([5, 40, 0, 19])
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(4, 96, 64, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(64, 96, dtype=torch.bfloat16)
    out = low_precision_grouped_linear(x, weight, counts, precision)
    (out.float() * grad.float()).sum().backward()
    x_ref, weight_ref = (t.detach().clone().requires_grad_() for t in (x, weight))
    ref = torch._grouped_mm(x_ref, weight_ref.transpose(-2, -1), offs=counts.cumsum(0).to(torch.int32))
    (ref.float() * grad.float()).sum().backward()
    assert out.dtype == torch.bfloat16 and x.grad.dtype == weight.grad.dtype == torch.bfloat16
    for got, want in ((out, ref), (x.grad, x_ref.grad), (weight.grad, weight_ref.grad)):
        assert 0 < _relative(got, want) < 0.05
    # a row of 1s then 32 values 2^20 times smaller, read by a weight on those 32 only: one scale for the row
    # (fp8_rowwise) flushes them below e4m3's smallest value; mxfp8's own block scale keeps them exactly
    row = torch.ones(16, 64, dtype=torch.bfloat16)
    row[:, 32:] = 1.125 * 2**-20
    second = torch.zeros(1, 16, 64, dtype=torch.bfloat16)
    second[..., 32:] = 1
    one = low_precision_grouped_linear(row, second, torch.tensor([16]), precision)
    assert float(one[0, 0]) == (32 * 1.125 * 2**-20 if precision == "mxfp8" else 0.0)


def _step(config, precision: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """`config` built at seed 0, one bf16-autocast forward and backward of `ids`: the last hidden states, the
    per-token losses and every gradient."""
    torch.manual_seed(0)
    model = GlmForCausalLM.from_config(config, RunOptions(expert_precision=precision, moe_chunk_tokens=64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.hidden_states(ids)
        nll = model(ids, ids, reduction="none")
    nll.float().mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return hidden.detach(), nll.detach(), grads, model


@pytest.mark.parametrize("precision", LOW)
def test_the_model_with_low_precision_experts_stays_near_bf16(precision: str) -> None:
    """`tiny` widened to 64 (the dims a multiple of 32) at its own initialisation, 256 tokens, bf16 autocast:
    against expert_precision=bf16, the per-token losses within 1% (measured 0.45%), the last hidden states
    within 10% (5.7%; bf16 against fp32 is 2.7%), all gradients together within 5% (2.6%; bf16 against fp32:
    1.1%) and each routed expert weight's gradient within 12% (6.7%; 3.1%). The parameters, hence the
    checkpoint, are the bf16 run's: the same names, shapes and dtypes."""
    config = tiny_config(hidden_size=64, moe_intermediate_size=64)
    ids = torch.randint(1, 6, (1, 256), generator=torch.Generator().manual_seed(1))
    hidden0, nll0, grads0, model0 = _step(config, "bf16", ids)
    hidden, nll, grads, model = _step(config, precision, ids)
    assert "expert GEMMs" in model.route_table() and precision in model.route_table()
    assert {n: (p.shape, p.dtype) for n, p in model.state_dict().items()} == {
        n: (p.shape, p.dtype) for n, p in model0.state_dict().items()
    }
    assert _relative(nll, nll0) < 0.01 and _relative(hidden, hidden0) < 0.10
    names = sorted(grads0)
    assert sorted(grads) == names
    assert (
        _relative(
            torch.cat([grads[n].flatten() for n in names]), torch.cat([grads0[n].flatten() for n in names])
        )
        < 0.05
    )
    experts = [n for n in names if ".mlp.experts." in n]
    assert experts and max(_relative(grads[n], grads0[n]) for n in experts) < 0.12


def test_bad_expert_precision_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="expert_precision must be one of"):
        GlmForCausalLM.from_config(tiny_config(), RunOptions(expert_precision="fp4"))
    with pytest.raises(ValueError, match=r"multiples of 32 .*use expert_precision=bf16"):
        GlmForCausalLM.from_config(tiny_config(), RunOptions(expert_precision="mxfp8"))  # intermediate 16
    with pytest.raises(ValueError, match="set moe_backend=grouped"):
        GlmForCausalLM.from_config(
            tiny_config(), RunOptions(expert_precision="fp8_rowwise", moe_backend="loop")
        )
    assert dataclasses.replace(RunOptions(), expert_precision="bf16") == RunOptions()
