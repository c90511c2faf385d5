"""`genomelm embed CONFIG [key=value ...] [--after PATH | --before PATH]`: the model's hidden states of
held-out windows or of regions of the reference, as safetensors.

*What is embedded.* By default the held-out windows `genomelm eval` scores (the run's prepared folder,
`eval_windows` of them spread evenly, 0 = all): one item per window. With `region=chr:start-end` (1-based,
inclusive) or `region=file.bed` (0-based, half-open), those bases of the reference the run's data was
prepared from (the sources its `manifest.json` names; a changed or missing file is refused): one item per
region, each cut into windows of SEQ tokens from the region's start (the last one right-padded, as the data
stage pads a short window), so every window starts without context from before it. Every window is SEQ
tokens, even a short region's: the DSA indexer breaks ties between pools of equal (ReLU-zero) score by the
window's pool count, so a shorter window would change the states slightly (~1e-4 on the `demo` model) and
differ between cp layouts; for short regions give a smaller `seq=` (any length the cp layout splits).

*Which model.* The run's newest checkpoint ("after", as `genomelm eval` picks it); `--after PATH` for another
trained model; `--before PATH` for the model before training (the run's `model` folder, or `runs/<run>/init`
for a preset).

*What is taken.* The output of decoder layer `embed_layer` (-L..L-1; -1: the last) collapsed as the head reads
the last one: the mean of the 4 mHC streams, then the final RMS norm (`GlmForCausalLM.hidden_states` with
`upto_layer`; the layers after it do not run), fp32 under the run's precision (bf16 autocast on GPUs).
`embed_pool=mean` averages it over the item's A/C/G/T bases (N and padding excluded): one vector per item;
`embed_pool=base`: one per base of the item (N bases included, padding not). Stored as `embed_dtype`.

*Output*, `results/<run>/embeddings/`, one set (`genomelm.eval.report.write_result_set`: a reader sees the
previous set or the new one, never a mix):
- `embeddings.safetensors`: "embedding" [items, D] (mean) or "embedding.<i>" [bases of item i, D] (base),
  and in `__metadata__` the settings and "items" (JSON: record, start, end, strand, bases, real_bases, origin,
  tensor, row of each item);
- `embeddings.tsv`: the same items, one line each.
`as_hf_dataset(folder)` reads them as a `datasets.Dataset`.

*On the mesh* (dp, cp, ep > 1) it runs like `genomelm eval` (`run_scoring`): the dp replicas split the
windows (`WindowShare.run`), a cp group's rank 0 receives each window's states
(`ContextParallelScorer.hidden_states`).

*Memory.* The states of one window at a time per process: S x D x 4 bytes on the device (under cp on the cp
group's rank 0; S/cp x D on the others), whatever the number of windows; mean pooling keeps [items, D] too.
Per-base states are never gathered: the output file is laid out (and sized) before the ranks start, and each
writing rank writes its windows' rows straight into their place in it, `WRITE_ROWS` rows at a time through
host memory; so the results folder must be shared by the ranks (it is, on one machine). Region bases are
held as 1 byte per base.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import json
import os
import secrets
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from genomelm.data.dataset import WindowDataset
from genomelm.data.errors import DataError
from genomelm.data.prepare import MANIFEST, read_manifest
from genomelm.data.reference import read_reference, source_files
from genomelm.data.regions import Interval, is_bed, read_bed, static_interval
from genomelm.data.vocab import CODE_MASK, N, Vocabulary
from genomelm.eval.report import write_atomic, write_error, write_result_set
from genomelm.parallel.training import ContextParallelScorer
from genomelm.run.config import TrainConfig
from genomelm.run.models import device_rows, model_config_of
from genomelm.run.precision import autocast_for
from genomelm.run.scoring import (
    ScoringRun,
    WindowShare,
    load_scoring_model,
    pick_windows,
    progress_bar,
    scoring_source,
)

SET = "embeddings"  # the result set's name (write_result_set) and the folder under results/<run>/
TENSORS = "embeddings.safetensors"
INDEX = "embeddings.tsv"
FORMAT = "genomelm.embeddings/1"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SAFETENSORS_DTYPES = {"fp32": "F32", "bf16": "BF16"}
WRITE_ROWS = 1 << 16  # per-base rows moved to host memory and written at once (64k x D x 4 bytes at most)
INDEX_COLUMNS = ("record", "start", "end", "strand", "bases", "real_bases", "tensor", "row", "origin")


class EmbedError(Exception):
    """Bad embed settings or inputs; the message says how to fix them."""

    exit_code = 2  # the user's input (`genomelm.run.failures`)


@dataclass(frozen=True)
class Item:
    """What one embedding describes: bases [start, end) (0-based, half-open) of `record` on `strand`;
    `real`: how many of them are A/C/G/T (not N); `origin`: where it was asked for ("heldout window 3",
    "chr4:1-100", "regions.bed line 2")."""

    record: str
    start: int
    end: int
    strand: str
    real: int
    origin: str

    @property
    def bases(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Request:
    """Everything the ranks need, decided (and checked) before any process starts.

    model / role: the model to read and "after" or "before"; layer: the decoder layer taken (0-based) of
    `layers`; width: the model's hidden size D; items: what is embedded, in output order; data_dir: the
    prepared folder; heldout: each item's held-out window number (held-out items), or None; codes: each
    item's bases as on-disk codes (uint8, region items), or None; vocab: the folder's token ids; part / data
    start: the per-base output file the ranks write into and where its tensor data begins (embed_pool=base).
    """

    model: str
    role: str
    layer: int
    layers: int
    width: int
    items: tuple[Item, ...]
    data_dir: str
    heldout: tuple[int, ...] | None
    codes: tuple[np.ndarray, ...] | None
    vocab: Vocabulary
    part: str | None = None
    data_start: int = 0

    def windows(self, seq: int) -> list[tuple[int, int]]:
        """(item, first base within the item) of each window of `seq` tokens the model reads, in order."""
        return [(i, offset) for i, item in enumerate(self.items) for offset in range(0, item.bases, seq)]


# ------------------------------------------------------------------------------------------ what to embed
def resolve_layer(setting: int, layers: int, model: str) -> int:
    """`embed_layer` as a 0-based layer index of a model of `layers` decoder layers (-1: the last)."""
    if not -layers <= setting < layers:
        raise EmbedError(
            f"embed_layer={setting}: the model {model} has {layers} decoder layers; give 0..{layers - 1} "
            f"or -{layers}..-1 (-1: the last)"
        )
    return setting % layers


def heldout_items(folder: Path, wanted: int, seq: int) -> tuple[list[Item], list[int], Vocabulary]:
    """The items of `wanted` held-out windows (0: all) of the prepared `folder` (windows of `seq` tokens),
    spread evenly as `genomelm eval` picks them, their window numbers and the folder's vocabulary (N counts
    from the manifest)."""
    heldout = WindowDataset(folder, "heldout")
    if not len(heldout):
        raise EmbedError(
            f"{heldout.path} has no held-out windows; prepare the data with a held-out region "
            "(genomelm data heldout=...) or give region=chr:start-end"
        )
    if heldout.seq_len != seq:
        raise EmbedError(
            f"the held-out windows of {heldout.path} are {heldout.seq_len} tokens, not seq={seq}; give "
            f"seq={heldout.seq_len} (a region= is cut to any seq)"
        )
    n_counts = heldout.manifest["splits"]["heldout"]["windows"]["n"]
    indices = pick_windows(len(heldout), wanted)
    items = []
    for i in indices:
        where = heldout.coordinates(i)
        real = where["end"] - where["start"] - int(n_counts[i])
        items.append(Item(**where, strand="+", real=real, origin=f"heldout window {i}"))
    return items, indices, heldout.vocab


def region_items(spec: str, folder: Path) -> tuple[list[Item], list[np.ndarray], Vocabulary]:
    """The items of `spec` (the `region` setting: "chr:start-end", 1-based inclusive, or a BED file) of the
    reference the prepared `folder` was made from, their bases as codes, and the folder's vocabulary."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise DataError(f"{folder}: no {MANIFEST}, so not a complete prepared dataset; run `genomelm data`")
    intervals = read_bed(spec, "region").intervals if is_bed(spec) else [static_interval(spec, "region")]
    codes, lengths = read_regions(manifest, folder, intervals)
    items = []
    for interval, bases in zip(intervals, codes, strict=True):
        end = lengths[interval.record] if interval.end is None else interval.end
        real = int(np.count_nonzero(bases != N))
        items.append(Item(interval.record, interval.start, end, "+", real, interval.origin or interval.spec))
    return items, codes, Vocabulary.from_json(manifest["vocab"])


