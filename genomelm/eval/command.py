"""`genomelm eval CONFIG [key=value ...] [--before PATH] [--after PATH]`.

Scores held-out windows with the model before and after training and writes `results/<run>/buckets.json`,
`buckets.csv` and `loss_by_position.png`. The windows are those of the run's own prepared folder, or with
`heldout=dirA,dirB` those of each folder given (same SEQ and vocabulary), reported side by side: the JSON
then holds one single-folder result per folder under "sets" (see `genomelm.eval.report`).

With `dp`, `cp` or `ep` above 1 the evaluation runs on the training's mesh (`run_scoring`, which `genomelm
probe` uses too): dp * cp processes, local or Ray Train workers (`launcher=ray`), the model split over them as
in training (`genomelm.train.scoring`), the dp replicas scoring different windows. "after" is by default the
run's newest checkpoint, read directly when it is sharded.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Subset

from genomelm.data import DataError, WindowDataset
from genomelm.data.augment import check_compatible
from genomelm.data.windows import Window
from genomelm.eval.buckets import bucketed_loss, compare, relative_change
from genomelm.eval.plot import save_figure
from genomelm.eval.report import WriteError, format_table, write_csv, write_json, write_result_set
from genomelm.model.config import ConfigError
from genomelm.parallel.launch import launch
from genomelm.train.command import check_mesh
from genomelm.train.config import TrainConfig
from genomelm.train.failures import report_failure
from genomelm.train.heldout import pick_windows
from genomelm.train.models import model_pair, run_device
from genomelm.train.plan import PlanError, check_fits
from genomelm.train.ray_launch import RayLaunchError, score_with_ray
from genomelm.train.scoring import (
    Scores,
    ScoringRun,
    WindowShare,
    context_cut_tokens,
    last_bucket_start,
    load_scoring_model,
    score_windows,
    scoring_source,
)


class EvalError(Exception):
    """Bad settings or missing inputs for `genomelm eval`; the message says how to fix it."""

    exit_code = 2  # the user's input (`genomelm.train.failures`)


# what a scoring command (eval, probe, track, variants, embed) reports as one line `genomelm <command>: ...`
SCORING_ERRORS: tuple[type[Exception], ...] = (
    EvalError,
    DataError,
    ConfigError,
    FileNotFoundError,
    ValueError,
    PlanError,
    RayLaunchError,
)


def check_bucket(bucket: int, seq: int) -> int:
    """Number of buckets in a window of `seq` tokens; EvalError unless 1 <= bucket <= seq."""
    if bucket < 1:
        raise EvalError(f"bucket={bucket}: give a positive number of tokens per bucket (default 32768)")
    if bucket > seq:
        raise EvalError(
            f"bucket={bucket} is larger than SEQ ({seq} tokens), so a window holds fewer than "
            f"1 bucket; use bucket<={seq}"
        )
    return -(-seq // bucket)


def context_cut_summary(before: Scores, after: Scores, bucket: int) -> dict:
    """Loss of the last bucket with full context vs context cut to the preceding bucket, per model."""
    start = before.cut_start
    valid, softmask = before.valid[:, start:], before.softmask[:, start:]
    width = valid.shape[1]
    out: dict = {"start": start, "end": start + width, "context": bucket}
    for name, scores in (("before", before), ("after", after)):
        full = bucketed_loss(scores.loss[:, start:], valid, softmask, width)[0]
        cut = bucketed_loss(scores.cut_loss, valid, softmask, width)[0]
        out[name] = {
            "full": full["loss"],
            "full_se": full["se"],
            "cut": cut["loss"],
            "cut_se": cut["se"],
            "cut_change": relative_change(full["loss"], cut["loss"]),
        }
    out["change_full"] = relative_change(out["before"]["full"], out["after"]["full"])
    out["change_cut"] = relative_change(out["before"]["cut"], out["after"]["cut"])
    return out


@dataclass
class HeldoutSet:
    """Windows of one held-out folder to score: its name in tables and figures, the windows, and provenance
    (data_dir, manifest, window coordinates)."""

    name: str
    windows: Sequence[Window]
    provenance: dict


def load_heldout(folder: str | Path, wanted: int, name: str | None = None) -> HeldoutSet:
    """`wanted` held-out windows (0: all) of the prepared `folder`, spread evenly over it and read one at a
    time, as the set `name` (default: the folder's name); EvalError when the folder has none."""
    heldout = WindowDataset(folder, "heldout")
    if not len(heldout):
        raise EvalError(
            f"{heldout.path} has no held-out windows; prepare the data with a held-out region "
            "(genomelm data --heldout ...)"
        )
    indices = pick_windows(len(heldout), wanted)
    provenance = {
        "data_dir": str(heldout.path),
        "manifest": str(heldout.path / "manifest.json"),
        "windows": [{"index": i, **heldout.coordinates(i)} for i in indices],
    }
    return HeldoutSet(heldout.path.name if name is None else name, Subset(heldout, indices), provenance)


def heldout_folders(config: TrainConfig) -> list[Path]:
    """The prepared folders to evaluate: `heldout` (comma-separated) or else the run's own data folder."""
    if not config.eval.heldout:
        return [config.data_dir]
    items = [item.strip() for item in str(config.eval.heldout).split(",")]
    if not all(items):
        raise EvalError(
            f"heldout={config.eval.heldout!r}: an empty folder name; give prepared folders "
            "separated by commas, e.g. "
            "heldout=data/prepared/hg38-512k,data/prepared/mm39-512k"
        )
    repeated = sorted({item for item in items if items.count(item) > 1})
    if repeated:
        raise EvalError(
            f"heldout={config.eval.heldout!r}: {', '.join(repeated)} given twice; give each folder once"
        )
    return [Path(item) for item in items]


def set_names(folders: Sequence[Path]) -> list[str]:
    """Folder names as the sets' labels, or the paths as given when two folders share a name."""
    names = [folder.name or str(folder) for folder in folders]
    return names if len(set(names)) == len(names) else [str(folder) for folder in folders]


def evaluate_sets(
    config: TrainConfig,
    sets: Sequence[HeldoutSet],
    load: Callable[[str], torch.nn.Module],
    before: str,
    after: str,
    share: WindowShare | None = None,
) -> dict:
    """Score every set's windows with `load(before)` and then `load(after)` (each model loaded once); `share`:
    the dp replicas splitting the windows.

    One set gives the single-folder result (settings, buckets, overall, context_cut, provenance); several give
    {"settings", "sets": [{"name", **single-folder result}, ...], "provenance"}.
    """
    if not sets or any(not len(s.windows) for s in sets):
        raise EvalError("no held-out windows to score")
    seqs = {len(s.windows[0].input_ids) for s in sets}
    if len(seqs) > 1:
        raise EvalError(
            f"held-out sets have windows of different lengths {sorted(seqs)}; prepare them with the same SEQ"
        )
    seq = seqs.pop()
    n_buckets = check_bucket(config.eval.bucket, seq)
    context_cut = config.eval.context_cut and last_bucket_start(seq, config.eval.bucket) >= config.eval.bucket
    if config.eval.context_cut and not context_cut:
        print(f"context cut skipped: it needs at least 2 buckets per window, SEQ {seq} has {n_buckets}")
    scores: dict[tuple[str, str], Scores] = {}
    for model_name, path in (("before", before), ("after", after)):
        began = time.perf_counter()
        model = load(path)
        for heldout in sets:
            count = len(heldout.windows)
            print(
                f"scoring {count} window(s) of {heldout.name} with the {model_name} model {path}", flush=True
            )
            scores[heldout.name, model_name] = score_windows(
                model,
                heldout.windows,
                config.eval.bucket,
                context_cut,
                progress=True,
                precision=config.memory.precision,
                share=share,
            )
        del model
        print(f"  {time.perf_counter() - began:.1f} s", flush=True)
    timestamp = datetime.now(UTC).isoformat(timespec="seconds")
    models = {"before_model": before, "after_model": after}
    settings = {"run": config.run, "seq": seq, "bucket": config.eval.bucket, "buckets": n_buckets}
    results = []
    for heldout in sets:
        pair = scores[heldout.name, "before"], scores[heldout.name, "after"]
        rows = [bucketed_loss(s.loss, s.valid, s.softmask, config.eval.bucket) for s in pair]
        results.append(
            {
                "settings": {
                    **settings,
                    "windows": len(heldout.windows),
                    "eval_windows": config.eval.eval_windows,
                    "context_cut": context_cut,
                },
                **compare(*rows),
                "context_cut": context_cut_summary(*pair, config.eval.bucket) if context_cut else None,
                "provenance": {**models, **heldout.provenance, "timestamp": timestamp},
            }
        )
    if len(sets) == 1:
        return results[0]
    return {
        "settings": {
            **settings,
            "eval_windows": config.eval.eval_windows,
            "context_cut": context_cut,
            "heldout": [s.name for s in sets],
        },
        "sets": [{"name": s.name, **result} for s, result in zip(sets, results)],
        "provenance": {**models, "timestamp": timestamp},
    }


def write_outputs(result: dict, folder: Path) -> dict[str, Path]:
    """Write buckets.json, buckets.csv and loss_by_position.png into `folder` (created if needed) as one set,
    `write_result_set`'s set "buckets": readers see the previous three files or the new three, never a mix,
    and a failure (WriteError for a full disk) leaves the previous ones. The probe's files are not touched."""
    paths = write_result_set(
        folder,
        "buckets",
        {
            "buckets.json": lambda path: write_json(result, path),
            "buckets.csv": lambda path: write_csv(result, path),
            "loss_by_position.png": lambda path: save_figure(result, path),
        },
    )
    return {
        "json": paths["buckets.json"],
        "csv": paths["buckets.csv"],
        "figure": paths["loss_by_position.png"],
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    return parse_run_args(
        argv,
        prog="genomelm eval",
        description="Held-out loss per position bucket, before and after training.",
        epilog="example: genomelm eval configs/train/hg38-512k.yaml bucket=65536 eval_windows=8",
    )


def parse_run_args(argv: list[str], prog: str, description: str, epilog: str) -> argparse.Namespace:
    """`CONFIG [key=value ...] [--before PATH] [--after PATH]`, as `genomelm eval` and `genomelm probe`
    take."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog)
    parser.add_argument("config", nargs="?", help="run config YAML (configs/train/...)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="run settings to override")
    parser.add_argument("--before", help="model before training (default: the run's base model)")
    parser.add_argument("--after", help="model after training (default: the run's newest checkpoint)")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = TrainConfig.from_args(([args.config] if args.config else []) + args.overrides)
        check_bucket(config.eval.bucket, config.seq_len)
    except (EvalError, ValueError, FileNotFoundError) as exc:
        return report_failure("genomelm eval", exc)

    try:
        before, after = model_pair(config, args.before, args.after)
        result = run_scoring(evaluate_config, config, before, after)
    except SCORING_ERRORS as exc:
        return report_failure("genomelm eval", exc)
    return print_written(
        "genomelm eval", format_table(result), lambda: write_outputs(result, config.results_path)
    )


def print_written(prog: str, table: str, write: Callable[[], dict[str, Path]]) -> int:
    """Print the result table, `write()` the result's files, then print where its JSON, CSV and figure went:
    0. When the write fails (WriteError: disk full, no permission) the table is printed all the same and the
    error as one line `prog: ...` on stderr: 1."""
    print()
    print(table)
    try:
        paths = write()
    except WriteError as exc:
        return report_failure(prog, exc)
    print(f"\nwrote {paths['json']} and {paths['csv']}")
    print(f"figure: {paths['figure']}")
    return 0


def run_scoring(score: Callable[..., dict], config: TrainConfig, *args: Any) -> dict:
    """`score(config, *args)` in this process, or with dp * cp > 1 or ep > 1 on the run's mesh: dp * cp local
    ranks (`genomelm.parallel.launch`) or Ray Train workers (`launcher=ray`): rank 0's result. On GPUs (or
    planned for them: gpus=N, a Ray cluster) the evaluation is planned first and refused if it cannot fit.
    `score` is a module-level function (the ranks receive it pickled)."""
    check_mesh(config, [config.seq_len])  # dp x cp x ep against the model, windows the cp ranks can split
    cut = context_cut_tokens(config.seq_len, config.eval.bucket, config.eval.context_cut)
    if cut:
        try:
            check_mesh(config, [cut])
        except ValueError as exc:
            raise EvalError(
                f"the context cut scores the last bucket with the one before it, {cut} tokens, which "
                f"cp={config.parallel.cp} cannot split ({exc}); give a bucket= that can, or context_cut=false"
            ) from None
    if (
        torch.cuda.is_available()
        or (config.parallel.launcher == "ray" and config.parallel.ray_address)
        or config.plan.gpus
    ):
        check_fits(config.replace(stage="eval"))
    if config.parallel.launcher == "ray":
        return score_with_ray(_score_on_rank, score, config, *args)
    ranks = config.parallel.world
    if ranks == 1:
        return score(config, *args)
    device = run_device().type
    if device == "cuda" and torch.cuda.device_count() < ranks:
        raise EvalError(
            f"dp={config.parallel.dp} x cp={config.parallel.cp} needs {ranks} GPUs on this machine, found "
            f"{torch.cuda.device_count()}"
        )
    timeout = config.parallel.collective_timeout_s
    return launch(_score_on_rank, ranks, score, config, *args, device=device, collective_timeout_s=timeout)[0]


def _score_on_rank(score: Callable[..., dict], config: TrainConfig, *args: Any) -> dict:
    """`score(config, *args)` on one rank of `run_scoring`'s group; only rank 0 prints its progress."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.parallel.world))
    quiet = dist.get_rank() != 0
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        return score(config, *args)


def evaluate_config(config: TrainConfig, before: str, after: str) -> dict:
    """`genomelm eval`'s result: the run's held-out sets scored with the models `before` and `after`, on this
    rank's place in the run's mesh (or in this one process)."""
    folders = heldout_folders(config)
    check_compatible(folders)  # same SEQ and vocabulary, or an error naming both folders
    names = set_names(folders)
    sets = [load_heldout(folder, config.eval.eval_windows, name) for name, folder in zip(names, folders)]
    run = ScoringRun.from_environment(config)
    load = functools.partial(load_scoring_model, config=config, run=run)
    before, after = scoring_source(before, run), scoring_source(after, run)
    return evaluate_sets(config, sets, load, before, after, run.share)
