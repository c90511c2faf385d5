"""A sharded training checkpoint as a Hugging Face folder (`genomelm export`, `genomelm.commands.export`).

The source is a `step-*` folder of `runs/<run>/checkpoints/` (RUN_DIR may be the run or the step folder; a run
gives its newest complete checkpoint) holding `config.json` and `state/`, a torch.distributed.checkpoint (DCP)
whose `model.<name>` entries are the `GlmForCausalLM.state_dict()` tensors at their global shapes (the
`optimizer.*` entries are ignored). The output is what `genomelm.model.save_model` writes and
`transformers.Glm5NextForConditionalGeneration.from_pretrained` loads: official names in
`model-0000i-of-0000n.safetensors` shards, `model.safetensors.index.json`, `config.json`.

The whole model never exists in memory: the top-level tensors, then one decoder layer at a time, are read
from DCP in one process (no process group; DCP reassembles the ranks' shards), cast, and appended to the shard
being written. Peak memory: one layer (its stored dtype plus the output dtype) plus one output shard (at most
`max_shard_bytes`, or one tensor if bigger). OUT is written to a temporary folder beside it, renamed in last.

`export_checkpoint_collective` writes the same files from every rank of a launched group at once, each rank
its share of the output files (training's export of its last checkpoint: hundreds of GB at full size).
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from tqdm import tqdm

from genomelm.model.checkpoint import CONFIG_FILE, DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, hf_config_dict
from genomelm.model.config import ConfigError, ModelConfig, RunOptions
from genomelm.model.hf_names import layer_of, official_tensors
from genomelm.model.model import GlmForCausalLM

from .checkpoint import METADATA_FILE, MODEL_DIR, STATE_DIR, STEP_PREFIX, Checkpointer, is_sharded

MODEL_KEY_PREFIX = "model."  # DCP keys of the model's tensors (optimizer state lives under "optimizer.")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class ExportError(ValueError):
    """A source or destination that cannot be exported; the message names the path and the fix."""


# -------------------------------------------------------------------------------------- finding the source
def _is_complete(step: Path) -> bool:
    """Whether `step` is a sharded checkpoint export can read (its DCP state complete, its config there)."""
    return is_sharded(step) and (step / CONFIG_FILE).is_file()


def _check_step(step: Path) -> Path:
    """`step` if it is a complete sharded checkpoint, else an `ExportError` saying what it is."""
    if _is_complete(step):
        return step
    if (step / MODEL_DIR / CONFIG_FILE).is_file() and not (step / STATE_DIR).exists():
        raise ExportError(
            f"{step} is a checkpoint of the single-process layout ({MODEL_DIR}/ instead of "
            f"{STATE_DIR}/): it is already in Hugging Face layout at {step / MODEL_DIR}; `genomelm export` "
            "writes it with a tokenizer and a model card"
        )
    if not (step / CONFIG_FILE).is_file():
        raise ExportError(
            f"{step} has no {CONFIG_FILE}; a sharded checkpoint holds config.json and {STATE_DIR}/"
        )
    raise ExportError(
        f"{step / STATE_DIR} has no {METADATA_FILE}: the checkpoint is incomplete (a save that did not "
        "finish); export an older step folder or let training write a new checkpoint"
    )


def find_checkpoint(path: str | Path) -> Path:
    """The step folder to export: `path` itself if it is a step folder, else the newest complete checkpoint of
    the run folder `path`."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(
            f"{path} is not a folder; give a run folder (runs/<run>) or one of its checkpoints/step-*"
        )
    if path.name.startswith(STEP_PREFIX) or (path / STATE_DIR).exists() or (path / MODEL_DIR).exists():
        return _check_step(path)
    checkpoints = Checkpointer(path)
    steps = checkpoints.steps()
    complete = [step for step in steps if _is_complete(step)]
    if complete:
        return complete[-1]
    if steps:  # explain the newest one: the one-process layout, or incomplete
        return _check_step(steps[-1])
    raise ExportError(
        f"{path} holds no complete checkpoint ({checkpoints.root}/{STEP_PREFIX}* with {CONFIG_FILE} and "
        f"{STATE_DIR}/{METADATA_FILE}); give a run folder that training saved a checkpoint into "
        "(save_every=...), or a step folder"
    )


