"""`genomelm track CONFIG [region=chr:start-end|region=file.bed] [context_cut_tokens=N] [track_bin=N]
[--before PATH] [--after PATH]`: per-base loss tracks for a genome browser.

What is tracked: the run's held-out windows (`eval_windows` of them, 0: all, spread evenly as `genomelm eval`
picks them), or with `region` the bases of a region of the run's source reference, "chr:start-end" (1-based,
inclusive; a bare record name is the whole record) or a BED file (0-based, half-open; intervals must not
overlap). A region is cut into windows of the run's SEQ tokens that start one base before it (where there is
one: its first base is then predicted) and follow each other at a stride of SEQ - 1, so that every base of the
region is predicted exactly once; the last window is shorter and right-padded, as a prepared short window is.

Position mapping: position t of a window starting at genome base s (0-based) is the prediction of token
t + 1, so its loss is the value of base s + t + 1. No window predicts the first base of a held-out window
(nor base 0 of a record): it has no value; nor has a base whose token is N (labels == -100). A base two
windows predict (held-out windows prepared with a stride below SEQ) takes the value of the window that starts
first: the longer context.

Per base, in nats, for the model before and after training (`model_pair`, as `genomelm eval` takes them):
- `before`, `after`: the loss of predicting the base with the window's whole preceding context;
- `change`: after - before (< 0: better after training);
- `long_context_gain_before`, `long_context_gain_after`: short-context loss - full-context loss (> 0: the
  long context lowers the loss). With c = `context_cut_tokens` (0: the run's `bucket`), the short-context
  loss of position t < 2c is its full-context loss (it reads at most 2c tokens anyway, gain 0); for t >= 2c it
  is the loss at t of the 2c-token crop input_ids[s:s + 2c], s = min((t // c - 1) * c, S - 2c): crops of 2c
  tokens at a stride of c, each kept for its second half (the last crop ends at the window's end), so the
  position reads between c + 1 and 2c tokens (itself included). Scored through `token_losses` on
  `Window.cropped` windows, like `score_windows`' context cut; the crops cost about twice the window's
  forward.

With `track_bin` > 1 a value is the mean over the predicted bases of each bin [k * bin, (k + 1) * bin) of the
record (the last bin ends at the record's end); a bin without one is absent.

Output, one set (`write_result_set`'s set "tracks") in results/<run>/tracks/: `<track>.bw` (bigWig, through
pyBigWig) and `<track>.bedGraph` for each track above, `softmask.bed` (the soft-masked, i.e. lower-case
repeat, bases among the predicted ones, runs merged) and `tracks.json` (settings, per-track means,
provenance). All in genome coordinates, 0-based half-open, records named as in the source, the bigWig
header holding every record of the source with its length (read from the source: a samtools .fai, a .2bit
index, or one pass over the file). Windows read from the reverse strand are refused: the tracks are of the
forward strand.

With dp, cp or ep above 1 it runs on the run's mesh as `genomelm eval` does (`run_scoring`): the dp replicas
split the windows (`WindowShare.run`), rank 0 writes.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from genomelm.data.prepare import read_manifest
from genomelm.data.reference import read_reference, source_files
from genomelm.data.regions import Interval, is_bed, read_bed, static_interval
from genomelm.data.vocab import CODE_MASK, IGNORE_INDEX, SOFT_BIT, Vocabulary
from genomelm.data.windows import Window
from genomelm.eval.evaluate import load_heldout
from genomelm.eval.report import format_number, jsonable, write_result_set
from genomelm.run.config import TrainConfig
from genomelm.run.scoring import (
    ScoringRun,
    WindowShare,
    load_scoring_model,
    progress_bar,
    scoring_source,
    token_losses,
)

MODELS = ("before", "after")
DESCRIPTIONS = {
    "before": "loss before training (nats/base)",
    "after": "loss after training (nats/base)",
    "change": "loss after - before training (nats/base; < 0: better after training)",
    "long_context_gain_before": "short-context - full-context loss before training (nats/base; > 0: "
    "the long context helps)",
    "long_context_gain_after": "short-context - full-context loss after training (nats/base; > 0: "
    "the long context helps)",
}
TRACKS = tuple(DESCRIPTIONS)  # before, after, change, long_context_gain_before, long_context_gain_after
CHUNK = 1 << 20  # entries per pyBigWig call and per bedGraph write: bounds the transient lists and text


class TrackError(Exception):
    """Bad `genomelm track` settings or inputs; the message names the file or setting and the fix."""

    exit_code = 2  # the user's input (`genomelm.run.failures`)


# ------------------------------------------------------------------------------------ the short context
def cut_tokens(config: TrainConfig, seq: int) -> int:
    """The short context c (tokens): `context_cut_tokens`, or the run's `bucket` when 0; TrackError unless a
    window of `seq` tokens has a position reading more than 2c tokens (2c < seq)."""
    cut = config.track.context_cut_tokens or config.eval.bucket
    if 2 * cut >= seq:
        given = f"context_cut_tokens={cut}" if config.track.context_cut_tokens else f"bucket={cut}"
        raise TrackError(
            f"{given}: the long-context gain compares the full context with crops of 2 x {cut} tokens, and "
            f"a window of SEQ {seq:,} tokens has no position beyond {2 * cut:,}; give "
            f"context_cut_tokens={max(1, (seq - 1) // 4)} (at most {(seq - 1) // 2})"
        )
    return cut


def short_context_crops(seq: int, cut: int) -> list[tuple[int, slice]]:
    """(first position read, positions kept) of each 2c-token crop of a window of `seq` positions, c = `cut`:
    the crop reading [s, s + 2c) gives the short-context loss of the kept positions, [(k + 1) c, (k + 2) c)
    for crop k = 1, 2, ..., with s = min(k c, seq - 2c). Positions [0, 2c) are in no crop (see the module
    docstring); needs 2c < seq."""
    return [
        (min(k * cut, seq - 2 * cut), slice((k + 1) * cut, min((k + 2) * cut, seq)))
        for k in range(1, -(-seq // cut) - 1)
    ]


def short_context_losses(
    model: torch.nn.Module, window: Window, cut: int, full: np.ndarray, precision: str
) -> np.ndarray:
    """float32 [S] loss of every position of `window` with its context cut to c..2c tokens, c = `cut`: `full`
    (its full-context loss, [S]) before position 2c, each crop's second half after it."""
    short = full.copy()
    for start, keep in short_context_crops(len(window.ids), cut):
        losses = token_losses(model, window.cropped(start, 2 * cut), precision)
        short[keep] = losses[keep.start - start : keep.stop - start]
    return short