def read_regions(
    manifest: dict, folder: Path, intervals: Sequence[Interval]
) -> tuple[list[np.ndarray], dict[str, int]]:
    """The bases of each interval (end None: to the record's end) as codes (uint8, 1 byte per base, no
    soft-mask bit) of the reference files the prepared `folder`'s manifest names, and the length of every
    record. EmbedError for a region outside its record or of an unknown record; DataError for a reference
    that is missing or not the one prepared."""
    paths = source_files(folder, manifest)
    lengths, _ = read_reference(paths, {})
    wanted: dict[str, dict[int, int]] = {}  # record -> first base -> the furthest end asked from it
    for interval in intervals:
        if interval.record not in lengths:
            names = ", ".join(str(path) for path in paths)
            raise EmbedError(
                f"region {interval.describe()}: no record {interval.record!r} in the run's reference "
                f"{names} (from {folder / MANIFEST}); give a region of one of its records"
            )
        length = lengths[interval.record]
        if interval.end is not None and interval.end > length:
            raise EmbedError(
                f"region {interval.describe()} ends at base {interval.end:,} but record {interval.record} "
                f"has {length:,} bases; give an end <= {length:,}"
            )
        end = length if interval.end is None else interval.end
        starts = wanted.setdefault(interval.record, {})
        starts[interval.start] = max(starts.get(interval.start, 0), end)
    _, bases = read_reference(paths, {record: list(ends.items()) for record, ends in wanted.items()})
    codes = []
    for interval in intervals:
        end = lengths[interval.record] if interval.end is None else interval.end
        read = bases[interval.record, interval.start][: end - interval.start]
        codes.append(read & CODE_MASK)
    return codes, lengths