# ----------------------------------------------------------------------------------------------- the export
def _check_keys(
    state_dir: Path, expected: dict[str, torch.Tensor], config_file: Path
) -> dict[str, torch.dtype]:
    """The stored dtype of each model tensor; an `ExportError` if DCP lacks one, holds extra ones, or has
    another shape."""
    stored = dcp.FileSystemReader(state_dir).read_metadata().state_dict_metadata
    on_disk = {
        key[len(MODEL_KEY_PREFIX) :]: meta for key, meta in stored.items() if key.startswith(MODEL_KEY_PREFIX)
    }
    missing = sorted(set(expected) - set(on_disk))
    unexpected = sorted(set(on_disk) - set(expected))
    if missing or unexpected:
        raise ExportError(
            f"{state_dir} does not match the model built from {config_file}: missing {len(missing)} "
            f"tensor(s) {[MODEL_KEY_PREFIX + name for name in missing[:3]]}, unexpected {len(unexpected)} "
            f"{[MODEL_KEY_PREFIX + name for name in unexpected[:3]]}; the checkpoint and its config.json "
            "must come from the same save (re-save the checkpoint, or fix config.json)"
        )
    dtypes = {}
    for name, want in expected.items():
        meta = on_disk[name]
        if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != tuple(want.shape):
            shape = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "a non-tensor"
            raise ExportError(
                f"{state_dir}: {MODEL_KEY_PREFIX}{name} is {shape} but the model built from {config_file} "
                f"expects {tuple(want.shape)}; config.json does not match the weights"
            )
        dtypes[name] = meta.properties.dtype
    return dtypes


def _read_group(
    state_dir: Path, expected: dict[str, torch.Tensor], names: list[str], stored: dict[str, torch.dtype]
) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of `names` at their stored dtypes, read from DCP in this one process."""
    template = {
        MODEL_KEY_PREFIX + name: torch.empty(expected[name].shape, dtype=stored[name]) for name in names
    }
    with warnings.catch_warnings():  # a single-process load is what we ask for
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(template, checkpoint_id=state_dir, no_dist=True)
    return {name: template[MODEL_KEY_PREFIX + name] for name in names}


@dataclass(frozen=True)
class _Plan:
    """What the export of one checkpoint writes: which official tensors go to which output file, in order."""

    config: ModelConfig
    dtype: torch.dtype  # the output dtype (fp32-declared parameters stay fp32)
    expected: dict[str, torch.Tensor]  # internal name -> meta tensor at its output dtype and global shape
    stored: dict[str, torch.dtype]  # internal name -> its dtype in DCP
    groups: list[list[str]]  # internal names: the top-level tensors, then each decoder layer's
    files: list[str]  # model-0000i-of-0000n.safetensors, in writing order
    file_of: dict[str, int]  # official key -> its file's index
    file_bytes: list[int]  # each file's tensor bytes at the output dtypes

    def files_of(self, name: str) -> set[int]:
        """The indices of the files holding the official tensors of internal tensor `name` (one tensor, e.g.
        the fused experts of a layer, may span several)."""
        return {self.file_of[key] for key, _ in official_tensors(name, self.expected[name])}


def _plan(step: Path, config: ModelConfig, dtype: torch.dtype, max_shard_bytes: int) -> _Plan:
    """The output files of exporting `step`: official keys split in writing order (top-level tensors, then
    layer by layer) into files of at most `max_shard_bytes` (one tensor may exceed it), the split
    `save_state_dict` makes. Reads only DCP's metadata."""
    expected = GlmForCausalLM.from_config(config, RunOptions(), dtype, "meta").state_dict()
    stored = _check_keys(step / STATE_DIR, expected, step / CONFIG_FILE)
    groups = [
        [name for name in expected if layer_of(name) == group]
        for group in [None, *range(config.num_hidden_layers)]
    ]
    shards: list[list[str]] = [[]]
    file_bytes = [0]
    for name in (name for group in groups for name in group):
        for key, tensor in official_tensors(name, expected[name]):  # meta tensors: sizes only
            size = tensor.numel() * tensor.element_size()
            if shards[-1] and file_bytes[-1] + size > max_shard_bytes:
                shards.append([])
                file_bytes.append(0)
            shards[-1].append(key)
            file_bytes[-1] += size
    files = [f"model-{number:05d}-of-{len(shards):05d}.safetensors" for number in range(1, len(shards) + 1)]
    file_of = {key: number for number, keys in enumerate(shards) for key in keys}
    return _Plan(config, dtype, expected, stored, groups, files, file_of, file_bytes)


