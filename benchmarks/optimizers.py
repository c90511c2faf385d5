"""The optimizer choices side by side on `make demo`: each trains the demo's 60 steps from the same start
(configs/train/demo.yaml, on the bundled fly genome, the CPU) and scores the demo's held-out windows at the
end (`eval_every=60`); the table gives the final training loss (the mean of the last 5 steps) and the held-out
loss, each relative to AdamW's.

    python benchmarks/optimizers.py                          # every case (about 18 minutes on 2 cores)
    python benchmarks/optimizers.py --cases adamw adamw8bit  # the fp32 cases (about 6 minutes)

`adamw_bf16` keeps bf16 weights, which the model reads under bf16 autocast, so it runs at precision=bf16;
the table adds AdamW at precision=bf16 too, to tell the optimizer's effect from the precision's. On a CPU
without bf16 matrix units a bf16 demo step is slower than an fp32 one (about 3.4 s against 2.7 s on 2 quiet
cores); two trainings at once on the same cores slow each other several-fold (their thread pools contend).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from demo_runs import train_demo

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("adamw", "auto"),
    ("adamw", "bf16"),
    ("adamw8bit", "auto"),
    ("adamw_bf16", "bf16"),
]


def run_case(optimizer: str, precision: str, steps: int, runs: Path) -> dict[str, float]:
    """Train the demo with `optimizer` at `precision` in a run folder of its own (`demo_runs.train_demo`)."""
    settings = [f"optimizer={optimizer}", f"precision={precision}"]
    return train_demo(f"{optimizer}-{precision}", settings, steps, runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per case (the demo's: 60)")
    parser.add_argument(
        "--cases",
        nargs="+",
        default=None,
        help="optimizers to run (default: all); adamw at the default precision always runs first",
    )
    args = parser.parse_args()
    wanted = set(args.cases or [optimizer for optimizer, _ in CASES])
    # adamw at bf16 is adamw_bf16's reference for the precision: it comes with it
    cases = [
        (optimizer, precision)
        for optimizer, precision in CASES
        if (optimizer, precision) == ("adamw", "auto")
        or (optimizer in wanted and (precision == "auto" or "adamw_bf16" in wanted))
    ]
    subprocess.run(
        [sys.executable, "-m", "genomelm.cli", "data", str(ROOT / "configs/data/demo.yaml")],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    runs = Path(tempfile.mkdtemp(prefix="optimizers-"))
    try:
        results = {case: run_case(*case, args.steps, runs) for case in cases}
    finally:
        shutil.rmtree(runs, ignore_errors=True)
    reference = results[("adamw", "auto")]
    print(f"make demo, {args.steps} steps, each optimizer from the same start (relative to adamw at auto)\n")
    header = f"{'optimizer':<11} {'precision':<9} {'train loss':>10} {'rel':>7} {'held-out':>9} {'rel':>7}"
    print(f"{header} {'s':>6}")
    for (optimizer, precision), r in results.items():
        train_rel = r["train"] / reference["train"] - 1
        heldout_rel = r["heldout"] / reference["heldout"] - 1
        print(
            f"{optimizer:<11} {precision:<9} {r['train']:>10.4f} {train_rel:>+7.2%} "
            f"{r['heldout']:>9.4f} {heldout_rel:>+7.2%} {r['seconds']:>6.0f}"
        )


if __name__ == "__main__":
    main()
