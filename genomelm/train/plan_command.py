"""`genomelm plan CONFIG [gpus=64 gpu=b200 dp= cp= ep= search=true mfu=0.35 ...]`: will the run fit, how fast.

Run settings (`TrainConfig`: dp, cp, ep, fsdp, offload, optimizer_offload, ...) and the planner's assumptions
(`genomelm.train.plan.Assumptions`: mfu, tflops, nvlink_gbs, ib_gbs, gpus_per_node, imbalance, trace_tokens) are
both given as key=value.
Prints the table and writes runs/<run>/plan.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from genomelm.data import DataError
from genomelm.train.config import TrainConfig


def main(argv: list[str]) -> int:
    from genomelm.train.plan import (
        ASSUMPTION_KEYS,
        _Traces,
        describe,
        describe_search,
        make_plan,
        refusal,
        search,
        write_plan,
    )

    parser = argparse.ArgumentParser(
        prog="genomelm plan",
        description="Trace one rank's training step on fake tensors and say whether the run fits and how fast.",
        epilog=f"Run settings as key=value (gpus=64 gpu=b200 dp= cp= ep= optimizer_offload=true search=true); "
               f"assumptions: "
               f"{', '.join(ASSUMPTION_KEYS)}.",
    )
    parser.add_argument("config", nargs="?", help="run config YAML (configs/train/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value settings")
    args = parser.parse_args(argv)
    settings = [o for o in args.overrides if o.split("=", 1)[0] not in ASSUMPTION_KEYS]
    extra = dict(o.split("=", 1) for o in args.overrides if o.split("=", 1)[0] in ASSUMPTION_KEYS)
    try:
        config = TrainConfig.from_args(([args.config] if args.config else []) + settings)
        config = dataclasses.replace(config, extra=extra, gpus=config.gpus or 64)
        traces = _Traces()  # the run's own layout's traces serve the search too
        own = make_plan(config, traces=traces)
        plans = search(dataclasses.replace(config, gpus=own.gpus), traces=traces) if config.search else []
    except (ValueError, FileNotFoundError, DataError) as exc:
        print(f"genomelm plan: {exc}", file=sys.stderr)
        return 2
    print(describe(own))
    if config.search:
        print(f"\nevery layout of {own.gpus} x {config.gpu.upper()} at {config.seq_len:,} tokens, ranked "
              f"(fitting first, then projected tokens/s):\n{describe_search(plans, limit=40)}")
    if not own.fits:  # what `make train` would refuse with (check_fits prints the same line)
        print("\n" + (refusal(config, own, plans) if config.search else
                      f"run {config.run} does not fit; search=true names the best layout of {own.gpus} GPUs that does"))
    print(f"\nwrote {write_plan(config, [own, *plans])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