def prepare_request(config: TrainConfig, model: str, role: str) -> Request:
    """What `genomelm embed` will embed with `model` (`role`: "after" or "before"), every input checked: the
    layer against the model, the region against the reference, an item without A/C/G/T bases for mean
    pooling. Nothing is written."""
    architecture = model_config_of(model)
    layer = resolve_layer(config.embed.embed_layer, architecture.num_hidden_layers, model)
    if config.region:
        items, codes, vocab = region_items(config.region, config.data_dir)
        heldout, region_codes = None, tuple(codes)
    else:
        items, indices, vocab = heldout_items(config.data_dir, config.eval.eval_windows, config.seq_len)
        heldout, region_codes = tuple(indices), None
    if config.embed.embed_pool == "mean":
        empty = [item.origin for item in items if item.real == 0]
        if empty:
            raise EmbedError(
                f"{', '.join(empty)}: no A/C/G/T base (all N) to average over; leave it out, or use "
                "embed_pool=base"
            )
    return Request(
        model,
        role,
        layer,
        architecture.num_hidden_layers,
        architecture.hidden_size,
        tuple(items),
        str(config.data_dir),
        heldout,
        region_codes,
        vocab,
    )


# ------------------------------------------------------------------------------------------ the forward
def window_ids(request: Request, item: int, offset: int, seq: int, heldout: Sequence | None) -> Tensor:
    """LongTensor[seq]: the token ids of the window of `item` starting at base `offset` (held-out windows
    from `heldout`, the opened split; region windows right-padded)."""
    if request.heldout is not None:
        assert heldout is not None, "held-out items need the opened held-out split"
        return heldout[request.heldout[item]].input_ids
    assert request.codes is not None
    codes = request.codes[item][offset : offset + seq]
    ids = torch.full((seq,), request.vocab.pad_id, dtype=torch.long)
    ids[: len(codes)] = torch.tensor(request.vocab.code_to_id)[torch.from_numpy(codes.astype(np.int64))]
    return ids


