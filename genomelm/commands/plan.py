"""`genomelm plan CONFIG [gpus=64 gpu=b200 dp= cp= ep= search=true mfu=0.35 stage=eval ...]`: will the run
fit, how fast.

Run settings (`TrainConfig`: dp, cp, ep, fsdp, offload, optimizer_offload, ...) and the planner's assumptions
(the `plan` group: mfu, tflops, nvlink_gbs, nic_gbs, nics_per_node, pcie_gbs, gpus_per_node, host_gib,
imbalance, trace_tokens) are both given as key=value. `stage=eval` plans the evaluator's forward instead of
the training step (its peak per GPU, seconds per window, the whole before/after evaluation). Prints the table
and writes runs/<run>/plan.json (stage=eval: plan-eval.json).
"""

from __future__ import annotations

import argparse
import sys

from genomelm.data import DataError
from genomelm.plan.check import make_plan
from genomelm.plan.memory import TraceCache, resolve_model_config
from genomelm.plan.report import describe, describe_search, refusal, write_plan
from genomelm.plan.search import search
from genomelm.plan.simulate import (
    describe_simulation,
    simulate_eval_layout,
    simulate_layout,
    simulates_cuda,
)
from genomelm.run.config import TrainConfig


def main(argv: list[str]) -> int:

    parser = argparse.ArgumentParser(
        prog="genomelm plan",
        description="Trace one rank's training step (stage=eval: the evaluator's forward) on fake "
        "tensors; say whether the run fits and how fast.",
        epilog="Run settings as key=value (gpus=64 gpu=b200 dp= cp= ep= optimizer_offload=true search=true "
        "stage=eval); "
        "assumptions: mfu, tflops, nvlink_gbs, nic_gbs, nics_per_node, pcie_gbs, gpus_per_node, host_gib, "
        "imbalance, trace_tokens (docs/settings.md).",
    )
    parser.add_argument("config", nargs="?", help="run config YAML (configs/train/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value settings")
    args = parser.parse_args(argv)
    try:
        config = TrainConfig.from_args(([args.config] if args.config else []) + args.overrides)
        config = config.replace(gpus=config.plan.gpus or 64)
        traces = TraceCache()  # the run's own layout's traces serve the search too
        own = make_plan(config, traces=traces)
        plans = search(config.replace(gpus=own.gpus), traces=traces) if config.plan.search else []
    except (ValueError, FileNotFoundError, DataError) as exc:
        print(f"genomelm plan: {exc}", file=sys.stderr)
        return 2
    gpus = f"{own.gpus} x {config.plan.gpu.upper()}"
    print(describe(own))
    evaluating = config.plan.stage == "eval"
    if simulates_cuda(config):  # the stage's own: the training step, or the evaluator's forward
        laid_out = config.replace(dp=own.dp, cp=own.cp, ep=own.ep)
        model_config = resolve_model_config(laid_out)
        simulate = simulate_eval_layout if evaluating else simulate_layout
        simulation, traced = simulate(laid_out, model_config, config.plan.gpu)
        print("\n" + describe_simulation(simulation, laid_out, traced, model_config))
    if config.plan.search:
        order = "the whole evaluation's time" if evaluating else "projected tokens/s"
        print(
            f"\nevery {'evaluation ' if evaluating else ''}layout of {gpus} at {config.seq_len:,} tokens, "
            f"ranked (fitting first, then {order}):\n{describe_search(plans, limit=40)}"
        )
    if not own.fits:  # what `make train` (or the evaluator) would refuse with: check_fits's line
        what = "the evaluation of run" if evaluating else "run"
        print(
            "\n"
            + (
                refusal(config, own, plans)
                if config.plan.search
                else f"{what} {config.run} does not fit; search=true names the best layout of {own.gpus} "
                "GPUs that does"
            )
        )
    print(f"\nwrote {write_plan(config, [own, *plans])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