def score_tracks(
    model: torch.nn.Module,
    windows: Sequence[Window],
    cut: int,
    precision: str = "auto",
    progress: bool = False,
    share: WindowShare | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(full-context, short-context) loss, float32 [S] each (nats, 0 where the label is ignored), of every
    window, in order; with `share` the dp replicas split the windows (one job per window: its forward and its
    crops', the same passes for every window), the losses gathered on every rank."""

    def job(i: int) -> tuple[np.ndarray, np.ndarray]:
        window = windows[i]
        valid = (window.labels != IGNORE_INDEX).numpy()
        full = np.where(valid, token_losses(model, window, precision), 0.0).astype(np.float32)
        short = short_context_losses(model, window, cut, full, precision)
        return full, np.where(valid, short, 0.0).astype(np.float32)

    model.eval()
    with torch.no_grad():
        return (share or WindowShare()).run(
            [functools.partial(job, i) for i in range(len(windows))],
            progress_bar("track", "window") if progress else None,
        )


# ---------------------------------------------------------------------------- the source reference
@dataclass(frozen=True)
class RegionBases:
    """The bases a region's windows read: scan codes (uint8, `SCAN_BYTES`: code | soft-mask bit) of bases
    [first, interval end) of the record, `first` being the base before the interval (0 at the record's
    start)."""

    interval: Interval
    first: int
    scan: np.ndarray


@dataclass(frozen=True)
class TrackPlan:
    """What `genomelm track` reads, found before any model is loaded: every record of the run's source
    reference with its length (file order: the bigWig header), the source files, and with `region` the bases
    of each interval (None: the held-out windows); the prepared folder's SEQ and vocabulary, to cut them."""

    sizes: dict[str, int]
    sources: list[str]
    regions: list[RegionBases] | None
    seq: int
    vocab: Vocabulary


def parse_region(spec: str, sizes: dict[str, int], sources: Sequence[str]) -> list[Interval]:
    """The intervals `region=spec` selects in the reference of `sizes` (read from the files `sources`),
    sorted by record (file order) and start: a BED file's lines (`read_bed`: a bad line is a DataError naming
    the file and line), "chr:start-end" (1-based, inclusive) or a record name. TrackError for an absent
    record, an interval past its record's end, or two intervals that overlap."""
    if is_bed(spec):
        intervals = read_bed(spec, "region").intervals
    elif spec in sizes:  # a record name, also one such as UCSC's "chrUn:1-2" that looks like a region
        intervals = [Interval("region", spec, spec, 0, sizes[spec])]
    else:
        intervals = [static_interval(spec, "region")]
    names = list(sizes)
    checked = []
    for interval in intervals:
        if interval.record not in sizes:
            shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
            raise TrackError(
                f"{_named(interval)}: no record {interval.record!r} in {', '.join(sources)} (records: "
                f"{shown}); give chr:start-end (1-based, inclusive) or a BED file of the run's source "
                "reference"
            )
        size = sizes[interval.record]
        end = size if interval.end is None else interval.end
        if end > size:
            raise TrackError(
                f"{_named(interval)}: ends at base {end:,} but record {interval.record} has {size:,} bases; "
                "fix the region's end"
            )
        checked.append(
            Interval("region", interval.spec, interval.record, interval.start, end, interval.origin)
        )
    order = {name: i for i, name in enumerate(names)}
    checked.sort(key=lambda iv: (order[iv.record], iv.start))
    for left, right in zip(checked, checked[1:]):
        if left.record == right.record and right.start < (left.end or 0):
            raise TrackError(
                f"{_named(left)} and {_named(right)} share bases of {left.record}; a track holds one value "
                "per base: merge them (bedtools merge) or track them in separate runs"
            )
    return checked


def _named(interval: Interval) -> str:
    """How messages name a region: `region=chr4:1-100`, or `held.bed line 3 (chr4:1-100)`."""
    return f"{interval.origin} ({interval.spec})" if interval.origin else f"region={interval.spec}"


def plan_tracks(config: TrainConfig) -> TrackPlan:
    """The run's source reference (from the prepared folder's manifest) read for the tracks: record lengths
    and, with `region`, its bases. TrackError (or DataError) for a bad region, a missing or changed source, or
    held-out windows the source does not hold."""
    folder = config.data_dir
    manifest = read_manifest(folder)
    if manifest is None:
        raise TrackError(
            f"{folder}: not a prepared data folder (no manifest.json); run `genomelm data` first"
        )
    paths = source_files(folder, manifest)
    seq, vocab = int(manifest["seq_len"]), Vocabulary.from_json(manifest["vocab"])
    sizes, _ = read_reference(paths, {})
    if not config.region:
        windows = manifest["splits"]["heldout"]["windows"]
        for i, end in enumerate(windows["end"]):
            record = windows["records"][windows["record"][i]]
            if sizes.get(record, -1) < end:
                raise TrackError(
                    f"{folder}: held-out window {i} ({record}:{windows['start'][i] + 1}-{end}) is not in its "
                    f"source ({', '.join(map(str, paths))}); prepare the data again ({manifest['command']} "
                    "force=true)"
                )
        return TrackPlan(sizes, [str(p) for p in paths], None, seq, vocab)
    intervals = parse_region(str(config.region), sizes, [str(p) for p in paths])
    wanted: dict[str, list[tuple[int, int]]] = {}
    for interval in intervals:
        assert interval.end is not None  # parse_region gives every interval its end
        wanted.setdefault(interval.record, []).append((max(interval.start - 1, 0), interval.end))
    _, bases = read_reference(paths, wanted)  # a second pass over a streamed source: the bases only now
    regions = [
        RegionBases(iv, max(iv.start - 1, 0), bases[iv.record, max(iv.start - 1, 0)]) for iv in intervals
    ]
    return TrackPlan(sizes, [str(p) for p in paths], regions, seq, vocab)


def region_windows(regions: Sequence[RegionBases], seq: int, vocab: Vocabulary) -> list[Window]:
    """Windows of `seq` tokens over each region's bases: from its `first` base at a stride of seq - 1 (each
    window's first base is the last one the window before predicts), the last right-padded."""
    code_to_id = np.asarray(vocab.code_to_id, dtype=np.int64)
    windows: list[Window] = []
    for part in regions:
        end = part.first + len(part.scan)
        for start in range(part.first, end - 1, seq - 1):
            stop = min(start + seq, end)
            scan = part.scan[start - part.first : stop - part.first]
            codes = np.zeros(seq, dtype=np.int64)  # code 0: padding
            codes[: len(scan)] = scan & CODE_MASK
            mask = np.zeros(seq, dtype=bool)
            mask[: len(scan)] = scan >= SOFT_BIT
            ids = torch.from_numpy(code_to_id[codes])
            windows.append(
                Window(
                    "region",
                    len(windows),
                    part.interval.record,
                    start,
                    stop,
                    ids,
                    torch.from_numpy(mask),
                    vocab,
                )
            )
    return windows


# ------------------------------------------------------------------------------- per-base values
@dataclass(frozen=True)
class TrackInput:
    """The windows to track (all of SEQ tokens), every record's length (the bigWig header, in order) and where
    the windows came from (for tracks.json)."""

    windows: Sequence[Window]
    sizes: dict[str, int]
    provenance: dict


@dataclass
class RecordValues:
    """The bases of one record the windows predict, increasing: bases int64 [n] (0-based), valid bool [n] (a
    real base, not N), softmask bool [n] (lower case), and each track's value float32 [n] (nats; 0 where not
    valid)."""

    record: str
    bases: np.ndarray
    valid: np.ndarray
    softmask: np.ndarray
    values: dict[str, np.ndarray]


def assemble(
    windows: Sequence[Window],
    scores: dict[str, list[tuple[np.ndarray, np.ndarray]]],
    sizes: dict[str, int],
) -> list[RecordValues]:
    """Each record's per-base values (records in `sizes` order, those without windows left out) from the
    windows' (full, short) losses per model: position t of a window starting at s is base s + t + 1, for t
    below its last real base; a base already predicted by an earlier-starting window is skipped."""
    order = {name: i for i, name in enumerate(sizes)}
    ranked = sorted(range(len(windows)), key=lambda i: (order[windows[i].record], windows[i].start))
    pieces: dict[str, list[dict[str, np.ndarray]]] = {}
    covered: dict[str, int] = {}  # per record: the first base no window has predicted yet
    for i in ranked:
        window = windows[i]
        if window.end > sizes[window.record]:
            raise TrackError(
                f"window {window.record}:{window.start + 1}-{window.end} of {window.source} runs past the "
                f"{sizes[window.record]:,} bases of {window.record} in the source reference; prepare the "
                "data again"
            )
        count = window.end - window.start - 1  # positions predicting a base of the window
        skip = max(0, covered.get(window.record, 0) - (window.start + 1))
        if skip >= count:
            continue
        keep = slice(skip, count)
        (full_before, short_before), (full_after, short_after) = scores["before"][i], scores["after"][i]
        pieces.setdefault(window.record, []).append(
            {
                "bases": np.arange(window.start + 1 + skip, window.end, dtype=np.int64),
                "valid": (window.labels[keep] != IGNORE_INDEX).numpy(),
                "softmask": window.predicted_softmask[keep].numpy(),
                "before": full_before[keep],
                "after": full_after[keep],
                "change": full_after[keep] - full_before[keep],
                "long_context_gain_before": short_before[keep] - full_before[keep],
                "long_context_gain_after": short_after[keep] - full_after[keep],
            }
        )
        covered[window.record] = window.end
    out = []
    for record, parts in pieces.items():
        joined = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
        values = {track: joined[track].astype(np.float32) for track in TRACKS}
        out.append(RecordValues(record, joined["bases"], joined["valid"], joined["softmask"], values))
    return out


def run_tracks(
    config: TrainConfig,
    inputs: TrackInput,
    load: Callable[[str], torch.nn.Module],
    before: str,
    after: str,
    share: WindowShare | None = None,
) -> dict:
    """The tracks of `inputs.windows` with the models `load(before)` and `load(after)` (each loaded once);
    `share`: the dp replicas splitting the windows. What `write_tracks` takes: settings, sizes, records
    (`RecordValues`), summary (per track: bases with a value, their mean), provenance."""
    windows = inputs.windows
    if not len(windows):
        raise TrackError("no windows to track")
    seq = len(windows[0].ids)
    cut = cut_tokens(config, seq)
    for i in range(len(windows)):
        window = windows[i]
        if window.reverse:
            raise TrackError(
                f"window {i} ({window.record}:{window.start + 1}-{window.end}) is read from the reverse "
                "strand; the tracks hold forward-strand coordinates: give the forward windows"
            )
        if len(window.ids) != seq:
            raise TrackError(f"window {i} has {len(window.ids)} tokens, window 0 has {seq}")
        if window.record not in inputs.sizes:
            raise TrackError(f"window {i}: record {window.record!r} is not in the source reference")
    scores = {}
    for name, path in zip(MODELS, (before, after)):
        began = time.perf_counter()
        print(f"tracking {len(windows)} window(s) with the {name} model {path}", flush=True)
        model = load(path)
        scores[name] = score_tracks(model, windows, cut, config.memory.precision, progress=True, share=share)
        del model
        print(f"  {time.perf_counter() - began:.1f} s", flush=True)
    records = assemble(windows, scores, inputs.sizes)
    summary = {}
    for track in TRACKS:
        values = [r.values[track][r.valid].astype(np.float64) for r in records]
        count = sum(len(v) for v in values)
        summary[track] = {
            "bases": count,
            "mean": float(sum(v.sum() for v in values) / count) if count else float("nan"),
        }
    settings = {
        "run": config.run,
        "seq": seq,
        "windows": len(windows),
        "context_cut_tokens": cut,
        "track_bin": config.track.track_bin,
        "region": config.region,
        "eval_windows": None if config.region else config.eval.eval_windows,
    }
    timestamp = datetime.now(UTC).isoformat(timespec="seconds")
    provenance = {"before_model": before, "after_model": after, **inputs.provenance, "timestamp": timestamp}
    return {
        "settings": settings,
        "sizes": dict(inputs.sizes),
        "records": records,
        "summary": summary,
        "provenance": provenance,
    }


def track_config(config: TrainConfig, before: str, after: str, plan: TrackPlan) -> dict:
    """`genomelm track`'s result on this rank's place in the run's mesh (or in this one process): the planned
    windows (the run's held-out ones, or the region's) tracked with the models `before` and `after`."""
    if plan.regions is None:
        heldout = load_heldout(config.data_dir, config.eval.eval_windows)
        inputs = TrackInput(heldout.windows, plan.sizes, {**heldout.provenance, "sources": plan.sources})
    else:
        windows = region_windows(plan.regions, plan.seq, plan.vocab)
        provenance = {
            "data_dir": str(config.data_dir),
            "manifest": str(config.data_dir / "manifest.json"),
            "sources": plan.sources,
            "regions": [
                {"record": r.interval.record, "start": r.interval.start, "end": r.interval.end}
                | ({"origin": r.interval.origin} if r.interval.origin else {})
                for r in plan.regions
            ],
            "windows": [{"record": w.record, "start": w.start, "end": w.end} for w in windows],
        }
        inputs = TrackInput(windows, plan.sizes, provenance)
    run = ScoringRun.from_environment(config)
    load = functools.partial(load_scoring_model, config=config, run=run)
    before, after = scoring_source(before, run), scoring_source(after, run)
    return run_tracks(config, inputs, load, before, after, run.share)


# ------------------------------------------------------------------------------------------ writers
def binned(
    bases: np.ndarray, values: np.ndarray, width: int, size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, ends int64, values float32) of the track entries of `bases` (increasing) holding `values`:
    one per base for `width` 1, else the mean of each bin [k * width, (k + 1) * width) holding a base (the
    last bin ends at the record's `size`)."""
    if width == 1 or not len(bases):
        return bases, bases + 1, values
    bins = bases // width
    first = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]])
    means = np.add.reduceat(values.astype(np.float64), first) / np.diff(np.r_[first, len(bases)])
    starts = bins[first] * width
    return starts, np.minimum(starts + width, size), means.astype(np.float32)


