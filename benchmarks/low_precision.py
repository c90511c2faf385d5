"""bf16 gradient reduction and low-precision expert GEMMs side by side on `make demo`: each case trains the
demo's steps from the same start (configs/train/demo.yaml at precision=bf16, on the bundled fly genome, the
CPU) and scores the demo's held-out windows at the end; the table gives, against its reference, the final
training loss (the mean of the last 5 steps), the largest difference of the per-step loss curve, and the
held-out loss, and whether each is within the stated tolerance.

    python benchmarks/low_precision.py                        # every case
    python benchmarks/low_precision.py --group experts        # expert_precision only (one process each)
    python benchmarks/low_precision.py --seq 2k               # the demo's genome and model, 2k-token windows

On 2 shared cores a 16k demo step at bf16 took about 21 s (the 60-step demo: about 20 minutes a case), so the
table in docs/training.md was made at --seq 2k: the same genome, model, steps and schedule on 2,048-token
windows (prepared by this script as data/prepared/demo-2k).

Cases: `reduce` trains on dp=2 (two processes, FSDP2) with reduce_dtype=fp32 (the reference) and bf16;
`experts` trains one process with expert_precision=bf16 (the reference) and fp8_rowwise (torchao's
FP8-rowwise numerics, emulated on the CPU). mxfp8 needs the experts' dims to be multiples of 32; the demo
model's intermediate size is 48, so it is not a case here (tests/test_expert_precision.py holds it to bf16 on
a model whose dims are). A case's curve also differs from its reference by the run-to-run noise of the
different reductions' summation order, so the tolerance is stated on the loss, not bit for bit.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from demo_runs import train_demo

from genomelm.data.regions import parse_seq

ROOT = Path(__file__).resolve().parents[1]
GROUPS = {  # group -> (its reference, the cases against it); each case: (name, settings)
    "reduce": [
        ("dp2 reduce fp32", ["dp=2", "reduce_dtype=fp32"]),
        ("dp2 reduce bf16", ["dp=2", "reduce_dtype=bf16"]),
    ],
    "experts": [
        ("experts bf16", ["expert_precision=bf16"]),
        ("experts fp8_rowwise", ["expert_precision=fp8_rowwise"]),
    ],
}
TOLERANCE = 0.01  # relative: final training loss and held-out loss within 1% of the reference's


def run_case(name: str, settings: list[str], steps: int, seq: str, runs: Path) -> dict:
    """Train the demo with `settings` at precision=bf16 and `seq` in a run folder of its own
    (`demo_runs.train_demo`)."""
    data = f"data={ROOT / 'data/prepared' / f'demo-{seq}'}"
    shape = ["precision=bf16", f"seq={seq}", data, f"bucket={min(parse_seq(seq), 2048)}"]
    return train_demo(name.replace(" ", "-"), [*shape, *settings], steps, runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per case (the demo's: 60)")
    parser.add_argument("--seq", default="16k", help="tokens per window (the demo's: 16k)")
    parser.add_argument("--group", choices=sorted(GROUPS), nargs="+", default=sorted(GROUPS))
    args = parser.parse_args()
    subprocess.run(
        [sys.executable, "-m", "genomelm.cli", "data", str(ROOT / "configs/data/demo.yaml")]
        + ["--seq", args.seq, "--no-progress"],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    runs = Path(tempfile.mkdtemp(prefix="low-precision-"))
    print(f"make demo at precision=bf16, seq {args.seq}, {args.steps} steps, each case from the same start;")
    print("tolerance:", end=" ")
    print(f"the final training loss and the held-out loss within {TOLERANCE:.0%} of the reference (the first")
    print("case of its group); curve max: the largest relative difference of any step's loss\n")
    header = f"{'case':<20} {'train loss':>10} {'rel':>7} {'curve max':>9} {'held-out':>9} {'rel':>7}"
    header += f" {'within':>6}"
    print(f"{header} {'s':>6}", flush=True)
    try:
        for group in args.group:
            reference = None
            for name, settings in GROUPS[group]:
                r = run_case(name, settings, args.steps, args.seq, runs)
                reference = reference or r
                train_rel = r["train"] / reference["train"] - 1
                heldout_rel = r["heldout"] / reference["heldout"] - 1
                curve = max(abs(a / b - 1) for a, b in zip(r["curve"], reference["curve"], strict=True))
                within = abs(train_rel) <= TOLERANCE and abs(heldout_rel) <= TOLERANCE
                print(
                    f"{name:<20} {r['train']:>10.4f} {train_rel:>+7.2%} {curve:>9.2%} {r['heldout']:>9.4f} "
                    f"{heldout_rel:>+7.2%} {'yes' if within else 'NO':>6} {r['seconds']:>6.0f}",
                    flush=True,
                )
    finally:
        shutil.rmtree(runs, ignore_errors=True)


if __name__ == "__main__":
    main()
