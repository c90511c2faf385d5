"""The Triton lightning indexer (`genomelm.model.indexer_triton`) against the torch path, under Triton's
interpreter on CPU tensors (fp32 and fp16; bf16 loads are wrong in the interpreter)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from genomelm.model import ModelConfig, RunOptions  # noqa: E402
from genomelm.model.indexer import FP8_MAX, Indexer, quantize_fp8_rows  # noqa: E402

pytest.importorskip("triton")
if os.environ["TRITON_INTERPRET"] != "1":
    pytest.skip("the kernel tests run under TRITON_INTERPRET=1", allow_module_level=True)

from genomelm.model import indexer_triton  # noqa: E402

FINFO_MIN = torch.finfo(torch.float32).min


def small_config(**changes: object) -> ModelConfig:
    """`tiny` with a 4-pool top-k (k-pool 4) and 2 index heads of 16: few heads make exact-zero ties
    common."""
    fields = dict(index_n_heads=2, index_head_dim=16, index_topk=16, index_kpool=4) | changes
    return dataclasses.replace(ModelConfig.preset("tiny"), **fields)


def indexer_pair(config: ModelConfig, seed: int = 0, **options: object) -> tuple[Indexer, Indexer]:
    """(torch-path indexer, Triton-path indexer) with the same random weights."""
    torch.manual_seed(seed)
    reference = Indexer(config, RunOptions(indexer_backend="torch", indexer_query_block=16, **options))
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.randn_like(param) * param.shape[-1] ** -0.5)
    kernel = Indexer(config, RunOptions(indexer_backend="triton", **options))
    kernel.load_state_dict(reference.state_dict())
    return reference, kernel


def inputs(config: ModelConfig, batch: int, seq_len: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, config.hidden_size, generator=gen)
    return x, torch.randn(batch, seq_len, config.q_lora_rank, generator=gen)


def assert_same_selection(kernel: torch.Tensor, reference: torch.Tensor) -> None:
    """The same pools per query in the same order, ties included."""
    assert kernel.dtype == torch.int32 and kernel.shape == reference.shape
    torch.testing.assert_close(kernel, reference, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_scores_match_torch(dtype: torch.dtype) -> None:
    config = small_config()
    reference, _ = indexer_pair(config)
    x, q_resid = inputs(config, 2, 45)
    pool_keys = reference.pool_keys(x)
    start = 20  # a block in the middle of the window: some pools visible, the rest masked
    rows = slice(start, 45)
    q, weights = reference._block_queries(x[:, rows], q_resid[:, rows])
    got = indexer_triton.indexer_scores(
        q.to(dtype), pool_keys.to(dtype), weights, None, start, 4, reference.softmax_scale
    )
    if dtype == torch.float32:
        expected = reference._block_scores(x[:, rows], q_resid[:, rows], pool_keys, start)
    else:
        scores = torch.einsum("bmhd,bpd->bmhp", q.to(dtype).float(), pool_keys.to(dtype).float())
        expected = (scores * reference.softmax_scale).relu().mul(weights[..., None]).sum(2)
        visible = (torch.arange(11) * 4 + 3)[None] <= torch.arange(start, 45)[:, None]
        expected = expected.masked_fill(~visible, FINFO_MIN)
    assert (got == FINFO_MIN).sum() > 0 and (got > FINFO_MIN).sum() > 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "batch,seq_len,score_bytes",
    [
        (1, 1, None),  # one query: every pool masked
        (1, 9, None),  # 2 pools: a window shorter than the top-k
        (2, 37, None),  # odd length, k-pool tail, batch 2
        (1, 150, 4 * 37 * 16),  # 37 pools, blocks of 16 queries: many kernel blocks and pool tiles
        (2, 203, None),  # one block of every query, odd length
    ],
)
def test_selection_equals_torch_path(batch: int, seq_len: int, score_bytes: int | None) -> None:
    config = small_config()
    reference, kernel = indexer_pair(config, seed=seq_len)
    if score_bytes is not None:
        kernel.kernel_score_bytes = score_bytes
    x, q_resid = inputs(config, batch, seq_len, seed=seq_len)
    expected = reference.select(x, q_resid)
    got = kernel.select(x, q_resid)
    assert_same_selection(got.pools, expected.pools)
    assert (got.pools[:, : min(3, seq_len)] == -1).all()  # the first kpool-1 queries see no complete pool
    assert torch.equal(got.token_indices(), expected.token_indices())
    if score_bytes is not None:
        assert kernel.route == "indexer: triton fused scores, blocks of 16 queries, fp32"


def test_ties_are_common_and_kept() -> None:
    """With 2 heads, many scores are exactly 0 (both ReLUs 0): the kernel picks the same tied pools."""
    config = small_config(index_topk=32)
    reference, kernel = indexer_pair(config, seed=3)
    x, q_resid = inputs(config, 1, 120, seed=3)
    scores = reference._block_scores(x, q_resid, reference.pool_keys(x), 0)
    expected, got = reference.select(x, q_resid), kernel.select(x, q_resid)
    picked = torch.gather(scores, -1, expected.pools.long().clamp(min=0))
    assert ((picked == 0) & (expected.pools >= 0)).sum() > 20  # many selected pools tie at 0
    assert_same_selection(got.pools, expected.pools)


def test_context_parallel_spans() -> None:
    """A cp=2 zigzag split: rank 0 holds spans (0, a) and (S - a, a), scored against the window's keys."""
    config = small_config()
    reference, kernel = indexer_pair(config, seed=4)
    seq_len, a = 64, 16
    x, q_resid = inputs(config, 2, seq_len, seed=4)
    whole = reference.select(x, q_resid)
    pool_keys = reference.pool_keys(x)
    spans = ((0, a), (seq_len - a, a))
    rows = torch.cat([torch.arange(0, a), torch.arange(seq_len - a, seq_len)])
    got = kernel.select(x[:, rows], q_resid[:, rows], pool_keys, spans)
    assert_same_selection(got.pools, whole.pools[:, rows])
    assert torch.equal(got.positions, rows)