def track_entries(result: dict, track: str) -> Iterator[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """(record, starts, ends, values) of `track`, in record order, at most `CHUNK` entries at a time."""
    width = result["settings"]["track_bin"]
    for values in result["records"]:
        starts, ends, means = binned(
            values.bases[values.valid],
            values.values[track][values.valid],
            width,
            result["sizes"][values.record],
        )
        for lo in range(0, len(starts), CHUNK):
            yield values.record, starts[lo : lo + CHUNK], ends[lo : lo + CHUNK], means[lo : lo + CHUNK]


def write_bigwig(result: dict, track: str, path: Path) -> Path:
    """`track` as a bigWig: every record of the source in the header, the entries in genome order."""
    import pyBigWig  # C extension; only the writers need it

    bigwig = pyBigWig.open(str(path), "w")
    if bigwig is None:
        raise OSError(f"pyBigWig cannot create {path}")
    try:
        bigwig.addHeader(list(result["sizes"].items()))
        for record, starts, ends, values in track_entries(result, track):
            bigwig.addEntries([record] * len(starts), starts, ends=ends, values=values)
    finally:
        bigwig.close()
    return path


def write_bedgraph(result: dict, track: str, path: Path) -> Path:
    """`track` as a bedGraph with a UCSC track line (values to 6 significant digits)."""
    name = f"{result['settings']['run']} {track}"
    with open(path, "w") as out:
        out.write(f'track type=bedGraph name="{name}" description="{DESCRIPTIONS[track]}"\n')
        for record, starts, ends, values in track_entries(result, track):
            out.write(
                "".join(
                    f"{record}\t{s}\t{e}\t{v:.6g}\n"
                    for s, e, v in zip(starts.tolist(), ends.tolist(), values.tolist())
                )
            )
    return path


def softmask_runs(values: RecordValues) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the runs of consecutive soft-masked bases among those predicted."""
    bases = values.bases[values.softmask]
    if not len(bases):
        return bases, bases
    breaks = np.flatnonzero(np.diff(bases) != 1) + 1
    return bases[np.r_[0, breaks]], bases[np.r_[breaks - 1, len(bases) - 1]] + 1


def write_softmask_bed(result: dict, path: Path) -> Path:
    """The soft-masked (lower-case, repeat) bases the tracks cover as BED3 intervals with a track line."""
    with open(path, "w") as out:
        run = result["settings"]["run"]
        out.write(f'track name="{run} soft-masked" description="soft-masked (lower-case, repeat) bases"\n')
        for values in result["records"]:
            starts, ends = softmask_runs(values)
            out.write("".join(f"{values.record}\t{s}\t{e}\n" for s, e in zip(starts.tolist(), ends.tolist())))
    return path


def write_json(result: dict, path: Path) -> Path:
    summary = {key: result[key] for key in ("settings", "summary", "provenance")}
    summary["tracks"] = DESCRIPTIONS
    path.write_text(json.dumps(jsonable(summary), indent=2, allow_nan=False) + "\n")
    return path


def track_files() -> list[str]:
    """The file names of the set, as written into results/<run>/tracks/."""
    return [f"{track}.{ext}" for track in TRACKS for ext in ("bw", "bedGraph")] + [
        "softmask.bed",
        "tracks.json",
    ]


def write_tracks(result: dict, folder: Path) -> dict[str, Path]:
    """Write every track file (`track_files`) into `folder` (created if needed) as one set,
    `write_result_set`'s set "tracks": readers see the previous files or the new ones, never a mix, and a
    failure (WriteError for a full disk) leaves the previous ones."""
    writers: dict[str, Callable[[Path], object]] = {}
    for track in TRACKS:
        writers[f"{track}.bw"] = functools.partial(write_bigwig, result, track)
        writers[f"{track}.bedGraph"] = functools.partial(write_bedgraph, result, track)
    writers["softmask.bed"] = functools.partial(write_softmask_bed, result)
    writers["tracks.json"] = functools.partial(write_json, result)
    return write_result_set(folder, "tracks", writers)


def format_track_table(result: dict) -> str:
    """One line per track: bases with a value and their mean."""
    settings = result["settings"]
    header = f"{'track':<26} {'bases':>12} {'mean (nats/base)':>17}"
    lines = [header, "-" * len(header)]
    for track in TRACKS:
        row = result["summary"][track]
        lines.append(f"{track:<26} {row['bases']:>12,} {format_number(row['mean'], '+.4f'):>17}")
    cut = settings["context_cut_tokens"]
    lines.append(
        f"(long-context gain: loss with {cut + 1:,}-{2 * cut:,} tokens of context - loss with the window's "
        f"whole context, from position {2 * cut:,} of each {settings['seq']:,}-token window)"
    )
    return "\n".join(lines)
