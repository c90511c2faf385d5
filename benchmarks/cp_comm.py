"""Context-parallel communication: bytes each rank sends per layer type and per step, and the time it takes.

1. Measured: one training step (forward + backward, recompute, the trainer's `window_loss`) of the `small`
   preset (every block type) over cp=2 gloo processes on this CPU, with every torch.distributed collective
   wrapped: the bytes each rank sends (ring algorithms: all-gather and reduce-scatter send (cp-1) shards,
   all-reduce 2(cp-1)/cp of the buffer), attributed to the exchange that called it, and the wall time inside
   collectives.
2. The same volumes from formulas of the exchanged tensors, checked against (1) at the small config, then
   evaluated at the real GLM-5.3-Flash (bf16) for 512k and 1M-token windows and cp = 2, 4, 8, 16, beside the
   alternative for KDA: a head all-to-all before and after each KDA core (as Megatron's Gated DeltaNet context
   parallelism does), which moves the layer's activations instead of its state.

    .venv/bin/python benchmarks/cp_comm.py
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from genomelm.model import ModelConfig

TOKENS = 2048
WRAPPED = ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_gather")
SOURCES = {  # qualified name of the calling frame -> what the bytes are
    "_ConvHaloExchange": "KDA conv halo",
    "_StateHandOver": "KDA state hand-over",
    "_WindowGather": "DSA keys (latent + pooled index keys)",
    "ContextRun.sum_gradients": "gradient sum (replicated parameters)",
    "ContextRun.global_sum": "loss totals",
}


def _source() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_qualname
        for key, label in SOURCES.items():
            if name.startswith(key):
                direction = " (backward)" if name.endswith("backward") else ""
                return label + direction
        frame = frame.f_back
    return "other"


def measure_rank() -> dict:
    """One step of `small` on this rank with counting collectives; bytes sent per source and seconds."""
    from genomelm.model import load_model
    from genomelm.parallel.context import apply_context_parallel
    from genomelm.parallel.training import ContextRun
    from genomelm.train.memory import LayerRunner
    from genomelm.train.step import window_loss

    cp = dist.get_world_size()
    sent: dict[str, float] = defaultdict(float)
    seconds = [0.0]
    originals = {name: getattr(dist, name) for name in WRAPPED}

    def counting(name: str):
        def call(*args, **kwargs):
            tensor = args[1] if name in ("all_gather_single", "reduce_scatter_single") else args[0]
            if name == "all_gather_single":
                size = tensor.numel() * tensor.element_size() * (cp - 1)
            elif name == "reduce_scatter_single":
                size = tensor.numel() * tensor.element_size() * (cp - 1) / cp
            elif name == "all_reduce":
                size = tensor.numel() * tensor.element_size() * 2 * (cp - 1) / cp
            else:  # all_gather(list, tensor)
                size = args[1].numel() * args[1].element_size() * (cp - 1)
            sent[_source()] += size
            start = time.perf_counter()
            out = originals[name](*args, **kwargs)
            seconds[0] += time.perf_counter() - start
            return out

        return call

    torch.manual_seed(0)
    model = load_model("small")
    context = ContextRun.from_environment()
    apply_context_parallel(model, context.group, context.kind)
    ids = torch.randint(1, 5, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    rows = [ids, labels, (labels != -100).float()]
    runner = LayerRunner(recompute=True, offload=False)
    window_loss(model, rows, runner, context)[0].backward()  # warm-up
    model.zero_grad(set_to_none=True)
    for name in WRAPPED:
        setattr(dist, name, counting(name))
    start = time.perf_counter()
    window_loss(model, rows, runner, context)[0].backward()
    context.sum_gradients(model)
    total = time.perf_counter() - start
    for name, fn in originals.items():
        setattr(dist, name, fn)
    return {"sent": dict(sent), "comm_s": seconds[0], "step_s": total}


def formula(config: ModelConfig, tokens: int, cp: int, elem: int) -> dict[str, float]:
    """Bytes each rank sends per step (forward, recompute, backward) under zigzag CP, from the exchanged
    tensors."""
    local = tokens // cp
    h, k, v = config.linear_num_heads, config.linear_head_dim, config.linear_head_dim
    kda, dsa = len(config.kda_layers), len(config.dsa_layers)
    segments = 2  # zigzag: two segments per rank
    halo = segments * (config.linear_conv_kernel_dim - 1) * 3 * h * k * elem
    summary = segments * h * k * (k + v) * 4  # fp32
    latent = local * config.kv_lora_rank * elem
    pooled_keys = local // config.index_kpool * config.index_head_dim * elem
    # each exchange: an all-gather in the forward and again in the recompute, a reduce-scatter of the gathered
    # buffer in the backward: (cp-1) shards each time, three times per step
    passes = 3
    per_layer = {
        "KDA conv halo": passes * (cp - 1) * halo,
        "KDA state hand-over": passes * (cp - 1) * summary,
        # the pooled index keys only once: the selection is kept for the recompute and takes no gradient
        "DSA keys (latent + pooled index keys)": (cp - 1) * (passes * latent + pooled_keys),
    }
    # Megatron-style head all-to-all: q, k, v (bf16), g (fp32), beta before the core, the output after; each
    # all-to-all sends (cp-1)/cp of the rank's tokens, in the same three passes
    per_token = 3 * h * k * elem + h * k * 4 + h * elem + h * v * elem
    per_layer["KDA head all-to-all (alternative)"] = passes * (cp - 1) / cp * local * per_token
    counts = {
        "KDA conv halo": kda,
        "KDA state hand-over": kda,
        "DSA keys (latent + pooled index keys)": dsa,
        "KDA head all-to-all (alternative)": kda,
    }
    return {name: per_layer[name] * counts[name] for name in per_layer} | {
        f"{name}, per layer": per_layer[name] for name in per_layer
    }


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"


def main() -> None:
    from genomelm.parallel import launch

    results = launch(measure_rank, 2, timeout_s=600)
    rank0 = results[0]
    small = ModelConfig.preset("small")
    predicted = formula(small, TOKENS, 2, elem=4)  # the CPU run is fp32
    print(f"measured: `small` preset, {TOKENS:,} tokens, cp=2 (gloo, this CPU), one step with recompute")
    print("| exchange | bytes sent by rank 0 | formula |\n|---|---|---|")
    grouped: dict[str, float] = defaultdict(float)
    for source, size in sorted(rank0["sent"].items()):
        grouped[source.replace(" (backward)", "")] += size
    for source, size in sorted(grouped.items()):
        print(f"| {source} | {human(size)} | {human(predicted[source]) if source in predicted else '-'} |")
    share = rank0["comm_s"] / rank0["step_s"]
    print(
        f"\ncommunication: {rank0['comm_s']:.2f} s of a {rank0['step_s']:.2f} s step ({share:.1%}) on rank 0"
    )

    real = ModelConfig.preset("glm-5.3-flash")
    print(
        "\nGLM-5.3-Flash (34 KDA + 11 DSA layers, bf16), bytes each rank sends per step (forward, recompute, "
        "backward), gradients and expert traffic not included:"
    )
    print(
        "| window | cp | KDA state + halo (all KDA layers) | DSA keys (all DSA layers) | "
        "KDA head all-to-all instead | per KDA layer: ours / all-to-all |"
    )
    print("|---|---|---|---|---|---|")
    for tokens, label in ((524_288, "512k"), (1_048_576, "1M")):
        for cp in (2, 4, 8, 16):
            f = formula(real, tokens, cp, elem=2)
            ours = f["KDA conv halo"] + f["KDA state hand-over"]
            per_layer = f["KDA conv halo, per layer"] + f["KDA state hand-over, per layer"]
            a2a = f["KDA head all-to-all (alternative), per layer"]
            print(
                f"| {label} | {cp} | {human(ours)} | {human(f['DSA keys (latent + pooled index keys)'])} | "
                f"{human(f['KDA head all-to-all (alternative)'])} | {human(per_layer)} / {human(a2a)} |"
            )


if __name__ == "__main__":
    main()