def test_oracle_with_triton_indexer() -> None:
    """The whole tiny model with the kernel's selection against transformers (test_model_oracle)."""
    from model_helpers import build_pair, oracle_logprobs, random_tokens, tiny_config

    config = tiny_config()
    ref, head, ours = build_pair(config, RunOptions(indexer_backend="triton", kda_chunk_size=32))
    ids = random_tokens(2, 100, config.vocab_size, seed=102)
    with torch.no_grad():
        expected = oracle_logprobs(ref, head, ids)
    got = ours.token_logprobs(ids)
    assert expected.std() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    routes = [m.route for m in ours.modules() if isinstance(m, Indexer)]
    assert routes and all(r.startswith("indexer: triton fused scores, blocks of ") for r in routes)
    assert all(r.endswith(" queries, fp32") for r in routes)


def test_fp8_quantisation() -> None:
    x = torch.randn(3, 5, 16) * torch.logspace(-3, 2, 5)[:, None]
    values, scale = quantize_fp8_rows(x)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (3, 5)
    torch.testing.assert_close(scale, x.abs().amax(-1) / FP8_MAX)
    assert (values.float().abs().amax(-1) == FP8_MAX).all()
    restored = values.float() * scale[..., None]
    assert ((restored - x).abs() <= x.abs().amax(-1, keepdim=True) * 2**-4).all()  # e4m3: 3 mantissa bits
    zero_values, zero_scale = quantize_fp8_rows(torch.zeros(2, 8))
    assert (zero_values.float() == 0).all() and (zero_scale > 0).all()


