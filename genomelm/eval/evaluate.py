"""`genomelm eval`'s work: held-out windows scored with the model before and after training, the loss per
position bucket, and its files `results/<run>/buckets.json`, `buckets.csv` and `loss_by_position.png`.

The windows are those of the run's own prepared folder, or with `heldout=dirA,dirB` those of each folder given
(same SEQ and vocabulary), reported side by side: the JSON then holds one single-folder result per folder
under "sets" (see `genomelm.eval.report`). `evaluate_config` runs on every rank of the run's mesh
(`genomelm.run.launchers.on_ranks`): the model split over the ranks as in training (`genomelm.run.scoring`),
the dp replicas scoring different windows. The command itself is `genomelm.commands.eval`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Subset

from genomelm.data import WindowDataset
from genomelm.data.augment import check_compatible
from genomelm.data.far_copy import predicted_far_copy
from genomelm.data.windows import Window
from genomelm.eval.buckets import bucket_sums, subset_masks
from genomelm.eval.paired import WindowSums, summarise
from genomelm.eval.plot import save_figure
from genomelm.eval.report import write_csv, write_json, write_result_set
from genomelm.eval.window_table import FILE as WINDOWS_FILE
from genomelm.eval.window_table import window_rows, write_windows_csv
from genomelm.run.config import TrainConfig
from genomelm.run.launchers import check_mesh
from genomelm.run.scoring import (
    Scores,
    ScoringRun,
    WindowRule,
    WindowShare,
    context_cut_tokens,
    last_bucket_start,
    load_scoring_model,
    score_windows,
    scoring_source,
)


class EvalError(Exception):
    """Bad settings or missing inputs for `genomelm eval`; the message says how to fix it."""

    exit_code = 2  # the user's input (`genomelm.run.failures`)


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


def window_sums(before: Scores, after: Scores, bucket: int, far_copy: np.ndarray) -> WindowSums:
    """The per-window totals of one held-out set scored by both models (the context cut's when scored);
    far_copy: bool [W, S], the positions whose predicted base is a far copy."""
    pair = [bucket_sums(s.loss, s.valid, s.softmask, bucket, far_copy) for s in (before, after)]
    if before.cut_loss is None or after.cut_loss is None:
        return WindowSums(*pair)
    start = before.cut_start
    masks = subset_masks(before.valid[:, start:], before.softmask[:, start:], far_copy[:, start:])
    cut = [
        {
            prefix: np.where(keep, s.cut_loss.astype(np.float64), 0.0).sum(axis=1)
            for prefix, keep in masks.items()
        }
        for s in (before, after)
    ]
    return WindowSums(*pair, *cut, cut_context=bucket)


@dataclass
class HeldoutSet:
    """Windows of one held-out folder to score: its name in tables and figures, the windows, and provenance
    (data_dir, manifest, window coordinates)."""

    name: str
    windows: Sequence[Window]
    provenance: dict


def load_heldout(
    folder: str | Path, wanted: int, name: str | None = None, min_far_copies: float = 0.0, last: int = 0
) -> HeldoutSet:
    """`wanted` held-out windows (0: all) of the prepared `folder`, spread evenly over it and read one at a
    time, as the set `name` (default: the folder's name); EvalError when the folder has none.

    With `min_far_copies` > 0 only windows whose `last` positions predict at least that share of far-copy
    bases (`genomelm.data.far_copy`, a fact of the sequence alone) are candidates: the rule that picks windows
    where retrieving far context can pay, never looking at a model's loss. The rule and the number of
    candidates are in the provenance."""
    heldout = WindowDataset(folder, "heldout")
    if not len(heldout):
        raise EvalError(
            f"{heldout.path} has no held-out windows; prepare the data with a held-out region "
            "(genomelm data heldout=...)"
        )
    rule = WindowRule(min_far_copies, last)
    indices, candidates, best = rule.pick(heldout, wanted)
    if not indices:
        raise EvalError(
            f"{heldout.path}: no held-out window has >= {min_far_copies:.1%} far-copy bases in its last "
            f"{last:,} positions (the most is {best:.2%}); lower eval_far_copies= or set it to 0"
        )
    provenance = {
        "data_dir": str(heldout.path),
        "manifest": str(heldout.path / "manifest.json"),
        "rule": rule.describe(),
        "candidates": candidates,
        "heldout_windows": len(heldout),
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

    One set gives the single-folder result (settings, buckets, overall, context_cut, contrast, provenance,
    and the per-window rows of `windows.csv` under "window_rows"); several give {"settings", "sets": [{"name",
    **single-folder result}, ...], "provenance"}.
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
        far_copy = np.stack([predicted_far_copy(window) for window in heldout.windows])
        sums = window_sums(
            scores[heldout.name, "before"], scores[heldout.name, "after"], config.eval.bucket, far_copy
        )
        results.append(
            {
                "settings": {
                    **settings,
                    "windows": len(heldout.windows),
                    "eval_windows": config.eval.eval_windows,
                    "eval_far_copies": config.eval.eval_far_copies,
                    "context_cut": context_cut,
                },
                **summarise(sums),
                "provenance": {**models, **heldout.provenance, "timestamp": timestamp},
                "window_rows": window_rows(sums, heldout.provenance.get("windows")),
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
    """Write buckets.json, buckets.csv, windows.csv and loss_by_position.png into `folder` (created if needed)
    as one set, `write_result_set`'s set "buckets": readers see the previous files or the new ones, never a
    mix, and a failure (WriteError for a full disk) leaves the previous ones. The probe's files are not
    touched."""
    paths = write_result_set(
        folder,
        "buckets",
        {
            "buckets.json": lambda path: write_json(result, path),
            "buckets.csv": lambda path: write_csv(result, path),
            WINDOWS_FILE: lambda path: write_windows_csv(result, path),
            "loss_by_position.png": lambda path: save_figure(result, path),
        },
    )
    return {
        "json": paths["buckets.json"],
        "csv": paths["buckets.csv"],
        "windows": paths[WINDOWS_FILE],
        "figure": paths["loss_by_position.png"],
    }


def evaluate_config(config: TrainConfig, before: str, after: str) -> dict:
    """`genomelm eval`'s result: the run's held-out sets scored with the models `before` and `after`, on this
    rank's place in the run's mesh (or in this one process)."""
    folders = heldout_folders(config)
    check_compatible(folders)  # same SEQ and vocabulary, or an error naming both folders
    names = set_names(folders)
    sets = [
        load_heldout(folder, config.eval.eval_windows, name, config.eval.eval_far_copies, config.eval.bucket)
        for name, folder in zip(names, folders)
    ]
    run = ScoringRun.from_environment(config)
    load = functools.partial(load_scoring_model, config=config, run=run)
    before, after = scoring_source(before, run), scoring_source(after, run)
    return evaluate_sets(config, sets, load, before, after, run.share)


def check_context_cut(config: TrainConfig) -> None:
    """Refuse a context cut (the last bucket scored with only the one before it) the run's cp cannot split."""
    cut = context_cut_tokens(config.seq_len, config.eval.bucket, config.eval.context_cut)
    if not cut:
        return
    try:
        check_mesh(config, [cut])
    except ValueError as exc:
        raise EvalError(
            f"the context cut scores the last bucket with the one before it, {cut} tokens, which "
            f"cp={config.parallel.cp} cannot split ({exc}); give a bucket= that can, or context_cut=false"
        ) from None
