"""DSA layers under context parallelism equal CP = 1: outputs, selections, the indexer's KL term and every
gradient; and the whole tiny model (KDA and DSA layers) under CP equals CP = 1.

Each rank (`genomelm.parallel.launch`, gloo, 2 and 4 ranks) builds the same pair of tiny DSA layers (a full
one with its indexer, then a shared one that reuses its selection), runs its shard of the window under
`apply_context_parallel` (queries local, keys gathered) and returns outputs, selections and gradients; the
parent compares them with the plain layers on the whole window. The window is many times index_topk, so the
selection matters, and the tiny preset's two indexer heads give index scores of exactly 0 (both ReLUs 0), so
top-k ties at the selection boundary are common: the ranks must break them as the whole-window indexer does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from genomelm.model import GlmForCausalLM, ModelConfig, RunOptions
from genomelm.model.config import DSA, KDA
from genomelm.model.dsa import DSAAttention
from genomelm.model.indexer import TOPK_SORT_RATIO
from genomelm.parallel import (
    CONTIGUOUS,
    ZIGZAG,
    ContextLayout,
    LayoutError,
    apply_context_parallel,
    exchange,
    launch,
    next_token_labels,
    remove_context_parallel,
)

# ranks import this module: keep it free of transformers (model_helpers)
BATCH = 2
LAUNCH_TIMEOUT_S = 120.0
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}
BLOCKS = {"indexer_query_block": 24, "attention_query_block": 20}  # blocks that straddle the ranks' segments
# window sizes: zigzag cp 4 cuts 8 segments of whole k-pools (4 tokens).
# "full-rows": 128 pools < 64 * K=4, every block scores every pool (topk's nth_element on full rows);
# "cut-rows": 192 pools >= 64 * K=2, blocks score 128..192 pools (topk's partial sort, rows of any length)
PROBLEMS = {"full-rows": (512, 16), "cut-rows": (768, 8)}  # name: (seq_len, index_topk)
MODEL_SEQ_LEN = 512  # zigzag cp 4: 8 segments of 64 tokens (4 KDA chunks of 16, 16 k-pools)
# the whole model in fp32: four layers, MoE and mHC, whose sums over tokens the split reorders
# fp32 throughout: a gradient summed over every token (mHC `scale`, the short conv's weight) rounds
# differently as cp partial sums than as one sum, by an amount that depends on the CPU's kernels (AMD EPYC at
# cp=4: 1.6e-4 for mHC `scale`, 6e-5 for a conv weight; 1e-5 at cp=2); a wrong exchange is off by orders more
MODEL_TOLERANCE = 3e-4
# (problem, layout, dtype, variant): "sparse" / "dense" (dsa_backend), "kl" (sparse with train_indexer, the
# loss adding the indexer's KL term), "bf16" (sparse under bf16 autocast)
CASES = [
    ("full-rows", kind, dtype, "sparse") for kind in (ZIGZAG, CONTIGUOUS) for dtype in ("float64", "float32")
]
CASES += [
    ("cut-rows", ZIGZAG, "float64", "sparse"),
    ("full-rows", ZIGZAG, "float64", "dense"),
    ("full-rows", ZIGZAG, "float64", "kl"),
    ("full-rows", CONTIGUOUS, "float32", "kl"),
    ("full-rows", ZIGZAG, "float32", "bf16"),
]


@dataclasses.dataclass
class Problem:
    """Two DSA layers (full, shared) and their inputs, in fp64 (cast per case)."""

    config: ModelConfig
    weights: tuple[dict[str, Tensor], dict[str, Tensor]]
    x: tuple[Tensor, Tensor]  # [B, S, D] each: the full layer's input, the shared layer's
    out_weights: tuple[Tensor, Tensor]  # the loss is sum(y_i * out_weights_i)


def _problem(seq_len: int, topk: int) -> Problem:
    from model_helpers import randomise_, tiny_config  # parent only (imports transformers)

    config = tiny_config(
        layer_types=[KDA, KDA, DSA, DSA], indexer_types=["full", "full", "full", "shared"], index_topk=topk
    )
    layers = [DSAAttention(config, i).double() for i in (2, 3)]
    for seed, layer in enumerate(layers):
        randomise_(layer, seed=11 + seed)
    gen = torch.Generator().manual_seed(12)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return Problem(
        config=config,
        weights=tuple({n: t.detach().clone() for n, t in layer.state_dict().items()} for layer in layers),
        x=(randn(BATCH, seq_len, config.hidden_size), randn(BATCH, seq_len, config.hidden_size)),
        out_weights=(randn(BATCH, seq_len, config.hidden_size), randn(BATCH, seq_len, config.hidden_size)),
    )


@dataclasses.dataclass
class ModelProblem:
    """The tiny preset (KDA, KDA, KDA, DSA layers; dense MLP then MoE; mHC) with random weights, fp32, and a
    window of token ids [B, S]."""

    config: ModelConfig
    state: dict[str, Tensor]
    input_ids: Tensor


def _model_problem() -> ModelProblem:
    from model_helpers import randomise_, tiny_config  # parent only (imports transformers)

    config = tiny_config()
    model = GlmForCausalLM(config, _model_options())
    randomise_(model, seed=3)
    gen = torch.Generator().manual_seed(4)
    input_ids = torch.randint(1, config.vocab_size, (BATCH, MODEL_SEQ_LEN), generator=gen)
    return ModelProblem(config, {n: t.detach().clone() for n, t in model.state_dict().items()}, input_ids)


def _model_options() -> RunOptions:
    return RunOptions(kda_backend="torch", kda_chunk_size=16, **BLOCKS)


def _run_model(problem: ModelProblem, layout: ContextLayout | None) -> dict[str, Any]:
    """Per-token NLL [B, S] (under CP: this rank's tokens [B, S/cp]) and the gradient of its sum for every
    parameter (under CP: this rank's share)."""
    model = GlmForCausalLM(problem.config, _model_options())
    model.load_state_dict(problem.state)
    changed = []
    if layout is None:
        input_ids, labels = problem.input_ids, next_token_labels(problem.input_ids)
    else:
        changed = apply_context_parallel(model, dist.group.WORLD, layout.kind)
        input_ids, labels, _ = layout.shard_window(problem.input_ids)
    nll = model(input_ids, labels, reduction="none")
    nll.sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {"nll": nll.detach(), "grads": grads, "changed": changed}


def _layers(problem: Problem, dtype: torch.dtype, variant: str) -> list[DSAAttention]:
    options = RunOptions(
        dsa_backend="dense" if variant == "dense" else "sparse", train_indexer=variant == "kl", **BLOCKS
    )
    layers = []
    for index, weights in zip((2, 3), problem.weights):
        layer = DSAAttention(problem.config, index, options)
        layer.load_state_dict(weights)
        layers.append(layer.to(dtype))
    return layers


def _run(
    layers: list[DSAAttention],
    problem: Problem,
    dtype: torch.dtype,
    layout: ContextLayout | None,
    bf16: bool = False,
) -> dict[str, Any]:
    """Forward + backward of the full then the shared layer (whole window when layout is None, else this
    rank's shard); with train_indexer the loss adds the full layer's indexer_loss (under CP: this rank's
    share)."""
    shard = (lambda t: t) if layout is None else layout.shard
    xs = [shard(x).to(dtype, copy=True).requires_grad_(True) for x in problem.x]
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        y_full, selection = layers[0](xs[0])
        y_shared, passed = layers[1](xs[1], shared_selection=selection)
    y_full, y_shared = y_full.to(dtype), y_shared.to(dtype)
    loss = sum((y * shard(w).to(dtype)).sum() for y, w in zip((y_full, y_shared), problem.out_weights))
    kl = layers[0].indexer_loss
    (loss if kl is None else loss + kl).backward()
    return {
        "y": [y_full.detach(), y_shared.detach()],
        "pools": selection.pools,
        "tokens": selection.token_indices(),
        "passed_on": passed is selection,
        "kl": None if kl is None else kl.detach(),
        "grad_x": [x.grad for x in xs],
        "grad_params": [{name: p.grad for name, p in layer.named_parameters()} for layer in layers],
    }


def _rank_cases(problems: dict[str, Problem], model_problem: ModelProblem) -> dict[str, Any]:
    """On each rank: every case of CASES under CP, recording the shapes each collective is handed, a
    recompute with the selection cache, and the whole tiny model (zigzag)."""
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
    for name, kind, dtype_name, variant in CASES:
        problem, dtype = problems[name], getattr(torch, dtype_name)
        layers = _layers(problem, dtype, variant)
        names_before = [[n for n, _ in layer.named_parameters()] for layer in layers]
        changed = [apply_context_parallel(layer, dist.group.WORLD, kind) for layer in layers]
        collectives.clear()
        layout = ContextLayout(
            problem.x[0].shape[1], cp, rank, kind, kda_chunk=1, kpool=problem.config.index_kpool
        )
        result = _run(layers, problem, dtype, layout, bf16=variant == "bf16")
        result["collectives"] = list(collectives)
        result["routes"] = [layer.route for layer in layers]
        result["changed"] = changed
        result["same_names"] = names_before == [[n for n, _ in layer.named_parameters()] for layer in layers]
        result["removed"] = [remove_context_parallel(layer) for layer in layers]
        result["routes_after_remove"] = [layer.route for layer in layers]
        results.append(result)

    # a recompute with the selection cache: no indexer, only the latent is gathered, the same output
    problem = problems["full-rows"]
    layer = _layers(problem, torch.float64, "sparse")[0]
    apply_context_parallel(layer, dist.group.WORLD, ZIGZAG)
    layout = ContextLayout(problem.x[0].shape[1], cp, rank, ZIGZAG, kda_chunk=1)
    x = layout.shard(problem.x[0])
    cache: dict = {}
    with torch.no_grad():
        first, _ = layer(x, selection_cache=cache)
        collectives.clear()
        again, _ = layer(x, selection_cache=cache)
    recompute = {"equal": torch.equal(first, again), "collectives": list(collectives)}
    model_layout = ContextLayout(MODEL_SEQ_LEN, cp, rank, ZIGZAG, kda_chunk=16)
    return {"cases": results, "recompute": recompute, "model": _run_model(model_problem, model_layout)}


@pytest.fixture(scope="module")
def problems() -> dict[str, Problem]:
    return {name: _problem(*sizes) for name, sizes in PROBLEMS.items()}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda cp: f"cp{cp}")
def under_cp(
    request: pytest.FixtureRequest, problems: dict[str, Problem], model_problem: ModelProblem
) -> tuple[int, list[dict[str, Any]]]:
    """(cp, results[rank]): one launch runs every case."""
    return request.param, launch(
        _rank_cases, request.param, problems, model_problem, timeout_s=LAUNCH_TIMEOUT_S
    )


@pytest.fixture(scope="module")
def model_problem() -> ModelProblem:
    return _model_problem()


@pytest.fixture(scope="module")
def model_cp1(model_problem: ModelProblem) -> dict[str, Any]:
    """The plain model on the whole window."""
    return _run_model(model_problem, None)


def _max_error(got: Tensor, expected: Tensor) -> float:
    """Largest |got - expected| relative to the largest |expected| (at least 1)."""
    return ((got - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item()


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(c) for c in CASES])
def test_dsa_layers_under_cp_equal_cp1(under_cp, problems: dict[str, Problem], case: int) -> None:
    """The selected pools and tokens of every query (exactly), the outputs of both layers, the indexer's KL
    term (summed over ranks), the gradients of both inputs and of every parameter: CP (this rank's shard,
    gradients summed over ranks) == the plain layers on the whole window."""
    cp, ranks = under_cp
    name, kind, dtype_name, variant = CASES[case]
    problem, dtype = problems[name], getattr(torch, dtype_name)
    expected = _run(_layers(problem, dtype, variant), problem, dtype, None, bf16=variant == "bf16")
    got = [r["cases"][case] for r in ranks]
    layout = ContextLayout(problem.x[0].shape[1], cp, 0, kind, kda_chunk=1)

    def whole(key: str, i: int | None = None) -> Tensor:
        return layout.restore(torch.cat([g[key] if i is None else g[key][i] for g in got], dim=1))

    assert torch.equal(whole("pools"), expected["pools"])
    assert torch.equal(whole("tokens"), expected["tokens"])
    assert all(g["passed_on"] for g in got)
    pairs = {}
    if variant == "kl":
        assert expected["kl"] > 0
        pairs["indexer_loss"] = (sum(g["kl"] for g in got), expected["kl"])
    for i, layer_name in enumerate(("full", "shared")):
        pairs[f"y {layer_name}"] = (whole("y", i), expected["y"][i])
        pairs[f"grad_x {layer_name}"] = (whole("grad_x", i), expected["grad_x"][i])
        for param, grad in expected["grad_params"][i].items():
            assert grad is not None or (param.startswith("indexer.") and variant != "kl"), param
            if grad is not None:
                pairs[f"grad {layer_name} {param}"] = (sum(g["grad_params"][i][param] for g in got), grad)
    # bf16: each rank's share of a latent gradient is rounded to bf16 before the reduce-scatter sums it, where
    # CP = 1 rounds the whole sum once (a few bf16 ulps); the selection and the outputs are still exact here
    tolerance = 2e-2 if variant == "bf16" else TOLERANCE[dtype]
    errors = {key: _max_error(a, b) for key, (a, b) in pairs.items()}
    worst = max(errors, key=errors.get)
    print(f"cp={cp} {name} {kind} {dtype_name} {variant}: worst {worst} {errors[worst]:.2e}")
    assert errors[worst] <= tolerance, errors
    assert all(g["y"][0].dtype == dtype and g["grad_x"][0].dtype == dtype for g in got)


def test_cp_override_keeps_parameters_and_gathers_once_per_layer(
    under_cp, problems: dict[str, Problem]
) -> None:
    """apply/remove change no parameter name; in forward each layer runs one all-gather (the full layer: the
    latent and the pooled keys packed; the shared layer: the latent), in backward one reduce-scatter (fp32 or
    wider) of the latent's gradient and, with train_indexer, the pooled keys' (which take none otherwise), on
    every rank."""
    cp, ranks = under_cp
    for rank_results in ranks:
        for (name, kind, dtype_name, variant), result in zip(CASES, rank_results["cases"]):
            config, seq_len = problems[name].config, problems[name].x[0].shape[1]
            dtype, local = getattr(torch, dtype_name), seq_len // cp
            latent = BATCH * local * config.kv_lora_rank
            pooled = BATCH * (local // config.index_kpool) * config.index_head_dim
            # the all-gather moves each part's bytes (under bf16 autocast: the latent and the pooled keys in
            # bf16)
            size = 2 if variant == "bf16" else dtype.itemsize
            latent_bytes, pooled_bytes = latent * size, pooled * size
            assert (
                result["changed"] == [[""], [""]]
                and result["removed"] == [[""], [""]]
                and result["same_names"]
            )
            assert all(p.endswith(f"+ context parallel ({kind}, cp {cp})") for p in result["routes"])
            assert all("context parallel" not in p for p in result["routes_after_remove"])
            assert result["collectives"][:2] == [
                ("all_gather", (latent_bytes + pooled_bytes,), torch.uint8),
                ("all_gather", (latent_bytes,), torch.uint8),
            ]
            full_grads = latent + pooled if variant == "kl" else latent
            assert sorted(result["collectives"][2:]) == [
                ("reduce_scatter", (cp * latent,), dtype),
                ("reduce_scatter", (cp * full_grads,), dtype),
            ]


def test_recompute_reuses_the_selection(under_cp, problems: dict[str, Problem]) -> None:
    """With a selection cache, the second call (an activation recompute) gathers only the latent (no indexer
    runs) and gives the same output."""
    cp, ranks = under_cp
    config = problems["full-rows"].config
    local = problems["full-rows"].x[0].shape[1] // cp
    for result in ranks:
        assert result["recompute"]["equal"]
        assert result["recompute"]["collectives"] == [
            ("all_gather", (BATCH * local * config.kv_lora_rank * 8,), torch.uint8)
        ]


def test_selection_boundary_has_ties(problems: dict[str, Problem]) -> None:
    """The cases are not vacuous about ties: many queries' K-th and (K+1)-th best visible index scores are
    equal, and the "cut-rows" window is long enough for the partial-sort path."""
    for name, problem in problems.items():
        config = problem.config
        layer = _layers(problem, torch.float64, "sparse")[0]
        x = problem.x[0]
        seq_len, k = x.shape[1], config.index_topk // config.index_kpool
        with torch.no_grad():
            q_resid = layer.q_a_layernorm(layer.q_a_proj(x))
            scores = layer.indexer._block_scores(x, q_resid, layer.indexer.pool_keys(x), 0)
        visible = torch.arange(seq_len) + 1 >= (k + 1) * config.index_kpool  # queries with > K visible pools
        best = scores[:, visible].topk(k + 1, dim=-1).values
        tied = (best[..., k - 1] == best[..., k]).sum().item()
        print(f"{name}: {tied} of {best.shape[0] * best.shape[1]} queries tied at the boundary")
        assert tied >= 10
    n_pools = PROBLEMS["cut-rows"][0] // 4
    assert n_pools > TOPK_SORT_RATIO * PROBLEMS["cut-rows"][1] // 4
    assert PROBLEMS["full-rows"][0] // 4 < TOPK_SORT_RATIO * PROBLEMS["full-rows"][1] // 4


def test_tiny_model_under_cp_equals_cp1(
    under_cp, model_problem: ModelProblem, model_cp1: dict[str, Any]
) -> None:
    """The whole tiny model with every KDA and DSA layer context-parallel (zigzag): the per-token NLL and
    every parameter's gradient (summed over ranks) equal the plain model on the whole window."""
    cp, ranks = under_cp
    expected = model_cp1
    got = [r["model"] for r in ranks]
    layout = ContextLayout(MODEL_SEQ_LEN, cp, 0, ZIGZAG, kda_chunk=16)
    assert all(
        g["changed"] == [f"layers.{i}.self_attn" for i in range(model_problem.config.num_hidden_layers)]
        for g in got
    )
    errors = {"nll": _max_error(layout.restore(torch.cat([g["nll"] for g in got], dim=1)), expected["nll"])}
    for name, grad in expected["grads"].items():
        if grad is None:
            assert all(g["grads"][name] is None for g in got), name
        else:
            errors[f"grad {name}"] = _max_error(sum(g["grads"][name] for g in got), grad)
    worst = max(errors, key=errors.get)
    print(f"cp={cp} tiny model: worst {worst} {errors[worst]:.2e}")
    assert errors[worst] <= MODEL_TOLERANCE, errors


@pytest.mark.parametrize("kind", [ZIGZAG, CONTIGUOUS])
def test_layout_spans_pools_and_rank_order(kind: str) -> None:
    """A rank's spans are its positions; the pooled layout holds the pools of the rank's tokens; rank_order
    undoes restore; segments that do not hold whole pools are refused."""
    seq_len, cp, kpool = 96, 3, 4
    window = torch.arange(seq_len)[None, :, None].expand(2, -1, 5)
    for rank in range(cp):
        layout = ContextLayout(seq_len, cp, rank, kind, kda_chunk=1, kpool=kpool)
        spans = layout.spans()
        assert torch.equal(torch.cat([torch.arange(s, s + n) for s, n in spans]), layout.positions())
        pooled = layout.pooled(kpool)
        assert torch.equal(pooled.positions() * kpool, layout.positions()[::kpool])
        assert torch.equal(layout.restore(layout.rank_order(window)), window)
    gathered = torch.cat(
        [
            layout.shard(window)
            for layout in (ContextLayout(seq_len, cp, r, kind, kda_chunk=1) for r in range(cp))
        ],
        dim=1,
    )
    assert torch.equal(ContextLayout(seq_len, cp, 0, kind, kda_chunk=1).rank_order(window), gathered)
    with pytest.raises(LayoutError, match="whole 12-token pools"):
        ContextLayout(seq_len, cp, 0, kind, kda_chunk=1, kpool=kpool).pooled(12)