def test_fp8_scores_and_selection_match_the_emulation() -> None:
    """fp8 e4m3 operands through `tl.dot` (the interpreter loads them exactly) with per-row scales, against
    the torch path's fp32 emulation of the same quantised values."""
    config = small_config()
    reference, kernel = indexer_pair(config, seed=5, indexer_precision="fp8")
    x, q_resid = inputs(config, 2, 61, seed=5)
    pool_keys = reference.pool_keys(x)
    q, weights = reference._block_queries(x, q_resid)
    q8, query_scale = quantize_fp8_rows(q)
    k8, key_scale = quantize_fp8_rows(pool_keys)
    got = indexer_triton.indexer_scores(
        q8, k8, weights * query_scale, key_scale, 0, 4, reference.softmax_scale
    )
    expected = reference._block_scores(x, q_resid, pool_keys, 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    bf16_like = indexer_pair(config, seed=5)[0]._block_scores(x, q_resid, pool_keys, 0)
    assert (expected - bf16_like).abs().max() > 1e-4  # the emulation does quantise
    selection = kernel.select(x, q_resid)
    assert_same_selection(selection.pools, reference.select(x, q_resid).pools)
    assert kernel.route.endswith(", fp8 e4m3")
    assert reference.route == "indexer: torch blocks of 16 queries, fp8 e4m3 emulated"


def test_routes() -> None:
    config = small_config()
    torch_path = Indexer(config, RunOptions())
    assert torch_path.route == "indexer: auto (resolved at the first forward)"
    assert torch_path.resolve_backend(torch.device("cpu")) == "torch"  # auto off CUDA
    assert torch_path.route == "indexer: torch blocks of 128 queries"
    kernel = Indexer(config, RunOptions(indexer_backend="triton"))
    assert kernel.resolve_backend(torch.device("cpu")) == "triton"
    x, q_resid = inputs(config, 1, 40)
    kernel.select(x, q_resid)
    assert kernel.route == "indexer: triton fused scores, blocks of 48 queries, fp32"


def test_kernel_block_from_memory_bound() -> None:
    indexer = Indexer(small_config(), RunOptions(indexer_backend="triton"))
    assert indexer.kernel_block(1, 2**20, 262_144, 64) == 256  # 1M tokens: 256 MiB of fp32 scores
    assert indexer.kernel_block(1, 65_536, 16_384, 64) == 4096  # 64k tokens
    assert indexer.kernel_block(2, 10**6, 10**9, 64) == 64  # never under one tile
    assert indexer.kernel_block(1, 40, 16_384, 16) == 48  # never over the queries


def test_triton_refused_on_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kernel = Indexer(small_config(), RunOptions(indexer_backend="triton"))
    x, q_resid = inputs(small_config(), 1, 12)
    with pytest.raises(ValueError, match="indexer_backend=triton runs on CUDA tensors, or on the CPU under"):
        kernel.select(x, q_resid)
    with pytest.raises(ValueError, match="indexer_precision must be one of"):
        Indexer(small_config(), RunOptions(indexer_precision="fp4"))


def test_shapes_the_kernel_cannot_take() -> None:
    weights = torch.randn(1, 4, 2)
    with pytest.raises(ValueError, match="head dim 512"):
        indexer_triton.indexer_scores(
            torch.randn(1, 4, 2, 512), torch.randn(1, 3, 512), weights, None, 0, 4, 1.0
        )
    with pytest.raises(ValueError, match="torch.float64"):
        indexer_triton.indexer_scores(
            torch.randn(1, 4, 2, 16, dtype=torch.float64),
            torch.randn(1, 3, 16, dtype=torch.float64),
            weights,
            None,
            0,
            4,
            1.0,
        )
    with pytest.raises(ValueError, match=r"keys \(1, 3, 8\)"):
        indexer_triton.indexer_scores(
            torch.randn(1, 4, 2, 16), torch.randn(1, 3, 8), weights, None, 0, 4, 1.0
        )


def test_fake_tensor_and_flop_formula() -> None:
    with FakeTensorMode():
        q, keys, weights = torch.randn(2, 64, 32, 128), torch.randn(2, 1000, 128), torch.randn(2, 64, 32)
        out = torch.ops.genomelm.indexer_scores(q, keys, weights, None, 0, 4, 0.1)
        scores = torch.ops.genomelm.indexer_scores(q, keys, weights, torch.ones(2, 1000), 0, 4, 0.1)
    assert out.shape == (2, 64, 1000) and out.dtype == torch.float32
    assert scores.shape == (2, 64, 1000) and scores.dtype == torch.float32
    q, keys, weights = torch.randn(1, 20, 2, 16), torch.randn(1, 7, 16), torch.randn(1, 20, 2)
    with FlopCounterMode(display=False) as counter:
        torch.ops.genomelm.indexer_scores(q, keys, weights, None, 0, 4, 0.25)
    # tiles of 16 queries x 32 pools: both query tiles compute the one pool tile, its 7 pools
    assert counter.get_total_flops() == 2 * 17 * 2 * (16 * 7 + 4 * 7)
    with FlopCounterMode(display=False) as counter:
        torch.ops.genomelm.indexer_scores(q[:, :2], keys, weights[:, :2], None, 0, 4, 0.25)
    assert counter.get_total_flops() == 0  # no query sees a complete pool: every tile skipped
    full = indexer_triton.indexer_scores_traffic((1, 64, 32, 128), 16_384, 2)
    assert full > 64 * 16_384 * 4  # at least the scores it writes


def test_fp8_kernel_refused_before_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    kernel = Indexer(small_config(), RunOptions(indexer_backend="triton", indexer_precision="fp8"))
    with pytest.raises(ValueError, match="needs a Hopper or newer GPU .* this one is 8.0"):
        kernel.resolve_backend(torch.device("cuda"))
