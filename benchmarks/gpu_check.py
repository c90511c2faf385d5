"""The project's first contact with a GPU: one script that checks the CUDA paths against the CPU-tested ones
and measures a full-width slice of GLM-5.3-Flash, printing a table (and writing it as JSON). Exits 1 on any
mismatch or error.

    python benchmarks/gpu_check.py --budget-s 420 --json gpu_check.json   # one CUDA GPU ('.[gpu]' installed)
    python benchmarks/gpu_check.py --long ...                             # also the 128k and 512k slices
    python benchmarks/gpu_check.py --cpu-smoke                            # the same code at tiny sizes, CPU

Checks, in this order, one table row each:
1. fla-core `chunk_kda` against the torch KDA path, 64 heads x 128 at 8k tokens: output, final state and the
   gradients of q, k, v, g, beta and the initial state, relative error <= 2e-2 each (skipped without CUDA or
   fla).
1a. Each GPU kernel against its torch path at GLM-5.3-Flash's width, at 32k then 64k tokens (`KERNEL_CHECKS`:
   `benchmarks/kernel_{indexer,dsa,mhc,kda}.py`, whose `check` states its bf16 tolerance): the worst error,
   both times, the speedup against the 3x target, the kernel's TFLOP/s and peaks. Then the slice (4 below) on
   the torch paths, the same weights with the kernels against it (loss, gradient cosines, time), the routes
   with the kernels, and the roofline's projection of the slice beside its measured time by layer kind
   (`benchmarks/roofline_gpu.py`). The checks below follow them.
2. A bf16 train step against fp32 on the `small` preset (torch KDA): loss within 4 * 2^-8 relative, gradient
   cosine >= 0.99 (mHC base vectors >= 0.95).
3. Offload of the kept layer inputs (pinned buffers, side stream) against no offload, bf16 on `small`. Copies
   are exact, but GPU atomics (index_add_, embedding backward) are not deterministic, so the results are
   compared with tolerances (loss 1e-3 relative; gradients 2e-2 relative L2 error, mHC base 1e-1), and the
   run without offload is repeated to show the run-to-run noise beside them.
4. A slice of the real model at full width (3 KDA + 1 DSA layers: hidden 4096, 64 heads, kv_lora 512, indexer
   32 x 128 top-2048 with k-pool 4, MoE with 8 experts all routed (the real model's 8 of 288 per token) plus
   the shared one, 4-stream mHC), forward + backward with per-layer recompute in bf16 at 32k tokens (KDA on
   fla when installed, else the torch path): time of the second step, peak memory, tokens/s and MFU against
   the GPU's dense bf16 peak from two FLOP counts: `step_flops` (analytic) and torch's FlopCounterMode over
   the first step. FlopCounterMode cannot see Triton kernels (fla's KDA) nor triangular solves, so the row
   is a mismatch unless its count equals the analytic count less those parts (`unseen_flops`) within
   FLOP_TOLERANCE.
5. The slice's layer routes: no dense S x S layer may hide in it (the route table is printed too).
6. One trainer step of `tiny` on dp 2 x ep 2 (2 processes, NCCL, FSDP2, fp32) against one process running
   both windows: loss and gradient norm within 1e-4 relative (skipped with fewer than 2 GPUs; on the CPU
   smoke, 2 gloo processes).
6a. The low-bit optimizers' update (`benchmarks/optimizer_update.py`): torchao's update compiled, as CUDA runs
   it, against the eager one on a [4096, 8192] parameter, and its bandwidth at the planner's bytes per value.
6b. The routed experts' low-precision grouped GEMM (`benchmarks/expert_gemm.py`, `expert_precision`):
   torchao's fp8_rowwise (Hopper+) and mxfp8 (Blackwell) kernels against the CPU emulation and bf16, and their
   forward + backward time against bf16 at GLM-5.3-Flash's expert shape (the planner's expert GEMM rate).
7. With --long: the slice at 128k and 512k tokens (skipped without fla: the torch KDA path does not fit).

--budget-s: a check whose estimated time exceeds what is left of the budget is skipped, with the estimate as
its reason (estimates scale the last model step's time by tokens: see `Budget`). --json: the table with every
number behind it, rewritten atomically after every check, so a run cut short still leaves the checks done.

Time of the default run on one H200, estimated (no GPU has run this version): the small-model checks are
launch-bound (a bf16 step of `small` dispatches ~32k aten ops at 1k tokens plus ~7 per token, so ~140k at 16k:
~2 s at ~15 us each), so bf16 vs fp32 ~6 s and offload ~9 s; the 32k slice is 430 TFLOP a step (`step_flops`:
49% routed experts, 25% KDA projections, 10% sparse attention), ~1.2 s at 35% of the bf16 peak, ~15 s for the
check with the model build and FlopCounterMode's Python overhead (~130k ops), a few seconds more on the torch
KDA path; the fla check's two passes take seconds, its first call's Triton compile and autotune 30-120 s (the
one large unknown). With CUDA start-up: 1-3 minutes. --long adds 1.7 and 7.1 PFLOP steps (~1-2 minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import gzip
import importlib
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from importlib import metadata
from pathlib import Path
from typing import Any

if "--cpu-smoke" in sys.argv:  # the kernels run on CPU tensors in Triton's interpreter, set before its import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from genomelm.model import GlmForCausalLM, ModelConfig, RunOptions  # noqa: E402
from genomelm.model.backends import triton_installed  # noqa: E402
from genomelm.model.config import DSA, KDA, MOE  # noqa: E402
from genomelm.model.indexer import TOPK_SORT_RATIO  # noqa: E402
from genomelm.model.kda_chunk import SUB_CHUNK, fla_chunk_kda  # noqa: E402
from genomelm.parallel.training import ParallelRun  # noqa: E402
from genomelm.plan.recording import grouped_mm_flops  # noqa: E402
from genomelm.run.config import OptimConfig  # noqa: E402
from genomelm.train.memory import LayerRunner  # noqa: E402
from genomelm.train.optimizer import make_optimizer  # noqa: E402
from genomelm.train.step import StepOutcome, TrainStep  # noqa: E402

U = 2.0**-8
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "A100": 312.0}  # dense, per GPU
FLOP_TOLERANCE = 0.01  # FlopCounterMode vs the visible part of `step_flops`, relative
# FlopCounterMode has no formula for the grouped GEMM of the routed experts
FLOP_FORMULAS = {torch.ops.aten._grouped_mm: grouped_mm_flops}
GENOME = Path(__file__).resolve().parents[1] / "data" / "dmel_chr4.fa.gz"


# --------------------------------------------------------------------------------------------- analytic FLOPs
def step_flops(config: ModelConfig, options: RunOptions, seq_len: int, recompute: bool) -> dict[str, int]:
    """FLOPs of one training step on one window of `seq_len` tokens, by part of the model: the matmuls (2
    FLOPs per multiply-add) as the model's torch code runs them; fla's kernel runs the same chunked KDA
    algorithm.

    Passes per step: a matmul runs once in the forward, twice in the backward (the gradients of both operands)
    and once more when each layer is recomputed. Exceptions: the indexer runs forward only and once (its
    selection takes no gradient and, kept for the recompute, is not made again); the sparse attention core
    and the loss head recompute their forward inside their own backward (3 backward passes); KDA's
    triangular solves stand apart, being invisible to FlopCounterMode (see `unseen_flops`).

    Left out (under 0.5% from 512 tokens on): the KDA recurrence's first and last chunk have fewer gradients
    (the initial state is a constant zero, the final state unused), and non-reentrant checkpoint does not
    recompute a layer's last residual mix. Assumes the torch paths of DSA (dsa_backend "sparse",
    indexer_backend "torch"), train_indexer off and a KDA gate lower bound (the factorised diagonal blocks of
    `kda_chunk._intra_chunk_scores`); mHC's FLOPs are the same on either of its paths.
    """
    torch_paths = (options.dsa_backend, options.indexer_backend) == ("sparse", "torch")
    if not torch_paths or options.train_indexer:
        raise ValueError(
            "step_flops counts the torch paths of DSA (dsa_backend=sparse, indexer_backend=torch) without "
            "the indexer's KL term"
        )
    t, d, n = seq_len, config.hidden_size, config.hc_mult
    trained = 4 if recompute else 3  # passes of a matmul with gradients: forward, 2 backward, recompute
    flops = dict.fromkeys(
        (
            "mhc",
            "kda projections",
            "kda chunk core",
            "kda triangular solves",
            "dsa projections",
            "dsa indexer",
            "dsa sparse attention",
            "moe routed experts",
            "moe shared expert",
            "dense mlp",
            "head",
        ),
        0,
    )
    for layer in range(config.num_hidden_layers):
        # mHC, twice per layer: the (2+N)*N mixing weights from the N*D-wide streams, the collapse into the
        # block input, and the N x N residual mix after the block
        flops["mhc"] += 2 * (2 * t * n * d * (2 + n) * n + 2 * t * n * d + 2 * t * n * n * d) * trained
        if config.layer_types[layer] == KDA:
            heads, dk = config.linear_num_heads, config.linear_head_dim
            width = heads * dk
            projections = 3 * d * width + 2 * (d * dk + dk * width) + d * heads + width * d  # q|k|v, gates, o
            flops["kda projections"] += 2 * t * projections * trained
            c, blocks = options.kda_chunk_size, math.ceil(t / options.kda_chunk_size) * heads
            # per chunk and head (dv = dk): k.k and q.k scores over the sub-chunk blocks on and below the
            # diagonal, the state recurrence (v - w S, then the state update), the outputs (q S + scores v')
            core = 2 * c * (c + SUB_CHUNK) * dk + 4 * c * dk * dk + 2 * c * dk * dk + 2 * c * c * dk
            # plus, in the backward, the gradient of the triangular matrix: a C x C x 2Dk matmul
            flops["kda chunk core"] += blocks * (core * trained + 2 * c * c * 2 * dk)
            # unit lower triangular solve for u and w (2Dk right-hand sides): forward, recompute, and one
            # transposed solve in the backward
            flops["kda triangular solves"] += blocks * c * (c - 1) * 2 * dk * (trained - 1)
        else:
            heads, latent = config.num_attention_heads, config.kv_lora_rank
            nope, v, q_rank = config.qk_nope_head_dim, config.v_head_dim, config.q_lora_rank
            # q down and up, kv down, W_uk folded into the queries, W_uv and o_proj after the core
            projections = d * q_rank + q_rank * heads * nope + d * latent + heads * nope * latent
            projections += heads * latent * v + heads * v * d
            flops["dsa projections"] += 2 * t * projections * trained
            if config.indexer_types[layer] == "full":
                flops["dsa indexer"] += indexer_flops(config, options, t)
            tail = config.index_kpool - 1 if config.index_kpool_always_select_tail else 0
            slots = config.index_topk // config.index_kpool * config.index_kpool + tail
            # scores and weighted sum over every query's slots in the latent; forward, recompute, 3 backward
            flops["dsa sparse attention"] += 2 * (2 * t * heads * slots * latent) * (trained + 1)
        if config.mlp_layer_types[layer] == MOE:
            inner, k = config.moe_intermediate_size, config.num_experts_per_tok
            router = 2 * t * d * config.n_routed_experts  # fp32 logits of every expert
            flops["moe routed experts"] += (
                router + 6 * t * k * d * inner
            ) * trained  # gate|up, down per pair
            flops["moe shared expert"] += 6 * t * d * inner * config.n_shared_experts * trained
        else:
            flops["dense mlp"] += 6 * t * d * config.intermediate_size * trained
    # logits over the vocabulary: forward, then in the backward recomputed logits and both gradients
    flops["head"] = 2 * t * d * config.vocab_size * 4
    return flops


def indexer_flops(config: ModelConfig, options: RunOptions, seq_len: int) -> int:
    """FLOPs of one indexer's forward over `seq_len` tokens (its only pass in a step): the keys and pool gate
    of every token, then per block of queries (as `Indexer.select` blocks them) their projections and their
    scores against the pools the block scores: those its last query sees, but at least TOPK_SORT_RATIO x the
    pools taken when the window has that many."""
    t, d = seq_len, config.hidden_size
    heads, dim, kpool = config.index_n_heads, config.index_head_dim, config.index_kpool
    n_pools = t // kpool
    take = min(config.index_topk // kpool, n_pools)
    least = min(n_pools, TOPK_SORT_RATIO * take)
    flops = 2 * t * d * 2 * dim  # wk and the pool gate
    block = max(1, options.indexer_query_block)
    for start in range(0, t if take else 0, block):
        size = min(block, t - start)
        visible = min((start + size) // kpool, n_pools)
        if visible:
            flops += 2 * size * (config.q_lora_rank * heads * dim + d * heads)  # wq_b, weights_proj
            flops += 2 * size * heads * (dim + 1) * max(least, visible)  # q.k per head, then the head sum
    return flops


def unseen_flops(parts: dict[str, int], kda_backend: str) -> int:
    """The FLOPs of `step_flops` that FlopCounterMode cannot see: the triangular solves (no formula for them)
    and, on fla, the whole KDA core (Triton kernels)."""
    unseen = parts["kda triangular solves"]
    if kda_backend == "fla":
        unseen += parts["kda chunk core"]
    return unseen


# ------------------------------------------------------------------------------------------------ the table
@dataclasses.dataclass
class Row:
    """One line of the table (and of the JSON). A check returns its row; `run_check` names it."""

    status: str  # "ok", "mismatch", "skipped" or "error"
    note: str = ""  # the numbers behind the status, or why the check was skipped
    seconds: float | None = None  # a measurement's timed step, else the whole check
    peak_gib: float | None = None  # GPU memory allocated at the peak of the check
    tokens_per_s: float | None = None  # measurements only
    mfu_analytic: float | None = None
    mfu_flop_counter: float | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)  # every number (JSON only)
    wall_s: float | None = None  # the whole check, what the budget scales from
    check: str = ""  # the `Check`'s name
    tokens: int = 0  # tokens per step (per comparison), 0 when none run

    @property
    def result(self) -> str:
        return f"{self.status}: {self.note}" if self.note else self.status


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table."""

    def number(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    columns = (
        "check | tokens | time (s) | peak memory (GiB) | tokens/s | MFU analytic | MFU FlopCounter | result"
    )
    lines = [f"| {columns} |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        cells = [
            r.check,
            f"{r.tokens:,}" if r.tokens else "-",
            number(r.seconds, ".2f"),
            number(r.peak_gib, ".1f"),
            number(r.tokens_per_s, ",.0f"),
            number(r.mfu_analytic, ".1%"),
            number(r.mfu_flop_counter, ".1%"),
            r.result,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write `payload` to `path` atomically: a temporary file beside it, then a rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(temp, path)


def package_version(*names: str) -> str:
    """The installed version of the first of these distributions found, else "not installed"."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


# ------------------------------------------------------------------------------------------------- helpers
@dataclasses.dataclass
class Setup:
    """Where the checks run and what is there."""

    device: torch.device
    smoke: bool
    fla: bool  # fla's chunk_kda is usable (installed, on CUDA)
    fla_broken: bool  # fla is installed but its import fails (the fla check then shows the error)
    peak_tflops: float | None  # the GPU's dense bf16 peak, None on the CPU

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mfu(self, flops: float, seconds: float) -> float | None:
        return flops / seconds / (self.peak_tflops * 1e12) if self.peak_tflops else None


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@functools.cache
def fly_chromosome() -> str:
    """The bundled fly chromosome 4, upper case."""
    from Bio import SeqIO

    with gzip.open(GENOME, "rt") as handle:
        return str(next(SeqIO.parse(handle, "fasta")).seq).upper()


def dna(length: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """[1, length] token ids (A=1 C=2 G=3 T=4 N=5) of fly chromosome 4 from base 100,000 + seed, tiled when
    the chromosome is shorter than asked."""
    bases = fly_chromosome()
    start = (100_000 + seed) % len(bases)
    text = (bases[start:] + bases) * (1 + length // len(bases))
    codes = {"A": 1, "C": 2, "G": 3, "T": 4}
    return torch.tensor([[codes.get(b, 5) for b in text[:length]]], device=device)


def window_rows(length: int, window: int, device: torch.device) -> list[torch.Tensor]:
    """The trainer's rows of the window-th stretch of DNA: input_ids, labels (next base, -100 at the end)
    [1, length] long and loss weights [1, length] fp32."""
    ids = dna(length, device, seed=window * length)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    return [ids, labels, (labels != -100).float()]


def forward_backward(model: GlmForCausalLM, ids: torch.Tensor, runner: LayerRunner, bf16: bool) -> float:
    """One forward + backward of the mean next-token loss over ids [1, S]; returns the loss."""
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = model(ids, labels, layer_runner=runner)
    loss.backward()
    return float(loss.detach())


def gradients(model: GlmForCausalLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


# -------------------------------------------------------------------------------------------------- checks
def check_fla_kda(setup: Setup) -> Row:
    """fla's chunk_kda against the torch chunked path through the model's own dispatch (`kda_core`)."""
    from genomelm.model.kda_chunk import kda_core

    device = setup.device
    batch, seq, heads, dim = 1, 8192, 64, 128
    gen = torch.Generator(device).manual_seed(0)

    def inputs() -> list[torch.Tensor]:
        q = torch.randn(batch, seq, heads, dim, device=device, generator=gen, dtype=torch.bfloat16)
        k = torch.randn(batch, seq, heads, dim, device=device, generator=gen, dtype=torch.bfloat16)
        v = torch.randn(batch, seq, heads, dim, device=device, generator=gen, dtype=torch.bfloat16)
        g = -5.0 * torch.rand(batch, seq, heads, dim, device=device, generator=gen)
        beta = torch.rand(batch, seq, heads, device=device, generator=gen, dtype=torch.bfloat16)
        state = torch.randn(batch, heads, dim, dim, device=device, generator=gen)
        return [q, k, v, g, beta, state]

    base = inputs()
    results = {}
    for name in ("fla", "torch"):
        leaves = [t.detach().clone().requires_grad_(True) for t in base]
        q, k, v, g, beta, state = leaves
        out, final = kda_core(name, q, k, v, g, beta, state, 64, gate_bound=5.0)
        weight = torch.randn(out.shape, device=device, generator=torch.Generator(device).manual_seed(1))
        ((out.float() * weight).sum() + final.float().sum()).backward()
        results[name] = [out.float(), final.float()] + [t.grad.float() for t in leaves]
    names = ["output", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial state"]
    errors = {
        name: relative_error(a, b) for name, a, b in zip(names, results["fla"], results["torch"], strict=True)
    }
    limit = 2e-2
    over = {n: e for n, e in errors.items() if e > limit}
    worst = max(errors, key=errors.get)
    note = (
        f"relative error over {limit:.0e}: " + ", ".join(f"{n} {e:.2e}" for n, e in over.items())
        if over
        else f"worst relative error {errors[worst]:.2e} ({worst}), limit {limit:.0e}"
    )
    return Row("mismatch" if over else "ok", note, details=errors)


def small_model(setup: Setup, length: int) -> GlmForCausalLM:
    """`small` on the torch KDA path with index_topk covering the window: an indexer near-tie that bf16 (or a
    GPU's nondeterministic sums) flips would otherwise dominate the comparison."""
    torch.manual_seed(0)
    config = dataclasses.replace(ModelConfig.preset("small"), index_topk=length)
    return GlmForCausalLM.from_config(config, RunOptions(kda_backend="torch"), device=setup.device)


def check_bf16(setup: Setup, length: int) -> Row:
    """A bf16 step against fp32 on `small`."""
    model = small_model(setup, length)
    ids = dna(length, setup.device)
    runner = LayerRunner(recompute=True, offload=False)
    loss32 = forward_backward(model, ids, runner, bf16=False)
    grads32 = gradients(model)
    loss16 = forward_backward(model, ids, runner, bf16=True)
    cosine, worst, worst_base = gradient_cosines(gradients(model), grads32)
    loss_ok = abs(loss16 - loss32) <= 4 * U * loss32
    ok = loss_ok and worst[0] >= 0.99 and worst_base[0] >= 0.95
    note = (
        f"loss {loss16:.5f} vs {loss32:.5f} (limit {4 * U:.1e} relative), worst gradient cosine "
        f"{worst[0]:.4f} ({worst[1]}, limit 0.99), worst mHC base cosine {worst_base[0]:.4f} (limit 0.95)"
    )
    details = {"loss_bf16": loss16, "loss_fp32": loss32, "cosine": cosine}
    return Row("ok" if ok else "mismatch", note, details=details)


def check_offload(setup: Setup, length: int) -> Row:
    """Offload of the kept layer inputs against no offload (bf16 on `small`), and no offload run twice."""
    model = small_model(setup, length)
    ids = dna(length, setup.device)
    plain = LayerRunner(recompute=True, offload=False)
    offloaded = LayerRunner(recompute=True, offload=True)
    runs = {}
    for name, runner in (("plain", plain), ("again", plain), ("offload", offloaded)):
        runs[name] = (forward_backward(model, ids, runner, bf16=True), gradients(model))
    loss, grads = runs["plain"]

    def differences(name: str) -> tuple[float, dict[str, float]]:
        other_loss, other = runs[name]
        return abs(other_loss - loss) / abs(loss), {n: relative_error(other[n], g) for n, g in grads.items()}

    def worst(errors: dict[str, float], base: bool) -> tuple[float, str]:
        return max((e, n) for n, e in errors.items() if n.endswith("hc.base") == base)

    loss_off, errors_off = differences("offload")
    loss_again, errors_again = differences("again")
    (grad_off, grad_name), (base_off, _) = worst(errors_off, False), worst(errors_off, True)
    noise, base_noise = worst(errors_again, False)[0], worst(errors_again, True)[0]
    ok = loss_off <= 1e-3 and grad_off <= 2e-2 and base_off <= 1e-1
    mib = offloaded.copier.bytes_offloaded / 2**20
    note = (
        f"loss {loss_off:.1e} relative (limit 1e-3), worst gradient {grad_off:.1e} ({grad_name}, limit "
        f"2e-2), mHC base {base_off:.1e} (limit 1e-1); without offload run twice: loss {loss_again:.1e}, "
        f"gradients {noise:.1e}, mHC base {base_noise:.1e}; {mib:,.0f} MiB offloaded"
    )
    details = {
        "loss_relative": loss_off,
        "gradient_relative_errors": errors_off,
        "repeat_loss_relative": loss_again,
        "repeat_gradient_relative_errors": errors_again,
        "bytes_offloaded": offloaded.copier.bytes_offloaded,
    }
    return Row("ok" if ok else "mismatch", note, details=details)


# the kernel switches of a slice with its kernels off: the torch paths
TORCH_PATHS = {"indexer_backend": "torch", "dsa_backend": "sparse", "mhc_backend": "torch"}


class SliceModel:
    """The full-width slice (3 KDA + 1 DSA layers at the real widths, 8 experts, DNA vocabulary; small widths
    for the CPU smoke), built at its first use and shared by the slice checks. `kernels`: the Triton kernels
    of the indexer, sparse attention and mHC where they run ("auto": on CUDA), else their torch paths. The
    last `measure_slice` keeps its loss and gradients (`reference`) for the comparison of the two."""

    def __init__(self, setup: Setup, kernels: bool = False) -> None:
        self.setup = setup
        self.kernels = kernels
        self.kda_backend = "fla" if setup.fla else "torch"
        self.reference: tuple[float, dict[str, torch.Tensor]] | None = None
        self.seconds: float | None = None  # the last measured step
        base = ModelConfig.preset("small" if setup.smoke else "glm-5.3-flash")
        self.config = dataclasses.replace(
            base,
            num_hidden_layers=4,
            layer_types=[KDA, KDA, KDA, DSA],
            mlp_layer_types=[MOE] * 4,
            indexer_types=["full"] * 4,
            n_routed_experts=8,
            n_group=1,
            topk_group=1,
            vocab_size=8,
            pad_token_id=0,
        )
        self.options = RunOptions(
            moe_chunk_tokens=8192,
            indexer_query_block=128,
            attention_query_block=128,
            loss_chunk_tokens=2048,
            kda_backend=self.kda_backend,
            **({} if kernels else TORCH_PATHS),
        )
        self.model: GlmForCausalLM | None = None

    @property
    def label(self) -> str:
        return f"KDA {self.kda_backend}, {'kernels' if self.kernels else 'torch paths'}"

    def get(self) -> GlmForCausalLM:
        if self.model is None:
            torch.manual_seed(0)
            self.model = GlmForCausalLM.from_config(self.config, self.options, device=self.setup.device)
        return self.model


def timed_slice_steps(setup: Setup, slice_model: SliceModel, length: int) -> FlopCounterMode:
    """Two forward + backward steps of the slice with recompute in bf16: the first under FlopCounterMode (it
    also warms up: Triton compiles), the second timed; its loss, gradients and seconds are kept in
    `slice_model` (`reference`, `seconds`). Returns the first step's counter."""
    model = slice_model.get()
    ids = dna(length, setup.device, seed=length)
    runner = LayerRunner(recompute=True, offload=False)
    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
        forward_backward(model, ids, runner, bf16=True)
    setup.synchronize()
    start = time.perf_counter()
    loss = forward_backward(model, ids, runner, bf16=True)
    setup.synchronize()
    slice_model.seconds = time.perf_counter() - start
    slice_model.reference = (loss, gradients(model))
    model.zero_grad(set_to_none=True)
    return counter


def gradient_cosines(
    grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
) -> tuple[dict[str, float], tuple[float, str], tuple[float, str]]:
    """Cosine of each gradient with its reference, the worst (cosine, name) apart from the mHC base vectors,
    and the worst of those (they sum nearly cancelling per-token terms: tests/test_model_precision.py)."""
    cosine = {
        n: float(
            torch.nn.functional.cosine_similarity(grads[n].flatten().double(), g.flatten().double(), dim=0)
        )
        for n, g in reference.items()
    }
    worst = min((c, n) for n, c in cosine.items() if not n.endswith("hc.base"))
    worst_base = min((c, n) for n, c in cosine.items() if n.endswith("hc.base"))
    return cosine, worst, worst_base


def measure_slice(setup: Setup, slice_model: SliceModel, length: int) -> Row:
    """The slice's timed step (`timed_slice_steps`), its FLOPs by FlopCounterMode against `step_flops`."""
    counter = timed_slice_steps(setup, slice_model, length)
    seconds = slice_model.seconds
    parts = step_flops(slice_model.config, slice_model.options, length, recompute=True)
    analytic = sum(parts.values())
    unseen = unseen_flops(parts, slice_model.kda_backend)
    counted = counter.get_total_flops()
    off = counted / (analytic - unseen) - 1
    hidden = "triangular solves" + (" and fla's KDA kernels" if slice_model.kda_backend == "fla" else "")
    note = (
        f"FlopCounterMode {counted:.3e} vs analytic {analytic:.3e} less {unseen:.3e} it cannot see "
        f"({hidden}): {off:+.2%} (limit {FLOP_TOLERANCE:.0%})"
    )
    details = {
        "flops_analytic": analytic,
        "flops_flop_counter": counted,
        "flops_unseen": unseen,
        "flops_by_part": parts,
        "kda_backend": slice_model.kda_backend,
    }
    return Row(
        "ok" if abs(off) <= FLOP_TOLERANCE else "mismatch",
        note,
        seconds=seconds,
        tokens_per_s=length / seconds,
        mfu_analytic=setup.mfu(analytic, seconds),
        mfu_flop_counter=setup.mfu(counted, seconds),
        details=details,
    )


def compare_kernel_slice(setup: Setup, kernels: SliceModel, torch_paths: SliceModel, length: int) -> Row:
    """The slice with its Triton kernels against the same weights on the torch paths (whose measured step,
    `torch_paths.reference`, ran just before): two steps (the first warms up: Triton compiles), the second
    timed; loss within 4 bf16 ulps relative, gradient cosine >= 0.99 (mHC base vectors >= 0.95, as the bf16
    check), and the time against the torch paths' step."""
    if torch_paths.reference is None:
        raise RuntimeError("the slice on the torch paths did not run: nothing to compare with")
    loss_ref, grads_ref = torch_paths.reference
    torch_seconds = torch_paths.seconds
    torch_paths.model = None  # free its weights (the reference holds copies of its gradients)
    gc.collect()
    timed_slice_steps(setup, kernels, length)
    loss, grads = kernels.reference
    seconds = kernels.seconds
    cosine, worst, worst_base = gradient_cosines(grads, grads_ref)
    torch_paths.reference = kernels.reference = None  # the gradient copies, freed for the checks after
    loss_ok = abs(loss - loss_ref) <= 4 * U * abs(loss_ref)
    ok = loss_ok and worst[0] >= 0.99 and worst_base[0] >= 0.95
    speedup = torch_seconds / seconds if torch_seconds else float("nan")
    note = (
        f"loss {loss:.5f} vs {loss_ref:.5f} on the torch paths (limit {4 * U:.1e} relative), worst gradient "
        f"cosine {worst[0]:.4f} ({worst[1]}), mHC base {worst_base[0]:.4f}; step {seconds:.2f} s vs "
        f"{torch_seconds:.2f} s: {speedup:.2f}x"
    )
    details = {"loss": loss, "loss_torch_paths": loss_ref, "cosine": cosine, "speedup": speedup}
    return Row(
        "ok" if ok else "mismatch", note, seconds=seconds, tokens_per_s=length / seconds, details=details
    )


# (row name, module in benchmarks/): each module's `check(tokens, device, smoke)` runs one kernel against its
# torch path at GLM-5.3-Flash's width and returns its errors, times and rate
KERNEL_CHECKS = (
    ("Triton indexer vs torch (32 heads x 128, top-2048)", "kernel_indexer"),
    ("Triton sparse MLA vs torch gather (64 heads, latent 512, 2,051 slots)", "kernel_dsa"),
    ("Triton mHC vs torch (4 streams x 4096)", "kernel_mhc"),
    ("fla KDA: bf16, gate in kernel, conv, cp=2 segments vs torch (64 heads x 128)", "kernel_kda"),
)
KERNEL_SPEEDUP_TARGET = 3.0  # issue 18: each kernel at least 3x its torch path at 64k tokens


def check_kernel(setup: Setup, module_name: str, tokens: int) -> Row:
    """One kernel's `check` as a row: ok when its errors are within the module's bf16 tolerance; the speed
    against the 3x target is stated (a kernel slower than that is a finding, not a mismatch)."""
    module = importlib.import_module(module_name)
    result = module.check(tokens, setup.device, smoke=setup.smoke)
    parts = [f"max relative error {result['max_rel_error']:.2e}"]
    if "kernel_ms" in result:
        speedup = result["speedup"]
        target = "meets" if speedup >= KERNEL_SPEEDUP_TARGET else "below"
        parts.append(
            f"torch {result['torch_ms']:.2f} ms, kernel {result['kernel_ms']:.2f} ms: {speedup:.2f}x "
            f"({target} the {KERNEL_SPEEDUP_TARGET:.0f}x target), {result['kernel_tflops']:.1f} TFLOP/s"
        )
    for key in ("torch_peak_gib", "kernel_peak_gib"):
        if result.get(key) is not None:
            parts.append(f"{key.removesuffix('_gib').replace('_', ' ')} {result[key]:.2f} GiB")
    seconds = result["kernel_ms"] / 1e3 if "kernel_ms" in result else None
    return Row("ok" if result["ok"] else "mismatch", "; ".join(parts), seconds=seconds, details=result)


def check_optimizer_update(setup: Setup, optimizer: str) -> Row:
    """The low-bit optimizer's compiled update against its eager one on one [4096, 8192] parameter
    (`benchmarks/optimizer_update.py`), with the compiled update's bandwidth at the planner's bytes."""
    import optimizer_update

    result = optimizer_update.check(setup.device, optimizer)
    note = (
        f"max relative error {result['max_rel_error']:.2e}; compiled {result['compiled_ms']:.2f} ms, eager "
        f"{result['eager_ms']:.2f} ms; {result['planned_bytes_per_value']:.1f} B/value planned: "
        f"{result['measured_gb_s']:,.0f} GB/s"
    )
    return Row(
        "ok" if result["ok"] else "mismatch", note, seconds=result["compiled_ms"] / 1e3, details=result
    )


def check_expert_gemm(setup: Setup, precision: str) -> Row:
    """torchao's low-precision grouped GEMM against its CPU emulation and bf16, and its time against bf16's
    (`benchmarks/expert_gemm.py`)."""
    import expert_gemm

    result = expert_gemm.check(setup.device, precision)
    errors = max(result["vs_emulation"].values()), max(result["vs_bf16"].values())
    note = (
        f"vs emulation {errors[0]:.1e}, vs bf16 {errors[1]:.1e}; fwd+bwd {result['low_ms']:.2f} ms, bf16 "
        f"{result['bf16_ms']:.2f} ms: {result['speedup']:.2f}x"
    )
    return Row("ok" if result["ok"] else "mismatch", note, seconds=result["low_ms"] / 1e3, details=result)


def check_roofline(setup: Setup, slice_model: SliceModel, length: int) -> Row:
    """The roofline's projection of the slice's step beside its measured time, part by part
    (`roofline_gpu.projected_vs_measured`; the table is printed): the first GPU contact's calibration of the
    model. Ok when it ran; the ratios are the finding."""
    import roofline_gpu

    model = slice_model.get()
    ids = dna(length, setup.device, seed=length)
    runner = LayerRunner(recompute=True, offload=False)
    if setup.cuda:
        name = torch.cuda.get_device_name(setup.device)
        gpu = next((g for g in ("B200", "H200", "H100") if g in name), "H200").lower()
    else:
        import roofline_cpu

        gpu = roofline_cpu.cpu_peaks()
    rows = roofline_gpu.projected_vs_measured(model, ids, runner, gpu, repeats=1 if setup.smoke else 3)
    print(roofline_gpu.table(rows), flush=True)
    step = rows[-1]
    ratios = {r["part"]: r["ratio"] for r in rows}
    note = (
        f"step projected {step['projected_ms']:,.1f} ms, measured {step['measured_ms']:,.1f} ms (ratio "
        f"{step['ratio']:.2f}); by part: "
        + ", ".join(f"{p} {r:.2f}" for p, r in ratios.items() if p != "step")
    )
    return Row("ok", note, seconds=step["measured_ms"] / 1e3, details={"parts": rows})


def check_routes(slice_model: SliceModel) -> Row:
    """The slice's layer routes (resolved at its first forward): no dense S x S layer."""
    model = slice_model.get()
    print(model.route_table(), flush=True)
    dense = [layer.layer_idx for layer in model.layers if "dense S x S" in layer.route]
    routes = {layer.layer_idx: layer.route for layer in model.layers}
    note = f"dense S x S layers: {dense}" if dense else "no dense S x S layer; " + routes[0].split(" | ")[0]
    return Row("mismatch" if dense else "ok", note, details={"routes": routes})


def tiny_step(
    model: GlmForCausalLM, parallel: ParallelRun | None, windows: list[list[torch.Tensor]]
) -> tuple[StepOutcome, float]:
    """One trainer step (recompute, fp32, AdamW) over this process's `windows` of a step of 2 windows; returns
    its `StepOutcome` and its time in seconds."""
    device = next(model.parameters()).device
    optim = OptimConfig()
    optimizer = make_optimizer(model, optim, device, sharded=parallel is not None and parallel.fsdp)
    step = TrainStep(
        model, optimizer, LayerRunner(recompute=True, offload=False), parallel, optim, nullcontext, 2
    )
    start = time.perf_counter()
    outcome = step.run(optim.lr, windows)
    return outcome, time.perf_counter() - start


def tiny_model(device: torch.device) -> GlmForCausalLM:
    """`tiny` (every block type) on the torch KDA path, the same on every process: built on the CPU."""
    torch.manual_seed(0)
    return GlmForCausalLM.from_config(ModelConfig.preset("tiny"), RunOptions(kda_backend="torch")).to(device)


def dp_ep_rank(length: int, device_type: str) -> dict[str, float]:
    """This rank's step of `tiny` at dp 2 x ep 2 over the 2 processes of `genomelm.parallel.launch` (FSDP2,
    fp32): window `rank` of the step's 2. Returns the step's loss and gradient norm (the same on every rank),
    its time and this rank's peak GPU memory (0 on the CPU)."""
    import torch.distributed as dist

    from genomelm.parallel.mesh import ParallelDims

    cuda = device_type == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    parallel = ParallelRun.from_environment(ParallelDims(dp=2, ep=2), "zigzag", True, device_type)
    model = tiny_model(device)
    parallel.prepare(model, None, capacity_factor=8.0)
    outcome, seconds = tiny_step(model, parallel, [window_rows(length, dist.get_rank(), device)])
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    return {"loss": outcome.loss, "grad_norm": outcome.grad_norm, "seconds": seconds, "peak_gib": peak}


def check_dp_ep(setup: Setup, length: int) -> Row:
    """dp 2 x ep 2 on 2 processes against one process stepping over both windows."""
    from genomelm.parallel.launch import launch

    windows = [window_rows(length, window, setup.device) for window in (0, 1)]
    reference, _ = tiny_step(tiny_model(setup.device), None, windows)
    kind = setup.device.type
    ranks = launch(dp_ep_rank, 2, length, kind, device=kind, timeout_s=300 if setup.cuda else 120)
    errors = {
        f"rank {rank} {key}": abs(result[key] - getattr(reference, key)) / abs(getattr(reference, key))
        for rank, result in enumerate(ranks)
        for key in ("loss", "grad_norm")
    }
    worst = max(errors.values())
    ok = worst <= 1e-4
    note = (
        f"loss {ranks[0]['loss']:.6f} vs {reference.loss:.6f}, gradient norm {ranks[0]['grad_norm']:.6f} vs "
        f"{reference.grad_norm:.6f}: worst {worst:.1e} relative (limit 1e-4)"
    )
    seconds = ranks[0]["seconds"]
    return Row(
        "ok" if ok else "mismatch",
        note,
        seconds=seconds,
        peak_gib=max(r["peak_gib"] for r in ranks) if setup.cuda else None,
        tokens_per_s=2 * length / seconds,
        details={"reference": {"loss": reference.loss, "grad_norm": reference.grad_norm}, "ranks": ranks},
    )


# -------------------------------------------------------------------------------------------------- runner
@dataclasses.dataclass
class Check:
    """A planned check: its row's name and tokens, the check, and why it cannot run here (None: it can)."""

    name: str
    tokens: int
    run: Callable[[], Row]
    missing: Callable[[], str | None] | None = None
    scales: bool = True  # its time grows with its tokens: a basis for the budget's estimates


class Budget:
    """Seconds left for the checks, and a check's time estimated in proportion to its tokens from the last
    check whose time scales with its tokens (the model steps; not the fla check, whose first call compiles
    and autotunes its kernels, nor the 2-process step, mostly process and NCCL start-up)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.start = time.monotonic()
        self.basis: tuple[str, float, int] | None = None  # name, wall seconds and tokens of that check

    def refusal(self, tokens: int) -> tuple[str, dict[str, float]] | None:
        """Why a check over `tokens` does not fit in what is left, with the numbers; None when it does."""
        if self.seconds is None:
            return None
        left = self.seconds - (time.monotonic() - self.start)
        estimate, basis = 0.0, ""
        if self.basis is not None:
            name, seconds, basis_tokens = self.basis
            estimate = seconds * tokens / basis_tokens
            basis = f" (from {name}: {seconds:.1f} s at {basis_tokens:,} tokens)"
        if estimate <= left:
            return None
        reason = f"budget: ~{estimate:.1f} s needed{basis}, {left:.1f} s of {self.seconds:.0f} s left"
        return reason, {"estimate_s": estimate, "left_s": left}


def run_check(setup: Setup, check: Check, budget: Budget) -> Row:
    """The check's row: skipped when it cannot run here or would overrun the budget; an exception is an error
    row (with its traceback on stderr), so the other checks still run."""
    missing = check.missing() if check.missing is not None else None
    if missing is not None:
        return Row("skipped", missing, check=check.name, tokens=check.tokens)
    refusal = budget.refusal(check.tokens)
    if refusal is not None:
        return Row("skipped", refusal[0], details=refusal[1], check=check.name, tokens=check.tokens)
    start = time.perf_counter()
    try:  # every CUDA call inside: after a sticky CUDA error the later checks fail as rows too
        gc.collect()  # what earlier checks left behind
        if setup.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(setup.device)
        row = check.run()
        setup.synchronize()
    except Exception as exc:  # noqa: BLE001 - one failing check must not cost the others
        traceback.print_exc()
        row = Row("error", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}")
    row.check, row.tokens = check.name, check.tokens
    row.wall_s = time.perf_counter() - start
    if row.seconds is None:
        row.seconds = row.wall_s
    if setup.cuda and row.peak_gib is None:
        row.peak_gib = torch.cuda.max_memory_allocated(setup.device) / 2**30
    if check.scales:
        budget.basis = (check.name, row.wall_s, check.tokens)
    return row


def plan(setup: Setup, long: bool) -> list[Check]:
    """The checks in running order (sizes for the GPU, or tiny ones for the CPU smoke): what only a GPU can
    tell first (fla, the kernels at 32k then 64k, the slice with and without them), then the rest."""
    smoke = setup.smoke
    step_tokens = 1024 if smoke else 16384
    slice_lengths = [512] if smoke else [32768]
    long_lengths = [1024, 2048] if smoke else [131072, 524288]
    kernel_lengths = [64] if smoke else [32768, 65536]
    rank_tokens = 256 if smoke else 2048
    torch_slice = SliceModel(setup)
    kernel_slice = SliceModel(setup, kernels=True)

    def fla_missing() -> str | None:
        if not setup.cuda:
            return "no CUDA (fla's kernels run on GPUs only)"
        return None if setup.fla or setup.fla_broken else "fla not installed (pip install -e '.[gpu]')"

    def kernel_missing(module_name: str) -> Callable[[], str | None]:
        def missing() -> str | None:
            if module_name == "kernel_kda":
                if setup.smoke:
                    return None  # its CPU part: the gate formula, the packed summary, the cp=2 fold
                return fla_missing()
            return None if triton_installed() else "triton not installed (pip install triton)"

        return missing

    def long_missing() -> str | None:
        if setup.cuda and not setup.fla:
            return "no fla (see its row): the torch KDA path does not fit 128k+ tokens at full width"
        return None

    def routes_missing() -> str | None:
        if kernel_slice.model is None:
            return "no slice with kernels ran (the routes resolve at its first forward)"
        return None

    def compare_missing() -> str | None:
        if torch_slice.reference is None:
            return "the slice on the torch paths did not run"
        return None if triton_installed() else "triton not installed (pip install triton)"

    def cuda_missing() -> str | None:
        # the CPU runs the update eagerly; tests/test_optimizers.py holds the compiled one to it there
        return None if setup.cuda else "no CUDA (the compiled update is the GPU's path)"

    def capability_missing(need: tuple[int, int]) -> Callable[[], str | None]:
        def missing() -> str | None:
            if not setup.cuda:
                return "no CUDA (torchao's kernels; tests/test_expert_precision.py holds the emulation)"
            capability = torch.cuda.get_device_capability(setup.device)
            if capability < need:
                found = f"{capability[0]}.{capability[1]}"
                return f"needs compute capability {need[0]}.{need[1]}+, this GPU is {found}"
            return None

        return missing

    def gpus_missing() -> str | None:
        if setup.cuda and torch.cuda.device_count() < 2:
            return f"needs 2 GPUs, this machine has {torch.cuda.device_count()}"
        return None

    def slice_check(length: int, missing: Callable[[], str | None] | None) -> Check:
        name = f"slice at {length:,} tokens (fwd+bwd, recompute, bf16, {torch_slice.label})"
        return Check(name, length, lambda: measure_slice(setup, torch_slice, length), missing)

    def kernel_check(title: str, module_name: str, tokens: int) -> Check:
        return Check(
            f"{title} at {tokens:,} tokens",
            tokens,
            lambda: check_kernel(setup, module_name, tokens),
            kernel_missing(module_name),
            False,
        )

    checks = [
        Check(
            "fla chunk_kda vs torch KDA (64 heads x 128)",
            8192,
            lambda: check_fla_kda(setup),
            fla_missing,
            False,
        ),
        *(
            kernel_check(title, module_name, tokens)
            for tokens in kernel_lengths
            for title, module_name in KERNEL_CHECKS
        ),
        *(slice_check(length, None) for length in slice_lengths),
        *(
            Check(
                f"slice at {length:,} tokens with the kernels vs the torch paths ({kernel_slice.label})",
                length,
                lambda length=length: compare_kernel_slice(setup, kernel_slice, torch_slice, length),
                compare_missing,
            )
            for length in slice_lengths
        ),
        Check(
            "slice routes (with the kernels)", 0, lambda: check_routes(kernel_slice), routes_missing, False
        ),
        Check(
            f"roofline vs measured by layer kind (slice at {slice_lengths[0]:,} tokens, kernels)",
            slice_lengths[0],
            lambda: check_roofline(setup, kernel_slice, slice_lengths[0]),
            None,
            False,
        ),
        Check("bf16 vs fp32 step (small, torch KDA)", step_tokens, lambda: check_bf16(setup, step_tokens)),
        Check("offload vs no offload (small, bf16)", step_tokens, lambda: check_offload(setup, step_tokens)),
        Check(
            f"dp 2 x ep 2 step (tiny, fp32, FSDP2, {'nccl' if setup.cuda else 'gloo'})",
            2 * rank_tokens,
            lambda: check_dp_ep(setup, rank_tokens),
            gpus_missing,
            False,
        ),
        *(
            Check(
                f"{optimizer} update: compiled vs eager, [4096, 8192]",
                0,
                lambda optimizer=optimizer: check_optimizer_update(setup, optimizer),
                cuda_missing,
                False,
            )
            for optimizer in ("adamw8bit", "adamw_bf16")
        ),
        *(
            Check(
                f"expert GEMM {precision} vs emulation and bf16 (4096 x 4096, 8 experts)",
                0,
                lambda precision=precision: check_expert_gemm(setup, precision),
                capability_missing(need),
                False,
            )
            for precision, need in (("fp8_rowwise", (9, 0)), ("mxfp8", (10, 0)))
        ),
    ]
    if long:
        checks.extend(slice_check(length, long_missing) for length in long_lengths)
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="the same checks at tiny sizes on the CPU")
    parser.add_argument("--long", action="store_true", help="also the slice at 128k and 512k tokens")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="skip checks that would not finish in it"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the table here (atomically)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, for MFU")
    args = parser.parse_args(argv)
    budget = Budget(args.budget_s)
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the CPU version", file=sys.stderr)
        return 2
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    try:
        fla, fla_broken = device.type == "cuda" and fla_chunk_kda() is not None, False
    except Exception:  # noqa: BLE001 - not ImportError: installed but broken (e.g. a mismatched triton)
        traceback.print_exc()
        fla, fla_broken = False, True
    setup = Setup(device, smoke, fla, fla_broken, peak)
    versions = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "triton": package_version("triton", "pytorch-triton"),
        "fla": package_version("fla-core", "flash-linear-attention"),
    }
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    where = f"{name} ({gpus} GPU{'s' if gpus != 1 else ''})" if gpus else "the CPU (smoke sizes)"
    header = (
        f"genomelm gpu_check on {where}, "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + (f"; bf16 peak {peak:.0f} TFLOP/s" if peak else "; no bf16 peak known: MFU not computed")
    )
    print(header, flush=True)
    rows: list[Row] = []
    payload: dict[str, Any] = {
        "device": name,
        "gpus": gpus,
        "versions": versions,
        "peak_tflops": peak,
        "smoke": smoke,
        "long": args.long,
        "budget_s": args.budget_s,
        "complete": False,
        "rows": [],
    }
    for check in plan(setup, args.long):
        row = run_check(setup, check, budget)
        rows.append(row)
        print(
            f"[gpu_check {time.monotonic() - budget.start:.0f} s] {row.check}: {row.result}", file=sys.stderr
        )
        if args.json is not None:
            payload["rows"] = [dataclasses.asdict(r) | {"result": r.result} for r in rows]
            payload["elapsed_s"] = time.monotonic() - budget.start
            write_json(args.json, payload)
    if args.json is not None:
        write_json(args.json, payload | {"complete": True})
    print(f"\n{header}\n{table(rows)}")
    return 1 if any(r.status in ("mismatch", "error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
