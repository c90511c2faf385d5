"""KDA under context parallelism equals CP = 1, and a segment's summary equals the recurrent reference.

The multi-process cases run through `genomelm.parallel.launch` (gloo, 2 and 4 ranks): every rank builds the
same tiny KDA layer, runs its shard of the window under `apply_context_parallel` and returns its outputs and
gradients; the parent compares them with the plain layer on the whole window.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from genomelm.model import ModelConfig, RunOptions
from genomelm.model.kda import KDAState, KDAttention
from genomelm.model.kda_chunk import apply_state_map, kda_chunk_transforms, kda_segment_summary
from genomelm.model.kda_naive import recurrent_kda, reference_segment_summary
from genomelm.parallel import (
    CONTIGUOUS,
    ZIGZAG,
    ContextLayout,
    apply_context_parallel,
    exchange,
    launch,
    remove_context_parallel,
)

# ranks import this module: keep it free of transformers (model_helpers), ~3 s per process on 2 cores
SEQ_LEN = 384  # zigzag cp 4: 8 segments of 48 tokens = 3 chunks of 16
BATCH = 2
CHUNK = 16
LAUNCH_TIMEOUT_S = 120.0
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}
# (layout, dtype, backend); "recurrent" runs its own core from the handed-over state (torch summary), as fla
# does
CASES = [(kind, dtype, "torch") for kind in (ZIGZAG, CONTIGUOUS) for dtype in ("float64", "float32")]
CASES.append((ZIGZAG, "float64", "recurrent"))


@dataclasses.dataclass
class Problem:
    """One layer and one window with a nonzero incoming state, in fp64 (cast per case)."""

    config: ModelConfig
    weights: dict[str, Tensor]
    x: Tensor  # [B, S, D]
    recurrent: Tensor  # [B, H, Dk, Dv]
    conv_tail: Tensor  # [B, 3W, K-1]
    out_weights: Tensor  # [B, S, D]: the loss is sum(y * out_weights) + final-state terms
    final_weights: tuple[Tensor, Tensor]


def _problem() -> Problem:
    from model_helpers import randomise_, tiny_config  # parent only (imports transformers)

    config = tiny_config()
    layer = KDAttention(config, 0, RunOptions(kda_backend="torch", kda_chunk_size=CHUNK)).double()
    randomise_(layer, seed=5)
    gen = torch.Generator().manual_seed(6)
    # slow decays, like the reference init's dt_bias, so that states cross segments (M far from 0)
    with torch.no_grad():
        layer.forget_gate.dt_bias.copy_(-6.0 + torch.randn(layer.forget_gate.dt_bias.shape, generator=gen))
    width = 3 * config.linear_num_heads * config.linear_head_dim
    dk = config.linear_head_dim

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return Problem(
        config=config,
        weights={name: t.detach().clone() for name, t in layer.state_dict().items()},
        x=randn(BATCH, SEQ_LEN, config.hidden_size),
        recurrent=0.5 * randn(BATCH, config.linear_num_heads, dk, dk),
        conv_tail=randn(BATCH, width, config.linear_conv_kernel_dim - 1),
        out_weights=randn(BATCH, SEQ_LEN, config.hidden_size),
        final_weights=(randn(BATCH, config.linear_num_heads, dk, dk), randn(BATCH, width, 3)),
    )


def _layer(problem: Problem, dtype: torch.dtype, backend: str) -> KDAttention:
    layer = KDAttention(problem.config, 0, RunOptions(kda_backend=backend, kda_chunk_size=CHUNK))
    layer.load_state_dict(problem.weights)
    return layer.to(dtype)


def _loss(
    y: Tensor, out_weights: Tensor, final: KDAState, final_weights: tuple[Tensor, Tensor] | None
) -> Tensor:
    loss = (y * out_weights).sum()
    if final_weights is not None:
        loss = loss + (final.recurrent * final_weights[0]).sum() + (final.conv_tail * final_weights[1]).sum()
    return loss


def _run(
    layer: KDAttention, problem: Problem, dtype: torch.dtype, layout: ContextLayout | None
) -> dict[str, Any]:
    """Forward + backward of one layer (whole window when layout is None, else this rank's shard)."""
    shard = (lambda t: t) if layout is None else layout.shard
    x = shard(problem.x).to(dtype, copy=True).requires_grad_(True)
    state = KDAState(
        problem.recurrent.to(dtype, copy=True).requires_grad_(True),
        problem.conv_tail.to(dtype, copy=True).requires_grad_(True),
    )
    y, final = layer(x, state)
    # the final state is the same on every rank: its loss terms are counted on rank 0 only
    counts_final = layout is None or layout.rank == 0
    final_weights = tuple(t.to(dtype) for t in problem.final_weights) if counts_final else None
    _loss(y, shard(problem.out_weights).to(dtype), final, final_weights).backward()
    return {
        "y": y.detach(),
        "final_recurrent": final.recurrent.detach(),
        "final_tail": final.conv_tail.detach(),
        "grad_x": x.grad,
        "grad_recurrent": state.recurrent.grad,
        "grad_conv_tail": state.conv_tail.grad,
        "grad_params": {name: p.grad for name, p in layer.named_parameters()},
    }


def _rank_cases(problem: Problem) -> list[dict[str, Any]]:
    """On each rank: every case of CASES under CP, recording the shapes each collective is handed."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    collectives: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def recorded(name: str, collective):
        def run(t: Tensor, group: dist.ProcessGroup) -> Tensor:
            collectives.append((name, tuple(t.shape), t.dtype))
            return collective(t, group)

        return run

    exchange.all_gather_slots = recorded("all_gather", exchange.all_gather_slots)
    exchange.reduce_scatter_slots = recorded("reduce_scatter", exchange.reduce_scatter_slots)
    results = []
    for kind, dtype_name, backend in CASES:
        dtype = getattr(torch, dtype_name)
        layer = _layer(problem, dtype, backend)
        names_before = [name for name, _ in layer.named_parameters()]
        changed = apply_context_parallel(layer, dist.group.WORLD, kind)
        collectives.clear()
        result = _run(layer, problem, dtype, ContextLayout(SEQ_LEN, cp, rank, kind, kda_chunk=CHUNK))
        result["collectives"] = list(collectives)
        result["route"] = layer.route
        result["changed"] = changed
        result["same_names"] = names_before == [name for name, _ in layer.named_parameters()]
        result["removed"] = remove_context_parallel(layer)
        result["route_after_remove"] = layer.route
        results.append(result)
    return results


@pytest.fixture(scope="module")
def problem() -> Problem:
    return _problem()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda cp: f"cp{cp}")
def under_cp(request: pytest.FixtureRequest, problem: Problem) -> tuple[int, list[list[dict[str, Any]]]]:
    """(cp, results[rank][case]): one launch runs every case."""
    return request.param, launch(_rank_cases, request.param, problem, timeout_s=LAUNCH_TIMEOUT_S)


def _max_error(got: Tensor, expected: Tensor) -> float:
    """Largest |got - expected| relative to the largest |expected| (at least 1)."""
    return ((got - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item()


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(c) for c in CASES])
def test_kda_layer_under_cp_equals_cp1(under_cp, problem: Problem, case: int) -> None:
    """Outputs, final state, and the gradients of the input, the incoming state (recurrent and conv tail) and
    every parameter: CP (this rank's shard, gradients summed over ranks) == the plain layer on the whole
    window."""
    cp, ranks = under_cp
    kind, dtype_name, backend = CASES[case]
    dtype = getattr(torch, dtype_name)
    expected = _run(_layer(problem, dtype, backend), problem, dtype, None)
    got = [r[case] for r in ranks]
    layout = ContextLayout(SEQ_LEN, cp, 0, kind, kda_chunk=CHUNK)
    pairs = {
        "y": (layout.restore(torch.cat([g["y"] for g in got], dim=1)), expected["y"]),
        "grad_x": (layout.restore(torch.cat([g["grad_x"] for g in got], dim=1)), expected["grad_x"]),
        "grad_recurrent": (sum(g["grad_recurrent"] for g in got), expected["grad_recurrent"]),
        "grad_conv_tail": (sum(g["grad_conv_tail"] for g in got), expected["grad_conv_tail"]),
    }
    for rank, g in enumerate(got):  # the window's final state, on every rank
        pairs[f"final_recurrent@{rank}"] = (g["final_recurrent"], expected["final_recurrent"])
        pairs[f"final_tail@{rank}"] = (g["final_tail"], expected["final_tail"])
    for name, grad in expected["grad_params"].items():
        pairs[f"grad {name}"] = (sum(g["grad_params"][name] for g in got), grad)
    norm_weight = pairs.pop("grad o_norm.weight")
    # norms.GatedRMSNorm runs in fp32 whatever its input: its weight gradient is a sum over tokens in fp32,
    # which the split into shards reorders (this term alone meets fp32's tolerance in the fp64 cases)
    assert _max_error(*norm_weight) <= TOLERANCE[torch.float32]
    tolerance = TOLERANCE[dtype]
    errors = {name: _max_error(a, b) for name, (a, b) in pairs.items()}
    worst = max(errors, key=errors.get)
    print(f"cp={cp} {kind} {dtype_name} {backend}: worst {worst} {errors[worst]:.2e}")
    assert errors[worst] <= tolerance, errors
    assert all(g["y"].dtype == dtype and g["grad_x"].dtype == dtype for g in got)


def test_cp_override_keeps_parameters_and_exchanges_once_per_direction(under_cp, problem: Problem) -> None:
    """apply/remove change no parameter name; each layer runs one all-gather for the halo and one for the
    packed summaries in forward, and the two matching reduce-scatters in backward, on every rank."""
    cp, ranks = under_cp
    config = problem.config
    heads, dk, width, halo = (
        config.linear_num_heads,
        config.linear_head_dim,
        3 * config.linear_num_heads * config.linear_head_dim,
        config.linear_conv_kernel_dim - 1,
    )
    for rank_results in ranks:
        for (kind, dtype_name, _), result in zip(CASES, rank_results):
            n = 2 if kind == ZIGZAG else 1
            dtype = getattr(torch, dtype_name)
            assert result["changed"] == [""] and result["removed"] == [""] and result["same_names"]
            assert result["route"].endswith(f"+ context parallel ({kind}, cp {cp})")
            assert "context parallel" not in result["route_after_remove"]
            assert result["collectives"] == [
                ("all_gather", (n, BATCH, halo, width), dtype),
                ("all_gather", (n, BATCH, heads, dk, 2 * dk), dtype),
                ("reduce_scatter", (cp * n, BATCH, heads, dk, 2 * dk), dtype),
                ("reduce_scatter", (cp * n, BATCH, halo, width), dtype),
            ]


def _kda_inputs(seq_len: int, dtype: torch.dtype, seed: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batch, heads, dk, dv = 2, 3, 8, 6
    q, k = (torch.randn(batch, seq_len, heads, dk, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(batch, seq_len, heads, dv, generator=gen, dtype=dtype)
    # slow decays and small betas, so that M (what the incoming state still counts for) stays far from 0
    g = -0.1 * torch.rand(batch, seq_len, heads, dk, generator=gen, dtype=dtype) ** 2
    beta = 0.5 * torch.rand(batch, seq_len, heads, generator=gen, dtype=dtype)
    return [q, k, v, g, beta]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("seq_len,chunk", [(96, 16), (70, 32)])  # 70: a padded last chunk
def test_segment_summary_matches_recurrent_reference(
    dtype: torch.dtype, tol: float, seq_len: int, chunk: int
) -> None:
    """[M | S_ext] from the chunk transforms == two runs of the token loop (from I with zero values, from 0),
    and M S_in + S_ext == the token loop's final state from S_in."""
    inputs = _kda_inputs(seq_len, dtype, seed=seq_len)
    summary = kda_segment_summary(kda_chunk_transforms(*inputs, chunk_size=chunk, gate_bound=5.0))
    reference = reference_segment_summary(*inputs)
    assert summary.shape == (2, 3, 8, 8 + 6) and summary.dtype == dtype
    torch.testing.assert_close(summary, reference, atol=tol, rtol=tol)
    incoming = torch.randn(2, 3, 8, 6, dtype=dtype, generator=torch.Generator().manual_seed(1))
    _, final = recurrent_kda(*inputs, incoming)
    torch.testing.assert_close(apply_state_map(summary, incoming), final, atol=tol, rtol=tol)


def test_segment_summary_gradients_match_recurrent_reference() -> None:
    """Gradients of k, v, g, beta through the summary (q does not enter it), fp64."""
    inputs = [t.requires_grad_(True) for t in _kda_inputs(48, torch.float64, seed=2)]
    weights = torch.randn(2, 3, 8, 14, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    expected = torch.autograd.grad((reference_segment_summary(*inputs) * weights).sum(), inputs[1:])
    summary = kda_segment_summary(kda_chunk_transforms(*inputs, chunk_size=16, gate_bound=5.0))
    got = torch.autograd.grad((summary * weights).sum(), inputs[1:])
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10)


def test_state_fold_equals_the_serial_fold_of_apply_state_map(monkeypatch: pytest.MonkeyPatch) -> None:
    """`hand_over_states`' fold (batched over the heads; the summaries' gradients batched over the segments)
    against `apply_state_map` applied segment by segment with autograd through it, fp32 at cp=8 (16 zigzag
    segments), seen from rank 5: the same incoming states, final state and gradients of every rank's
    summaries and of the initial state, bit for bit. The gather returns the whole window's summaries and the
    reduce-scatter is read before it sums (one process, no group)."""
    layout = ContextLayout(seq_len=16 * 64, cp=8, rank=5)
    gen = torch.Generator().manual_seed(4)
    batch, heads, dk, dv = 2, 3, 8, 6
    gathered = (
        0.3 * torch.randn(layout.num_segments, batch, heads, dk, dk + dv, generator=gen)
    ).requires_grad_()
    initial = torch.randn(batch, heads, dk, dv, generator=gen).requires_grad_()
    grad_in = torch.randn(len(layout.segments), batch, heads, dk, dv, generator=gen)
    grad_final = torch.randn(batch, heads, dk, dv, generator=gen)

    states = [initial]
    for segment in layout.slot_of_segment():
        states.append(apply_state_map(gathered[segment], states[-1]))
    expected = (torch.stack(states)[list(layout.segments)], states[-1])
    loss = (expected[0] * grad_in).sum() + (expected[1] * grad_final).sum()
    expected_grads = torch.autograd.grad(loss, [gathered, initial])

    slots: dict[str, Tensor] = {}
    monkeypatch.setattr(exchange, "all_gather_slots", lambda local, group: gathered.detach())
    monkeypatch.setattr(
        exchange, "reduce_scatter_slots", lambda whole, group: slots.setdefault("whole", whole)[:2]
    )
    local = torch.zeros(2, batch, heads, dk, dk + dv, requires_grad=True)
    start = initial.detach().requires_grad_()
    got = exchange.hand_over_states(local, start, layout, None)
    grads = torch.autograd.grad((got[0] * grad_in).sum() + (got[1] * grad_final).sum(), [local, start])
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(slots["whole"], expected_grads[0]) and torch.equal(grads[1], expected_grads[1])
