"""The project's first contact with a GPU: one script that checks the CUDA paths against the CPU-tested ones
and measures a full-width slice of GLM-5.3-Flash, printing a table. Exits 1 on any mismatch.

    python benchmarks/gpu_check.py                # on one CUDA GPU (install with pip install -e '.[gpu]')
    python benchmarks/gpu_check.py --cpu-smoke    # the same checks at small shapes on the CPU (run in tests)

Checks:
1. fla-core `chunk_kda` against the torch KDA path: output, input gradients, initial-state gradient, final
   state (CUDA only; skipped, and said so, on the CPU).
2. A bf16 train step against fp32 on the `small` preset: loss within 4 * 2^-8 relative, gradient
   cosine >= 0.99.
3. Offload of the kept layer inputs (pinned buffers and a side stream on CUDA) against no offload: the same
   loss and gradients.
4. A slice of the real model at full width (3 KDA + 1 DSA layers: hidden 4096, 64 heads, kv_lora 512, indexer
   32 x 128 top-2048 with k-pool 4, MoE with 8 of the 288 experts, 4-stream mHC), forward + backward with
   recompute at 32k, 128k and 512k tokens: peak memory, tokens/s and MFU against the GPU's bf16 peak (FLOPs
   counted by torch's FlopCounterMode over the step, recompute included).
5. The layer path table of the slice, so a silent dense fallback cannot hide.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable

import torch

from genomelm.model import GlmForCausalLM, ModelConfig, RunOptions
from genomelm.model.config import DSA, KDA, MOE
from genomelm.train.memory import LayerRunner

U = 2.0**-8
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "A100": 312.0}  # dense, per GPU


@dataclasses.dataclass
class Row:
    check: str
    result: str
    ok: bool | None  # None: a measurement or a check that could not run here, not a pass/fail


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check_fla_kda(device: torch.device, smoke: bool) -> list[Row]:
    from genomelm.model.kda_chunk import fla_chunk_kda, kda_core

    if device.type != "cuda" or fla_chunk_kda() is None:
        why = "no CUDA" if device.type != "cuda" else "fla-core not installed: pip install -e '.[gpu]'"
        return [
            Row("fla chunk_kda vs torch KDA", f"not run ({why})", None if device.type != "cuda" else False)
        ]
    batch, seq, heads, dim = (1, 256, 2, 32) if smoke else (1, 8192, 64, 128)
    gen = torch.Generator(device).manual_seed(0)

    def inputs() -> list[torch.Tensor]:
        q = torch.randn(batch, seq, heads, dim, device=device, generator=gen, dtype=torch.bfloat16)
        k = torch.randn(batch, seq, heads, dim, device=device, generator=gen, dtype=torch.bfloat16)
        v = torch.randn(batch, seq, heads, dim, device=device, generator=gen, dtype=torch.bfloat16)
        g = -5.0 * torch.rand(batch, seq, heads, dim, device=device, generator=gen)
        beta = torch.rand(batch, seq, heads, device=device, generator=gen, dtype=torch.bfloat16)
        state = torch.randn(batch, heads, dim, dim, device=device, generator=gen)
        return [t.requires_grad_(True) for t in (q, k, v, g, beta, state)]

    base = inputs()
    results = {}
    for name in ("fla", "torch"):
        leaves = [t.detach().clone().requires_grad_(True) for t in base]
        q, k, v, g, beta, state = leaves
        out, final = kda_core(name, q, k, v, g, beta, state, 64, gate_bound=5.0)  # the model's own dispatch
        weight = torch.randn(out.shape, device=device, generator=torch.Generator(device).manual_seed(1))
        ((out.float() * weight).sum() + final.float().sum()).backward()
        results[name] = [out.float(), final.float()] + [t.grad.float() for t in leaves]
    names = ["output", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial state"]
    rows = []
    for name, a, b in zip(names, results["fla"], results["torch"], strict=True):
        err = relative_error(a, b)
        rows.append(Row(f"fla vs torch KDA: {name}", f"relative error {err:.2e}", err <= 2e-2))
    return rows


def step(model: GlmForCausalLM, ids: torch.Tensor, runner: LayerRunner, bf16: bool) -> tuple[float, dict]:
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = model(ids, labels, layer_runner=runner)
    loss.backward()
    return float(loss.detach()), {
        n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None
    }


def dna(length: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """[1, length] token ids (A=1 C=2 G=3 T=4 N=5) of the bundled fly chromosome 4, from base 100,000 + seed;
    tiled when the chromosome is shorter than asked."""
    import gzip
    from pathlib import Path

    from Bio import SeqIO

    genome = Path(__file__).resolve().parents[1] / "data" / "dmel_chr4.fa.gz"
    with gzip.open(genome, "rt") as handle:
        bases = str(next(SeqIO.parse(handle, "fasta")).seq).upper()
    codes = {"A": 1, "C": 2, "G": 3, "T": 4}
    start = (100_000 + seed) % len(bases)
    text = (bases[start:] + bases) * (1 + length // len(bases))
    return torch.tensor([[codes.get(b, 5) for b in text[:length]]], device=device)


def check_bf16_and_offload(device: torch.device, smoke: bool) -> list[Row]:
    torch.manual_seed(0)
    length = 1024 if smoke else 16384
    # index_topk covers the window: an indexer near-tie that bf16 flips would otherwise dominate the
    # comparison
    config = dataclasses.replace(ModelConfig.preset("small"), index_topk=length)
    model = GlmForCausalLM.from_config(config, RunOptions(), device=device)
    ids = dna(length, device)
    plain = LayerRunner(recompute=True, offload=False)
    loss32, grads32 = step(model, ids, plain, bf16=False)
    loss16, grads16 = step(model, ids, plain, bf16=True)
    cosine = {
        n: float(
            torch.nn.functional.cosine_similarity(grads16[n].flatten().double(), g.flatten().double(), dim=0)
        )
        for n, g in grads32.items()
    }
    # as tests/test_model_precision.py: the mHC base vectors sum nearly cancelling per-token terms
    worst = min((c, n) for n, c in cosine.items() if not n.endswith("hc.base"))
    worst_base = min((c, n) for n, c in cosine.items() if n.endswith("hc.base"))
    rows = [
        Row(
            "bf16 vs fp32 step (small): loss",
            f"{loss16:.5f} vs {loss32:.5f}",
            abs(loss16 - loss32) <= 4 * U * loss32,
        ),
        Row(
            "bf16 vs fp32 step (small): worst gradient cosine",
            f"{worst[0]:.4f} ({worst[1]})",
            worst[0] >= 0.99,
        ),
        Row(
            "bf16 vs fp32 step (small): worst mHC base cosine",
            f"{worst_base[0]:.4f} ({worst_base[1]})",
            worst_base[0] >= 0.95,
        ),
    ]
    offloaded = LayerRunner(recompute=True, offload=True)
    loss_off, grads_off = step(model, ids, offloaded, bf16=True)
    same = all(torch.equal(grads_off[n], g) for n, g in grads16.items())
    rows.append(
        Row(
            "offload vs no offload (bf16): loss and gradients",
            f"loss equal {loss_off == loss16}, "
            f"gradients equal {same}, {offloaded.copier.bytes_offloaded / 2**20:.0f} MiB offloaded",
            loss_off == loss16 and same,
        )
    )
    return rows


def slice_config(smoke: bool) -> ModelConfig:
    """3 KDA + 1 DSA layers at the real widths, 8 of the 288 experts, DNA vocabulary (smoke: small widths)."""
    base = ModelConfig.preset("small" if smoke else "glm-5.3-flash")
    return dataclasses.replace(
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


def measure_slice(
    device: torch.device, smoke: bool, lengths: list[int], peak_tflops: float | None
) -> list[Row]:
    from torch.utils.flop_counter import FlopCounterMode

    config = slice_config(smoke)
    options = RunOptions(
        moe_chunk_tokens=8192,
        indexer_query_block=128,
        attention_query_block=128,
        loss_chunk_tokens=2048,
        kda_backend="auto",
    )
    torch.manual_seed(0)
    model = GlmForCausalLM.from_config(config, options, device=device)
    runner = LayerRunner(recompute=True, offload=False)
    rows = []
    for length in lengths:
        ids = dna(length, device, seed=length)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            with FlopCounterMode(display=False) as counter:
                step(model, ids, runner, bf16=True)  # counts FLOPs (and warms up)
            start = time.perf_counter()
            step(model, ids, runner, bf16=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        except torch.OutOfMemoryError:
            rows.append(Row(f"slice at {length:,} tokens", "out of memory", False))
            continue
        flops = counter.get_total_flops()
        peak = (
            f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if device.type == "cuda" else "n/a (CPU)"
        )
        mfu = f"{flops / seconds / (peak_tflops * 1e12):.1%}" if peak_tflops else "n/a"
        rows.append(
            Row(
                f"slice at {length:,} tokens (fwd+bwd, recompute, bf16)",
                f"peak {peak}, {length / seconds:,.0f} tokens/s, {flops / length / 1e6:,.1f} MFLOP/token, "
                f"MFU {mfu}",
                None,
            )
        )
    dense = [layer.layer_idx for layer in model.layers if "dense S x S" in layer.route]
    rows.append(
        Row(
            "slice route table: no dense S x S layer",
            "dense layers: " + (str(dense) if dense else "none"),
            not dense,
        )
    )
    print(model.route_table())
    return rows


def gpu_peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="small shapes on the CPU")
    parser.add_argument(
        "--lengths", default=None, help="slice lengths, comma separated (default 32k,128k,512k)"
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak of the GPU for MFU")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    if device.type != "cuda" and not smoke:
        print("no CUDA device: run with --cpu-smoke for the CPU version", file=sys.stderr)
        return 2
    default = "256,512" if smoke else "32768,131072,524288"
    lengths = [int(x) for x in (args.lengths or default).split(",")]
    peak = args.peak_tflops or gpu_peak_tflops(device)
    checks: list[Callable[[], list[Row]]] = [
        lambda: check_fla_kda(device, smoke),
        lambda: check_bf16_and_offload(device, smoke),
        lambda: measure_slice(device, smoke, lengths, peak),
    ]
    rows: list[Row] = []
    for check in checks:
        rows.extend(check())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke shapes)"
    print(f"\ngenomelm gpu_check on {where}, torch {torch.__version__}")
    print("| check | result | status |\n|---|---|---|")
    for row in rows:
        status = (
            ("not run" if row.result.startswith("not run") else "measured")
            if row.ok is None
            else ("ok" if row.ok else "MISMATCH")
        )
        print(f"| {row.check} | {row.result} | {status} |")
    failed = [r for r in rows if r.ok is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
