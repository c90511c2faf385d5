"""The sparse MLA Triton kernels (`genomelm.model.dsa_triton`) against the torch sparse path
(`dsa_sparse.sparse_latent_attention`), under Triton's interpreter on CPU tensors (fp32 and fp16; bf16
loads are wrong in the interpreter): forward, both gradients and the pool mass, alone and through
`DSAAttention` with `dsa_backend="triton"`; the cp=2 zigzag split, the deterministic backward, the custom
ops' fakes and FLOP formulas, the route strings and the refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from genomelm.model.config import DSA, ModelConfig, RunOptions
from genomelm.model.dsa import DSAAttention
from genomelm.model.dsa_sparse import sparse_latent_attention
from genomelm.model.indexer import Selection

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

dsa_triton = pytest.importorskip("genomelm.model.dsa_triton")

# triton fixes the mode of its own library functions (tl.sum, tl.zeros) when it is first imported, and
# torch.utils.flop_counter imports it: the variable must be set before the suite's first import of torch
# (tests/conftest.py), not only here
INTERPRETED = isinstance(triton.language.zeros, InterpretedFunction)
NOT_INTERPRETED = "triton was imported before TRITON_INTERPRET=1 was set: set it in tests/conftest.py"
pytestmark = pytest.mark.skipif(not INTERPRETED, reason=NOT_INTERPRETED)

KPOOL = 4
SCALING = 0.3


def random_selection(
    batch: int, positions: Tensor, pools_per_query: int, gen: torch.Generator, kpool: int = KPOOL
) -> Selection:
    """For each query, up to K distinct random complete pools before it (-1 pads the rest, as the indexer
    pads a window shorter than top-k), at global `positions` [n]."""
    pools = torch.full((batch, len(positions), pools_per_query), -1, dtype=torch.int32)
    for b in range(batch):
        for i, position in enumerate(positions.tolist()):
            chosen = torch.randperm((position + 1) // kpool, generator=gen)[:pools_per_query]
            pools[b, i, : len(chosen)] = chosen.int()
    return Selection(pools, kpool, True, positions)


def run_both(
    q: Tensor,
    latent: Tensor,
    selection: Selection,
    deterministic: bool = False,
    paths: tuple[str, ...] = ("torch", "kernel"),
) -> dict[str, tuple[Tensor, ...]]:
    """(out, pool mass, d q, d latent) of the torch sparse path and the kernels, for the same loss."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(q.shape, generator=gen).to(q.dtype)
    results = {}
    for name in paths:
        q_in, latent_in = q.detach().clone().requires_grad_(), latent.detach().clone().requires_grad_()
        if name == "torch":
            out, mass = sparse_latent_attention(q_in, latent_in, selection, SCALING, 5, True)
        else:
            positions = torch.arange(q.shape[1]) if selection.positions is None else selection.positions
            out, mass = dsa_triton.sparse_mla(
                q_in, latent_in, selection.pools, positions, KPOOL, True, SCALING, True, deterministic
            )
        (out.float() * weight.float()).sum().backward()
        results[name] = (out.detach(), mass, q_in.grad, latent_in.grad)
    return results


def max_rel_error(ours: Tensor, reference: Tensor) -> float:
    return float((ours.double() - reference.double()).abs().max() / reference.double().abs().max())