def embed_windows(
    model: nn.Module,
    request: Request,
    seq: int,
    pool: str,
    dtype: str,
    precision: str = "auto",
    share: WindowShare | None = None,
    device: torch.device = torch.device("cpu"),
    progress: bool = False,
) -> np.ndarray | None:
    """Run `model` (a `GlmForCausalLM` or a `ContextParallelScorer`) on every window of `request`, in
    `precision`, taking layer `request.layer`'s states; `share`: the dp replicas splitting the windows.

    pool "mean": float32 [items, D], each item's states averaged over its A/C/G/T bases (summed per window in
    fp32, over windows in fp64), on the ranks that received states (None on a cp group's other ranks).
    pool "base": each window's rows for its item's bases, as `dtype`, written into `request.part` at their
    place; returns None.
    """
    share = share if share is not None else WindowShare()
    windows = request.windows(seq)
    pad_id, n_id = request.vocab.ignored_ids
    heldout = WindowDataset(request.data_dir, "heldout") if request.heldout is not None else None
    handle = os.open(request.part, os.O_WRONLY) if pool == "base" and request.part else None
    row_bytes = request.width * DTYPES[dtype].itemsize
    starts = _tensor_starts(request, dtype) if pool == "base" else []

    def job(w: int) -> tuple[np.ndarray, int] | None:
        item, offset = windows[w]
        ids = window_ids(request, item, offset, seq, heldout)
        (rows,) = device_rows([ids], device)
        with autocast_for(precision, device):
            hidden = model.hidden_states(rows, upto_layer=request.layer)
        if hidden is None:  # a cp rank other than the group's rank 0: it sent its shard
            return None
        states = hidden[0].float()  # [S, D]
        real = (rows[0] != pad_id) & (rows[0] != n_id)
        if pool == "mean":
            total = states.masked_fill_(~real[:, None], 0.0).sum(0)  # in place: this window's states only
            return total.double().cpu().numpy(), int(real.sum())
        assert handle is not None, "embed_pool=base needs the output file (request.part)"
        count = min(seq, request.items[item].bases - offset)
        at = request.data_start + starts[item] + offset * row_bytes
        _write_rows(handle, request.part, at, states[:count], DTYPES[dtype])
        return None

    model.eval()
    try:
        with torch.no_grad():
            results = share.run(
                [functools.partial(job, w) for w in range(len(windows))],
                progress_bar("embed", "window") if progress else None,
            )
    finally:
        if handle is not None:
            os.close(handle)
    if pool == "base" or any(result is None for result in results):
        return None
    sums = np.zeros((len(request.items), request.width))
    counts = np.zeros(len(request.items))
    for (item, _), (total, count) in zip(windows, results, strict=True):
        sums[item] += total
        counts[item] += count
    return (sums / counts[:, None]).astype(np.float32)


def _write_rows(handle: int, path: str, at: int, states: Tensor, dtype: torch.dtype) -> None:
    """Write `states` [n, D] as `dtype` at byte `at` of the open file `path`, WRITE_ROWS rows at a time;
    a failure (disk full) is a WriteError naming the file."""
    for lo in range(0, len(states), WRITE_ROWS):
        chunk = states[lo : lo + WRITE_ROWS].to(dtype).contiguous().cpu()
        data = memoryview(chunk.view(torch.uint8).numpy().reshape(-1))  # bf16 too: its bytes as they are
        offset = at + lo * chunk.shape[1] * chunk.element_size()
        try:
            while data:
                written = os.pwrite(handle, data, offset)
                data, offset = data[written:], offset + written
        except OSError as exc:
            raise write_error(exc, Path(path)) from exc


