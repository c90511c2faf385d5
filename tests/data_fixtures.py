"""Shared helpers for the data-stage tests: the project's real DNA and in-process builds."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from Bio import SeqIO

from genomelm.data import DataConfig, prepare

ROOT = Path(__file__).resolve().parents[1]
DMEL = ROOT / "data" / "dmel_chr4.fa.gz"
DMEL_RECORD = "NC_004353.4"
HG38_FRAGMENTS = ROOT / "tests" / "data" / "hg38_fragments.fa.gz"
HG38_RECORDS = ("chr13:75549820-75605809", "chr4:41257605-41263290")


def read_records(path: Path) -> dict[str, str]:
    """Independent reference: Biopython's parse of a (gzip) FASTA, name -> sequence text."""
    opener = gzip.open if path.read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(path, "rt") as handle:
        return {rec.id: str(rec.seq) for rec in SeqIO.parse(handle, "fasta")}


def write_fasta(path: Path, records: dict[str, str], width: int = 60) -> Path:
    """Plain FASTA with ``width``-letter lines."""
    with open(path, "w") as out:
        for name, seq in records.items():
            out.write(f">{name} generated\n")
            out.writelines(seq[i : i + width] + "\n" for i in range(0, len(seq), width))
    return path


def build(tmp_path: Path, fasta: Path | list[Path], name: str = "out", **settings) -> tuple[Path, list[str]]:
    """``prepare`` into tmp_path/name without progress bars; returns the folder and the log lines."""
    logs: list[str] = []
    files = [str(p) for p in fasta] if isinstance(fasta, list) else [str(fasta)]
    cfg = DataConfig(genome=name, fasta=files, out=str(tmp_path / name), **settings)
    out = prepare(cfg, command="test", progress=False, log=logs.append)
    return out, logs


def fly_windows(out: Path, train: str, seq: int, heldout: str = "200001-201024") -> Path:
    """`genomelm data` on the bundled fly chromosome: training windows of `seq` tokens from region `train`
    ("start-end", 1-based inclusive) and held-out ones from `heldout`, written to `out`."""
    from genomelm.commands.data import main as data_main

    assert (
        data_main(
            [
                f"fasta={DMEL}",
                "genome=fly",
                f"train={DMEL_RECORD}:{train}",
                f"heldout={DMEL_RECORD}:{heldout}",
                f"seq={seq}",
                f"out={out}",
                "progress=false",
            ]
        )
        == 0
    )
    return out


def tiny_run(data: Path, runs_dir: Path, **overrides: object) -> list[str]:
    """`key=value` settings, as `genomelm train` takes them, of a short run "r" of the `tiny` preset on the
    512-token windows in `data`, saving every 2 steps, under `runs_dir`."""
    values = {
        "data": data,
        "seq": 512,
        "model": "tiny",
        "run": "r",
        "runs_dir": runs_dir,
        "wandb": "disabled",
        "warmup_steps": 1,
        "steps": 2,
        "save_every": 2,
    } | overrides
    return [f"{key}={value}" for key, value in values.items()]


def step_losses(runs_dir: Path, run: str) -> dict[int, float]:
    """Step -> training loss, from the run's `metrics.jsonl`."""
    rows = [json.loads(line) for line in (runs_dir / run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}