@pytest.mark.parametrize(
    ("batch", "seq_len", "pools_per_query", "heads", "width"),
    [
        (1, 9, 4, 4, 32),  # window shorter than top-k: empty slots; the first queries see only the tail
        (2, 25, 3, 4, 32),  # odd length, batch 2
        (1, 29, 2, 20, 48),  # two head blocks (16 + 4 masked), a latent width that is not a power of two
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_torch_sparse_path(
    batch: int, seq_len: int, pools_per_query: int, heads: int, width: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(seq_len)
    selection = random_selection(batch, torch.arange(seq_len), pools_per_query, gen)
    selection.positions = None
    q = torch.randn(batch, seq_len, heads, width, generator=gen).to(dtype)
    latent = torch.randn(batch, seq_len, width, generator=gen).to(dtype)
    # the reference in fp32 on the same (rounded) inputs; the kernels accumulate in fp32 in any dtype
    reference = run_both(q.float(), latent.float(), selection)["torch"]
    ours = run_both(q, latent, selection)["kernel"]
    tolerance = 2e-6 if dtype == torch.float32 else 2e-3
    for name, got, expected in zip(("out", "pool mass", "d q", "d latent"), ours, reference, strict=True):
        assert got.dtype == (torch.float32 if name == "pool mass" else dtype), name
        assert max_rel_error(got, expected) <= tolerance, name
    assert (ours[1].sum(-1) <= heads * (1 + 1e-5)).all()  # the tail's mass is in no pool


def test_context_parallel_zigzag_queries() -> None:
    """cp=2 zigzag: rank 0 holds the queries of spans ((0, a), (S - a, a)) and the whole window's latent;
    each rank's kernel rows equal the torch path and the whole-window rows."""
    seq_len, quarter = 40, 10
    gen = torch.Generator().manual_seed(3)
    whole = random_selection(1, torch.arange(seq_len), 3, gen)
    q = torch.randn(1, seq_len, 4, 32, generator=gen)
    latent = torch.randn(1, seq_len, 32, generator=gen)
    full = run_both(q, latent, whole, paths=("kernel",))["kernel"]
    for rank_positions in (
        torch.cat([torch.arange(0, quarter), torch.arange(seq_len - quarter, seq_len)]),
        torch.arange(quarter, seq_len - quarter),
    ):
        shard = Selection(whole.pools[:, rank_positions], KPOOL, True, rank_positions)
        results = run_both(q[:, rank_positions], latent, shard)
        for got, expected in zip(results["kernel"][:3], results["torch"][:3], strict=True):
            assert max_rel_error(got, expected) <= 2e-6
        assert max_rel_error(results["kernel"][3], results["torch"][3]) <= 2e-6
        assert torch.allclose(results["kernel"][0], full[0][:, rank_positions], atol=1e-6)


def test_deterministic_backward_equals_atomic_and_repeats() -> None:
    gen = torch.Generator().manual_seed(5)
    selection = random_selection(1, torch.arange(17), 3, gen)
    q = torch.randn(1, 17, 20, 32, generator=gen)  # two head blocks: parts of both reduced in order
    latent = torch.randn(1, 17, 32, generator=gen)
    atomic = run_both(q, latent, selection)
    first = run_both(q, latent, selection, True, ("kernel",))["kernel"]
    second = run_both(q, latent, selection, True, ("kernel",))["kernel"]
    assert torch.equal(first[3], second[3])
    assert max_rel_error(first[3], atomic["kernel"][3]) <= 1e-6
    assert max_rel_error(first[3], atomic["torch"][3]) <= 2e-6


def test_fake_tensors_and_flop_formulas() -> None:
    batch, seq_len, heads, width, pools_per_query = 1, 21, 4, 32, 3
    slots = pools_per_query * KPOOL + KPOOL - 1
    pairs = batch * seq_len * heads * slots * width
    with FakeTensorMode():
        q = torch.randn(batch, seq_len, heads, width, requires_grad=True)
        latent = torch.randn(batch, seq_len, width, requires_grad=True)
        pools = torch.zeros(batch, seq_len, pools_per_query, dtype=torch.int32)
        out, mass = dsa_triton.sparse_mla(q, latent, pools, torch.arange(seq_len), KPOOL, True, SCALING, True)
        out.sum().backward()
        assert out.shape == q.shape and mass.shape == (batch, seq_len, pools_per_query)
        assert mass.dtype == torch.float32 and latent.grad.shape == latent.shape
    gen = torch.Generator().manual_seed(1)
    selection = random_selection(batch, torch.arange(seq_len), pools_per_query, gen)
    q = torch.randn(batch, seq_len, heads, width, requires_grad=True)
    latent = torch.randn(batch, seq_len, width, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        out, _ = dsa_triton.sparse_mla(
            q, latent, selection.pools, selection.positions, KPOOL, True, SCALING, True
        )
        out.sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert counts["genomelm.sparse_mla_fwd"] == 4 * pairs
    assert counts["genomelm.sparse_mla_bwd"] == 10 * pairs
    assert (
        counts["genomelm.sparse_mla_pool_mass"]
        == 2 * batch * seq_len * heads * pools_per_query * KPOOL * width
    )
    # bytes from the op's own arguments (what the roofline calls): at full width the forward is dominated by
    # the gathered rows, B n W L x 2 bytes per head block
    with FakeTensorMode():
        q = torch.empty(1, 4096, 64, 512, dtype=torch.bfloat16)
        latent = torch.empty(1, 4096, 512, dtype=torch.bfloat16)
        pools = torch.empty(1, 4096, 512, dtype=torch.int32)
        moved = dsa_triton.sparse_mla_fwd_bytes(q, latent, pools, torch.arange(4096), 4, True, 0.1, False)
    gathered = 4096 * 2051 * 512 * 2
    assert gathered < moved < gathered + 2 * q.numel() * 2 + 4096 * (64 * 4 + 512 * 4 + 8) + 1


def test_refusals_name_the_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    positions = torch.arange(5)
    pools = torch.zeros(1, 5, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="L=1024"):
        dsa_triton.sparse_mla(
            torch.zeros(1, 5, 4, 1024), torch.zeros(1, 5, 1024), pools, positions, 4, True, 1.0, False
        )
    with pytest.raises(ValueError, match="float64"):
        dsa_triton.sparse_mla(
            torch.zeros(1, 5, 4, 32, dtype=torch.float64),
            torch.zeros(1, 5, 32, dtype=torch.float64),
            pools,
            positions,
            4,
            True,
            1.0,
            False,
        )
    with pytest.raises(ValueError, match="kpool=3"):
        dsa_triton.sparse_mla(
            torch.zeros(1, 5, 4, 32), torch.zeros(1, 5, 32), pools, positions, 3, True, 1.0, True
        )
    with FakeTensorMode():  # full width at 4k queries: 16 GiB of parts (only shapes are made)
        q = torch.empty(1, 4096, 64, 512, dtype=torch.bfloat16)
        with pytest.raises(
            ValueError, match=r"deterministic sparse MLA backward .* q_lat \(1, 4096, 64, 512\)"
        ):
            dsa_triton.sparse_mla(
                q,
                torch.empty(1, 4096, 512, dtype=q.dtype),
                torch.zeros(1, 4096, 512, dtype=torch.int32),
                torch.arange(4096),
                4,
                True,
                1.0,
                False,
                deterministic=True,
            )
    layer = DSAAttention(tiny_config(), 0, RunOptions(dsa_backend="triton"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        layer(torch.randn(1, 8, 64))


# ---------------------------------------------------------------------------------------------- the layer
def tiny_config() -> ModelConfig:
    """Two DSA layers (full, then shared), 4 heads, latent 32, top-16 in pools of 4: 19 slots."""
    return ModelConfig(
        vocab_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_n_heads=16,
        index_head_dim=16,
        index_topk=16,
        index_kpool=KPOOL,
        layer_types=[DSA, DSA],
        mlp_layer_types=["dense", "dense"],
        indexer_types=["full", "shared"],
        intermediate_size=32,
        pad_token_id=None,
    )


def test_layer_with_triton_backend_matches_sparse() -> None:
    """Both layers (full with train_indexer's KL term, then shared) with the kernels equal the torch path:
    outputs, the indexer loss, every parameter's gradient and the input's."""
    config = tiny_config()
    torch.manual_seed(0)
    x = torch.randn(2, 27, config.hidden_size)
    weight = torch.randn(2, 27, config.hidden_size)
    results = {}
    for backend in ("sparse", "triton"):
        torch.manual_seed(1)
        layers = [
            DSAAttention(config, i, RunOptions(dsa_backend=backend, train_indexer=True)) for i in (0, 1)
        ]
        for layer in layers:
            with torch.no_grad():
                for param in layer.parameters():
                    param.add_(0.3 * torch.randn_like(param))
        x_in = x.clone().requires_grad_()
        out, selection = layers[0](x_in)
        out_shared, _ = layers[1](out, selection)
        ((out + out_shared) * weight).sum().add(layers[0].indexer_loss).backward()
        grads = {f"{i}.{n}": p.grad for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
        results[backend] = (out_shared.detach(), layers[0].indexer_loss.detach(), x_in.grad, grads, layers)
    ref, ours = results["sparse"], results["triton"]
    assert max_rel_error(ours[0], ref[0]) <= 1e-5
    assert abs(float(ours[1] - ref[1])) <= 1e-5 * abs(float(ref[1])) + 1e-7
    assert max_rel_error(ours[2], ref[2]) <= 1e-5
    for name, expected in ref[3].items():
        if expected is None:
            assert ours[3][name] is None, name
        else:
            assert max_rel_error(ours[3][name], expected) <= 1e-4, name
    full, shared = ours[4]
    assert full.route.startswith(
        "dsa: triton sparse MLA (19 slots, tiles of 16, fp32 atomic d latent), indexer"
    )
    assert shared.route.endswith(", shared selection")
    assert ref[4][0].route.startswith("dsa: sparse gather (19 slots)")


def test_route_resolves_at_first_forward_and_keeps_notes() -> None:
    config = tiny_config()
    layer = DSAAttention(config, 0, RunOptions(dsa_backend="auto"))
    assert layer.route.startswith("dsa: auto (resolved at the first forward)")
    layer.route += " + context parallel (zigzag, cp 2)"  # as `apply_context_parallel` notes it
    layer(torch.randn(1, 8, config.hidden_size))
    assert layer.route.startswith("dsa: sparse gather (19 slots), attention blocks of")  # auto on CPU
    assert layer.route.endswith(" + context parallel (zigzag, cp 2)")
    triton_layer = DSAAttention(config, 0, RunOptions(dsa_backend="triton"))
    triton_layer(torch.randn(1, 8, config.hidden_size))
    assert triton_layer.route.startswith(
        "dsa: triton sparse MLA (19 slots, tiles of 16, fp32 atomic d latent)"
    )
    indexer_route = getattr(triton_layer.indexer, "route", None)  # the indexer's own path, where it names one
    if indexer_route is not None:
        assert triton_layer.route.endswith(f"), {indexer_route}")


def test_layer_under_deterministic_algorithms_reduces_in_order() -> None:
    """torch.use_deterministic_algorithms(True) selects the fixed-order d latent, named in the route; the
    gradients equal the atomic run's."""
    config = tiny_config()
    x = torch.randn(1, 23, config.hidden_size)
    grads = []
    for deterministic in (False, True):
        torch.manual_seed(2)
        layer = DSAAttention(config, 1, RunOptions(dsa_backend="triton"))  # the shared layer: no indexer
        selection = random_selection(1, torch.arange(23), 4, torch.Generator().manual_seed(4))
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(deterministic)
        try:
            out, _ = layer(x, selection)
            out.square().sum().backward()
        finally:
            torch.use_deterministic_algorithms(previous)
        reduction = "fixed-order" if deterministic else "fp32 atomic"
        assert (
            layer.route
            == f"dsa: triton sparse MLA (19 slots, tiles of 16, {reduction} d latent), shared selection"
        )
        grads.append(layer.kv_b_proj.weight.grad)
    assert max_rel_error(grads[1], grads[0]) <= 1e-6


@pytest.mark.slow
def test_kernels_compile_for_sm90_within_registers_and_shared_memory() -> None:
    """Every kernel compiles ahead of time for an H100 / H200 at full width with the GPU tiles (no GPU
    needed): no register spills, shared memory within the limit."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_dsa.py"
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(script), "--compile-only"], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 5 and all(" 0 B spilled" in line for line in lines), result.stdout
    assert "does not fit" not in result.stdout
