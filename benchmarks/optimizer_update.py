"""The low-bit optimizers' update on a GPU (`optimizer=adamw8bit | adamw_bf16`): torchao's `single_param_adam`
compiled, as `LowBitAdamW` runs it on CUDA, against the same update run eagerly, on one parameter of an
expert's size, and its time against the planner's cost (`genomelm.plan.optimizer_bytes`: the fused kernel's
bytes at the GPU's memory bandwidth). `benchmarks/gpu_check.py` runs `check` as one row.

    python benchmarks/optimizer_update.py            # one CUDA GPU: a table per optimizer

adamw8bit: the compiled and the eager update give the same weights and moments (fp32 arithmetic; ok within
1e-5 relative). adamw_bf16: stochastic rounding draws different random bits in the two, so their weights may
differ by a bf16 step: ok within 2^-7 relative.
"""

from __future__ import annotations

import time

import torch

from genomelm.train.lowbit import LowBitAdamW, single_param_adam

ROWS, COLS = 4096, 8192  # 33.6M values: one expert's gate/up projection is [2 x 1536, 4096]
STEPS = 3


def updated(optimizer: str, compiled: bool, device: torch.device, rows: int, cols: int) -> dict:
    """The weight and dequantised moments after `STEPS` updates of a seeded parameter and its gradients, and
    the mean seconds of the last update."""
    generator = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if optimizer == "adamw_bf16" else torch.float32
    master = torch.randn(rows, cols, device=device, generator=generator)
    param = torch.nn.Parameter(master.to(dtype))
    opt = LowBitAdamW(
        [{"params": [param], "weight_decay": 0.1}],
        compiled=False,
        lr=1e-3,
        bf16_stochastic_round=optimizer == "adamw_bf16",
    )
    update = (
        torch.compile(single_param_adam, fullgraph=True, dynamic=False) if compiled else single_param_adam
    )
    seconds = 0.0
    for _ in range(STEPS):
        param.grad = torch.randn(rows, cols, device=device, generator=generator).to(dtype)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        opt._update(update, param, opt.param_groups[0])
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    state = opt.state[param]
    return {
        "weight": param.detach().float(),
        "exp_avg": state["exp_avg"].dequantize(torch.float32),
        "exp_avg_sq": state["exp_avg_sq"].dequantize(torch.float32),
        "seconds": seconds,
    }


def check(device: torch.device, optimizer: str) -> dict:
    """Compiled against eager for `optimizer` on one [4096, 8192] parameter: the worst relative error, the
    compiled update's time and bandwidth, and the planner's bytes per value for it."""
    from genomelm.plan.optimizer_bytes import TensorSpec, per_value

    eager = updated(optimizer, False, device, ROWS, COLS)
    fast = updated(optimizer, True, device, ROWS, COLS)
    errors = {
        key: ((fast[key] - eager[key]).norm() / eager[key].norm().clamp_min(1e-30)).item()
        for key in ("weight", "exp_avg", "exp_avg_sq")
    }
    tolerance = 2**-7 if optimizer == "adamw_bf16" else 1e-5
    _, _, fused = per_value(TensorSpec((ROWS, COLS), False, False), optimizer, ROWS * COLS)
    values = ROWS * COLS
    return {
        "optimizer": optimizer,
        "ok": max(errors.values()) <= tolerance,
        "max_rel_error": max(errors.values()),
        "errors": errors,
        "compiled_ms": fast["seconds"] * 1e3,
        "eager_ms": eager["seconds"] * 1e3,
        "planned_bytes_per_value": fused,
        "measured_gb_s": fused * values / fast["seconds"] / 1e9,
    }


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "optimizer_update.py measures the CUDA update: no CUDA here (tests/test_optimizers.py holds the "
            "compiled update to the eager one on the CPU)"
        )
    device = torch.device("cuda")
    print("| optimizer | ok | max rel error | compiled ms | eager ms | planned B/value | GB/s at that |")
    print("|---|---|---|---|---|---|---|")
    for optimizer in ("adamw8bit", "adamw_bf16"):
        r = check(device, optimizer)
        print(
            f"| {optimizer} | {r['ok']} | {r['max_rel_error']:.2e} | {r['compiled_ms']:.2f} | "
            f"{r['eager_ms']:.2f} | {r['planned_bytes_per_value']:.1f} | {r['measured_gb_s']:,.0f} |"
        )


if __name__ == "__main__":
    main()