def embed_on_rank(config: TrainConfig, request: Request) -> dict:
    """`genomelm embed`'s forward on this rank's place in the run's mesh (or in this one process): the
    request's model loaded as `genomelm eval` loads it, every window run. Returns the pooled embeddings
    ("embedding", mean pooling; None otherwise) and the seconds taken."""
    began = time.perf_counter()
    run = ScoringRun.from_environment(config)
    model = load_scoring_model(scoring_source(request.model, run), config, run)
    from torch.distributed.fsdp import register_fsdp_forward_method  # slow import (~0.6 s): ranks only

    # FSDP2 gathers the root's parameters around `forward` only; hidden_states is called instead
    register_fsdp_forward_method(
        model.model if isinstance(model, ContextParallelScorer) else model, "hidden_states"
    )
    print(
        f"embedding {len(request.windows(config.seq_len))} window(s) of {len(request.items)} item(s) with "
        f"the {request.role} model {request.model}",
        flush=True,
    )
    embedding = embed_windows(
        model,
        request,
        config.seq_len,
        config.embed.embed_pool,
        config.embed.embed_dtype,
        config.memory.precision,
        run.share,
        run.device,
        progress=True,
    )
    return {"embedding": embedding, "seconds": time.perf_counter() - began}


# ------------------------------------------------------------------------------------------ the files
def tensor_name(request: Request, item: int) -> str:
    """The safetensors name of `item`'s per-base tensor, numbered so that sorted names keep item order."""
    return f"embedding.{item:0{len(str(len(request.items) - 1))}d}"


def item_rows(request: Request, pool: str) -> list[dict]:
    """One dict per item: coordinates, base counts, origin and where its embedding is (tensor, row)."""
    return [
        {
            "record": item.record,
            "start": item.start,
            "end": item.end,
            "strand": item.strand,
            "bases": item.bases,
            "real_bases": item.real,
            "tensor": "embedding" if pool == "mean" else tensor_name(request, i),
            "row": i if pool == "mean" else None,
            "origin": item.origin,
        }
        for i, item in enumerate(request.items)
    ]


def file_metadata(config: TrainConfig, request: Request) -> dict[str, str]:
    """The safetensors `__metadata__` (strings only): settings, model, source and the items."""
    return {
        "format": FORMAT,
        "run": config.run,
        "model": request.model,
        "model_role": request.role,
        "layer": str(request.layer),
        "layers": str(request.layers),
        "embed_layer": str(config.embed.embed_layer),
        "collapse": "mean of the mHC streams, then the final RMS norm (the head's input)",
        "pool": config.embed.embed_pool,
        "dtype": config.embed.embed_dtype,
        "width": str(request.width),
        "seq": str(config.seq_len),
        "precision": config.memory.precision,
        "data_dir": request.data_dir,
        "region": config.region or "",
        "items": json.dumps(item_rows(request, config.embed.embed_pool)),
    }


def _tensor_starts(request: Request, dtype: str) -> list[int]:
    """Byte offset of each item's per-base tensor within the tensor data, in item order."""
    row_bytes = request.width * DTYPES[dtype].itemsize
    sizes = [item.bases * row_bytes for item in request.items]
    return [int(x) for x in np.cumsum([0, *sizes[:-1]])]


def create_part(folder: Path, config: TrainConfig, request: Request) -> Request:
    """Lay out the per-base output file in `folder` (created): the safetensors header (one tensor per item,
    at known offsets) and its full size, its rows left for the ranks to write; the file is renamed into the
    result set once they have. Returns the request naming it. Stale part files of dead processes are
    removed first.

    The header is written here, in safetensors' documented layout (8-byte little-endian header length, the
    JSON header, 8-byte-aligned data), because the safetensors library writes a file only from tensors held in
    memory, and the per-base states of every item are not: the ranks fill their rows in place, and
    `safe_open` reads the result (tested)."""
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_parts(folder)
    dtype = config.embed.embed_dtype
    row_bytes = request.width * DTYPES[dtype].itemsize
    header: dict = {"__metadata__": file_metadata(config, request)}
    for i, (item, start) in enumerate(zip(request.items, _tensor_starts(request, dtype), strict=True)):
        header[tensor_name(request, i)] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": [item.bases, request.width],
            "data_offsets": [start, start + item.bases * row_bytes],
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensor data starts 8-byte aligned, as safetensors writes it
    part = folder / f".{SET}.part-{os.getpid()}-{secrets.token_hex(6)}.safetensors"
    total = sum(item.bases for item in request.items) * row_bytes
    try:
        with open(part, "wb") as out:
            out.write(struct.pack("<Q", len(text)) + text)
            out.truncate(8 + len(text) + total)
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise write_error(exc, part) from exc
    return dataclasses.replace(request, part=str(part), data_start=8 + len(text))


