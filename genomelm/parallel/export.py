"""`genomelm export RUN_DIR OUT [--dtype bf16|fp32] [--force]`: sharded training checkpoint -> HF folder.

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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

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
            f"{STATE_DIR}/): it is already in Hugging Face layout at {step / MODEL_DIR}; load or copy "
            "that folder, no export needed"
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


def _plan_shards(
    groups: list[list[str]], expected: dict[str, torch.Tensor], max_shard_bytes: int
) -> list[list[str]]:
    """Official on-disk keys per output shard, in writing order (the split `save_state_dict` makes)."""
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name in (name for group in groups for name in group):
        for key, tensor in official_tensors(name, expected[name]):  # meta tensors: sizes only
            size = tensor.numel() * tensor.element_size()
            if shards[-1] and shard_bytes + size > max_shard_bytes:
                shards.append([])
                shard_bytes = 0
            shards[-1].append(key)
            shard_bytes += size
    return shards


def _write_folder(
    staging: Path, step: Path, config: ModelConfig, dtype: torch.dtype, max_shard_bytes: int
) -> None:
    """Write the Hugging Face files of the checkpoint `step` into `staging`, one layer at a time."""
    expected = GlmForCausalLM.from_config(config, RunOptions(), dtype, "meta").state_dict()
    state_dir = step / STATE_DIR
    stored = _check_keys(state_dir, expected, step / CONFIG_FILE)
    groups = [
        [name for name in expected if layer_of(name) == group]
        for group in [None, *range(config.num_hidden_layers)]
    ]
    shards = _plan_shards(groups, expected, max_shard_bytes)
    files = [f"model-{number:05d}-of-{len(shards):05d}.safetensors" for number in range(1, len(shards) + 1)]
    shard_of = {key: number for number, keys in enumerate(shards) for key in keys}
    weight_map: dict[str, str] = {}
    total = 0
    pending: dict[str, torch.Tensor] = {}
    current = 0

    def flush() -> None:
        save_file(pending, staging / files[current], metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(pending, files[current]))
        pending.clear()

    for group in groups:
        tensors = _read_group(state_dir, expected, group, stored)
        for name in group:
            tensor = tensors.pop(name).to(expected[name].dtype)
            for key, piece in official_tensors(name, tensor):
                if shard_of[key] != current:
                    flush()
                    current = shard_of[key]
                # copies: views of one internal tensor share storage, which safetensors refuses
                pending[key] = piece.contiguous().clone()
                total += piece.numel() * piece.element_size()
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (staging / CONFIG_FILE).write_text(json.dumps(hf_config_dict(config, dtype), indent=2) + "\n")


def export_checkpoint(
    source: str | Path,
    out: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    force: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Export the checkpoint `source` (run or step folder) to the Hugging Face folder `out`; returns the step
    folder exported. `dtype` is the output dtype of all tensors but those the model declares fp32 (router,
    correction bias, conv, gate constants, mHC base/scale), which stay fp32. An existing non-empty `out` is
    replaced only with `force`."""
    out = Path(out)
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(
            f"{out} already exists and is not empty; choose another OUT or pass --force to replace it"
        )
    step = find_checkpoint(source)
    try:
        config = ModelConfig.from_file(step / CONFIG_FILE)
    except ConfigError as exc:
        raise ExportError(f"{step / CONFIG_FILE}: {exc}") from exc
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it private
    try:
        _write_folder(staging, step, config, dtype, max_shard_bytes)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            staging.rename(out)
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()
        else:
            staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="genomelm export",
        description="Turn a sharded training checkpoint (torch.distributed.checkpoint) into a Hugging Face "
        "folder that genomelm and transformers load, one layer at a time.",
    )
    parser.add_argument(
        "run_dir", help="run folder (runs/<run>: its newest complete checkpoint) or a step folder"
    )
    parser.add_argument("out", help="output folder (written atomically)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="dtype of the weights (fp32-declared parameters stay fp32); default bf16",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty OUT")
    parser.add_argument(
        "--max-shard-bytes",
        type=int,
        default=DEFAULT_MAX_SHARD_BYTES,
        help="largest output shard in bytes (one tensor may exceed it)",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        step = export_checkpoint(args.run_dir, args.out, DTYPES[args.dtype], args.force, args.max_shard_bytes)
    except ExportError as exc:
        print(f"genomelm export: {exc}", file=sys.stderr)
        return 1
    print(f"exported {step} -> {args.out} ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