def _split(file_bytes: list[int], world: int) -> list[range]:
    """Each rank's output files (indices), contiguous runs balanced by bytes: file i goes to the rank whose
    1/world of all the bytes holds its middle byte (a rank may get none when there are fewer files than
    ranks). Contiguous rather than round-robin: one internal tensor (a layer's fused experts, several GB at
    full size) can span several files, and each rank writing one of them reads that tensor whole; round-robin
    makes every file boundary a rank boundary, a contiguous split only world - 1 of them."""
    total = sum(file_bytes)
    before = itertools.accumulate(file_bytes, initial=0)  # bytes before each file (zip drops the total)
    owners = [(2 * start + size) * world // (2 * total) for start, size in zip(before, file_bytes)]
    return [range(bisect.bisect_left(owners, r), bisect.bisect_right(owners, r)) for r in range(world)]


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _write_files(staging: Path, step: Path, plan: _Plan, numbers: range, progress: bool = False) -> list[str]:
    """Write the output files `numbers` (indices into `plan.files`) into `staging`, one layer at a time,
    reading from DCP only the tensors they hold; returns their names. Each file is fsynced: the folder is
    renamed into place, possibly by another process, once every writer returned. `progress`: a bar over the
    layers (bytes written, rate, ETA) on stderr."""
    state_dir = step / STATE_DIR
    wanted = set(numbers)
    pending: dict[str, torch.Tensor] = {}
    current = numbers.start

    def flush() -> None:
        if pending:
            save_file(pending, staging / plan.files[current], metadata={"format": "pt"})
            _fsync(staging / plan.files[current])
            pending.clear()

    bar = tqdm(
        total=sum(plan.file_bytes[number] for number in numbers),
        unit="B",
        unit_scale=True,
        desc=f"export {step.name}",
        file=sys.stdout,  # stderr holds a failure's one line alone
        disable=not progress,
    )
    for group in plan.groups:
        names = [name for name in group if plan.files_of(name) & wanted]
        if not names:
            continue
        bar.set_postfix_str("top-level" if layer_of(names[0]) is None else f"layer {layer_of(names[0])}")
        tensors = _read_group(state_dir, plan.expected, names, plan.stored)
        for name in names:
            tensor = tensors.pop(name).to(plan.expected[name].dtype)
            for key, piece in official_tensors(name, tensor):
                number = plan.file_of[key]
                if number not in wanted:
                    continue
                if number != current:
                    flush()
                    current = number
                # copies: views of one internal tensor share storage, which safetensors refuses
                pending[key] = piece.contiguous().clone()
                bar.update(piece.numel() * piece.element_size())
    flush()
    bar.close()
    return [plan.files[number] for number in numbers]


def _write_index(staging: Path, plan: _Plan) -> list[str]:
    """Write `model.safetensors.index.json` (every official key's file) and `config.json` into `staging`;
    returns their names."""
    weight_map = {key: plan.files[number] for key, number in sorted(plan.file_of.items())}
    index = {"metadata": {"total_size": sum(plan.file_bytes)}, "weight_map": weight_map}
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (staging / CONFIG_FILE).write_text(json.dumps(hf_config_dict(plan.config, plan.dtype), indent=2) + "\n")
    for name in (INDEX_FILE, CONFIG_FILE):
        _fsync(staging / name)
    return [INDEX_FILE, CONFIG_FILE]


def _prepare(
    source: str | Path, out: Path, dtype: torch.dtype, force: bool, max_shard_bytes: int
) -> tuple[Path, _Plan]:
    """(step folder, its export plan); an `ExportError` for a taken `out` (without `force`) or a source that
    cannot be exported."""
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(
            f"{out} already exists and is not empty; choose another OUT or give force=true to replace it"
        )
    step = find_checkpoint(source)
    try:
        config = ModelConfig.from_file(step / CONFIG_FILE)
    except ConfigError as exc:
        raise ExportError(f"{step / CONFIG_FILE}: {exc}") from exc
    return step, _plan(step, config, dtype, max_shard_bytes)


def move_into_place(staging: Path, out: Path) -> None:
    """Rename the written folder `staging` to `out`, replacing an existing `out`."""
    if not out.exists():
        staging.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    staging.rename(out)
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()


def export_checkpoint(
    source: str | Path,
    out: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    force: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Export the checkpoint `source` (run or step folder) to the Hugging Face folder `out` in this one
    process; returns the step folder exported. `dtype` is the output dtype of all tensors but those the model
    declares fp32 (router, correction bias, conv, gate constants, mHC base/scale), which stay fp32. An
    existing non-empty `out` is replaced only with `force`."""
    out = Path(out)
    step, plan = _prepare(source, out, dtype, force, max_shard_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it private
    try:
        _write_files(staging, step, plan, range(len(plan.files)))
        _write_index(staging, plan)
        move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return step


def write_export(
    step: Path,
    folder: Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = False,
) -> None:
    """The files `export_checkpoint` writes, for the complete sharded step folder `step`, written straight
    into the existing folder `folder` (a caller's staging folder, which it renames into place itself)."""
    try:
        config = ModelConfig.from_file(_check_step(step) / CONFIG_FILE)
    except ConfigError as exc:
        raise ExportError(f"{step / CONFIG_FILE}: {exc}") from exc
    plan = _plan(step, config, dtype, max_shard_bytes)
    _write_files(folder, step, plan, range(len(plan.files)), progress)
    _write_index(folder, plan)


@contextmanager
def _together(out: Path) -> Iterator[None]:
    """One phase of `export_checkpoint_collective`: the body runs on every rank, then the ranks compare
    outcomes (an all-gather, so it is also the barrier that ends the phase) and all raise if any body raised:
    a failed rank its own exception, the others an `ExportError` quoting it. No rank is left waiting for one
    that gave up."""
    error: Exception | None = None
    try:
        yield
    except Exception as exc:
        error = exc
    mine = None if error is None else f"{type(error).__name__}: {error}"
    outcomes = [mine]
    if dist.is_initialized():
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, mine)
    if error is not None:
        raise error
    failed = [f"rank {rank}: {outcome}" for rank, outcome in enumerate(outcomes) if outcome is not None]
    if failed:
        raise ExportError(f"the export to {out} failed, nothing was written: {'; '.join(failed)}")


def export_checkpoint_collective(
    source: str | Path,
    out: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    force: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """`export_checkpoint` written by every rank of the default process group at once (collective: all must
    call it; without a group, this process alone); returns the files this rank wrote, at their paths in
    `out`. `out` must be on a file system every rank sees.

    The files are byte for byte those of `export_checkpoint`: the same plan, each rank writing a contiguous
    run of the output files balanced by bytes (`_split`) and reading from DCP only the tensors they hold (no
    collectives while reading). All write into one staging folder beside `out` (rank 0 creates it; a
    leftover of a killed export is removed first), then rank 0 writes the index and `config.json` and renames
    the folder into place. Between the phases the ranks agree on their outcomes: an error on any rank leaves
    no `out` and raises on every rank."""
    out = Path(out)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    staging = out.with_name(f".{out.name}.tmp-collective")  # one name every rank knows
    try:
        with _together(out):
            step, plan = _prepare(source, out, dtype, force, max_shard_bytes)
            if rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
        with _together(out):
            written = _write_files(staging, step, plan, _split(plan.file_bytes, world)[rank])
        with _together(out):
            if rank == 0:
                written += _write_index(staging, plan)
                move_into_place(staging, out)
    except BaseException:
        # after an agreement every rank is past its writes; an interrupt (not agreed on) of rank 0 alone
        # makes those of the others fail, the folder gone
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return [out / name for name in written]