def _remove_stale_parts(folder: Path) -> None:
    """Part files whose process (on this machine) is gone: a killed `genomelm embed`'s; a live one's is left
    alone."""
    for path in folder.glob(f".{SET}.part-*.safetensors"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def write_index(rows: list[dict], path: Path) -> Path:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=INDEX_COLUMNS, delimiter="\t", lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return write_atomic(path, out.getvalue())


def write_embeddings(
    folder: Path, config: TrainConfig, request: Request, embedding: np.ndarray | None
) -> dict[str, Path]:
    """Write embeddings.safetensors and embeddings.tsv into `folder` as one set: mean pooling from
    `embedding` [items, D] (stored as embed_dtype), per-base pooling by moving the ranks' `request.part` into
    place. WriteError (disk full, no permission) leaves the previous set."""
    from safetensors.torch import save_file

    dtype = DTYPES[config.embed.embed_dtype]

    def tensors(path: Path) -> None:
        if request.part is not None:
            os.replace(request.part, path)
        else:
            assert embedding is not None, "mean pooling gives the embeddings to write"
            save_file(
                {"embedding": torch.from_numpy(embedding).to(dtype)}, path, file_metadata(config, request)
            )

    rows = item_rows(request, config.embed.embed_pool)
    return write_result_set(folder, SET, {TENSORS: tensors, INDEX: lambda path: write_index(rows, path)})


# ------------------------------------------------------------------------------------------ reading them
def as_hf_dataset(folder: str | Path, cache_dir: str | None = None):
    """The embeddings `genomelm embed` wrote into `folder` (results/<run>/embeddings) as a `datasets.Dataset`,
    one row per item: `record`, `start`, `end` (0-based, half-open), `strand` and `embedding` (float32: [D]
    for embed_pool=mean, [bases, D] for base; bf16 is widened, Arrow has no bf16).

    Rows are written once into the datasets cache (`cache_dir` or the default), one item's tensor read at a
    time; the set's current generation is read (a later `genomelm embed` writes a new one, so the cache is
    never stale)."""
    import datasets
    from safetensors import safe_open

    path = Path(folder) / TENSORS
    if not path.exists():
        raise EmbedError(f"{path}: no embeddings there; run `genomelm embed CONFIG` first")
    source = os.path.realpath(path)  # this generation of the set, whatever a later write does
    with safe_open(source, "pt") as handle:
        metadata = handle.metadata()
    if metadata is None or metadata.get("format") != FORMAT:
        raise EmbedError(f"{path}: not written by `genomelm embed` (no {FORMAT!r} metadata)")
    width = int(metadata["width"])
    embedding = (
        datasets.Sequence(datasets.Value("float32"), length=width)
        if metadata["pool"] == "mean"
        else datasets.Array2D((None, width), "float32")
    )
    features = datasets.Features(
        {
            "record": datasets.Value("string"),
            "start": datasets.Value("int64"),
            "end": datasets.Value("int64"),
            "strand": datasets.Value("string"),
            "embedding": embedding,
        }
    )
    return datasets.Dataset.from_generator(
        _dataset_rows, features=features, gen_kwargs={"path": source}, cache_dir=cache_dir
    )


def _dataset_rows(path: str) -> Iterator[dict]:
    """`as_hf_dataset`'s rows from the safetensors file at `path`, one item's tensor in memory at a time
    (module level, safe_open imported inside: the datasets cache key hashes this function)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as handle:
        metadata = handle.metadata()
        whole = handle.get_tensor("embedding").float() if metadata["pool"] == "mean" else None
        for row in json.loads(metadata["items"]):
            vector = whole[row["row"]] if whole is not None else handle.get_tensor(row["tensor"]).float()
            yield {key: row[key] for key in ("record", "start", "end", "strand")} | {
                "embedding": vector.numpy()
            }
