"""Load and save GLM-5.3-Flash checkpoints (Hugging Face safetensors) for genomelm's `GlmForCausalLM`.

Reading maps every on-disk key to the internal tensor it feeds (`hf_names`: official and internal spellings
are both read, detected key by key), skips the vision tower and the MTP layer, and reads only the tensors
asked for through `safetensors.safe_open`; shards holding none of them are never opened. Either spelling may
hold FP8 e4m3 weights with a `<name>_scale_inv` block-scale companion (`fp8`). Saving writes the official
layout with a `glm5_next` config.json that `Glm5NextForConditionalGeneration.from_pretrained` loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from genomelm.model.config import ConfigError, ModelConfig, RunOptions
from genomelm.model.fp8 import DEFAULT_BLOCK, SCALE_SUFFIX, dequantize_fp8_blocks, is_fp8
from genomelm.model.hf_names import (
    CONV_ORDER,
    Piece,
    internal_piece,
    is_conv_weight,
    is_routed_experts,
    layer_of,
    official_pattern,
    official_tensors,
    text_model_key,
)

if TYPE_CHECKING:
    from genomelm.model.model import GlmForCausalLM

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 4 * 2**30

# config.json entries that describe the source files rather than the weights we write
_DROPPED_CONFIG_KEYS = {
    "quantization_config",
    "architectures",
    "auto_map",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "text_config",
    "vision_config",
    "model_type",
}
# fields of the outer `glm5_next` config that a flat (text fields at the top) config.json mixes in with the
# text ones
_OUTER_ONLY_KEYS = {
    "image_token_id",
    "video_token_id",
    "image_start_token_id",
    "image_end_token_id",
    "video_start_token_id",
    "video_end_token_id",
}


class CheckpointError(ValueError):
    """A checkpoint folder that does not hold what the config says it should."""


# ------------------------------------------------------------------------------------------------- reading
@dataclass
class _Target:
    """Where the pieces of one internal tensor lie on disk: piece -> on-disk key."""

    name: str
    pieces: dict[Piece, str] = field(default_factory=dict)


class CheckpointReader:
    """Index of one checkpoint folder; reads internal tensors on demand, opening only the shards it needs.

    Nothing but the index json (or, for a single `model.safetensors`, its header) is read up front.
    """

    def __init__(self, folder: str | Path, config: ModelConfig | None = None) -> None:
        self.folder = Path(folder)
        self.config = config if config is not None else ModelConfig.from_file(self.folder)
        self.weight_map = self._weight_map()
        quantization = (
            self.config.extra.get("_outer", {}).get("quantization_config")
            or self.config.extra.get("quantization_config")
            or {}
        )
        rows, cols = quantization.get("weight_block_size", DEFAULT_BLOCK)
        self.fp8_block = (int(rows), int(cols))
        self.targets: dict[str, _Target] = {}
        for disk_key in self.weight_map:
            if disk_key.endswith(SCALE_SUFFIX):
                continue
            text_key = text_model_key(disk_key)
            if text_key is None or "shared_head." in text_key:
                continue
            layer = layer_of(text_key)
            if layer is not None and layer >= self.config.num_hidden_layers:  # MTP layer(s)
                continue
            name, piece = internal_piece(text_key)
            target = self.targets.setdefault(name, _Target(name))
            if piece in target.pieces or (target.pieces and (piece == ()) != (() in target.pieces)):
                clash = sorted([*target.pieces.values(), disk_key])
                raise CheckpointError(
                    f"{self.folder}: {clash} all map onto {name}; a checkpoint must hold each tensor once, "
                    "in one layout (official or transformers-internal names)"
                )
            target.pieces[piece] = disk_key

    def _weight_map(self) -> dict[str, str]:
        index = self.folder / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(
                    f"{index} has no 'weight_map'; rewrite it or re-download the checkpoint"
                )
            return weight_map
        single = self.folder / SINGLE_FILE
        if single.exists():
            with safe_open(single, framework="pt") as handle:
                return dict.fromkeys(handle.keys(), SINGLE_FILE)
        raise CheckpointError(
            f"{self.folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}; "
            "point at a Hugging Face checkpoint folder"
        )

    def names(self, layers: list[int] | None = None) -> list[str]:
        """Internal names on disk: the top-level tensors plus those of `layers` (all layers when None)."""
        wanted = None if layers is None else set(layers)
        return [
            name
            for name in self.targets
            if (layer := layer_of(name)) is None or wanted is None or layer in wanted
        ]

    def where(self, name: str) -> str:
        """The on-disk keys and files behind an internal name, for messages."""
        target = self.targets.get(name)
        if target is None:
            return f"{name} (not in {self.folder})"
        keys = sorted(target.pieces.values())
        files = sorted({self.weight_map[key] for key in keys})
        shown = keys if len(keys) <= 3 else [keys[0], "...", keys[-1]]
        return f"{', '.join(shown)} in {self.folder}/{{{', '.join(files)}}}"

    def read(
        self, names: list[str], experts: list[int] | None = None, dtypes: dict[str, torch.dtype] | None = None
    ) -> dict[str, torch.Tensor]:
        """Internal name -> tensor for `names`, on the CPU.

        Tensors keep their stored dtype (FP8 ones are dequantised to fp32) unless `dtypes` names one, to
        which each piece is cast as it is read (so an FP8 layer never exists whole in fp32). `experts` keeps
        only those routed experts (in that order) in `mlp.experts.*` tensors; the rest are never read.
        """
        missing = [name for name in names if name not in self.targets]
        if missing:
            raise CheckpointError(
                f"{self.folder} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]} (on disk "
                f"{[official_pattern(name) for name in missing[:3]]}); check that config.json matches the "
                "weights (num_hidden_layers, layer_types, mlp_layer_types, indexer_types, n_routed_experts) "
                "and that every shard was downloaded"
            )
        dtypes = dtypes or {}
        with contextlib.ExitStack() as stack:
            handles: dict[str, Any] = {}

            def load(disk_key: str, dtype: torch.dtype | None, rows: list[int] | None = None) -> torch.Tensor:
                tensor = self._get(stack, handles, disk_key, rows)
                if is_fp8(tensor):
                    scale_key = disk_key + SCALE_SUFFIX
                    if scale_key not in self.weight_map:
                        raise CheckpointError(
                            f"{disk_key} in {self.folder}/{self.weight_map[disk_key]} is FP8 but "
                            f"{scale_key} is missing; an FP8 checkpoint needs a block scale beside every FP8 "
                            "weight"
                        )
                    scale = self._get(stack, handles, scale_key, rows)
                    tensor = dequantize_fp8_blocks(tensor, scale, self.fp8_block, name=disk_key)
                return tensor if dtype is None else tensor.to(dtype)

            return {
                name: self._assemble(self.targets[name], load, experts, dtypes.get(name)) for name in names
            }

    def _get(
        self, stack: contextlib.ExitStack, handles: dict[str, Any], disk_key: str, rows: list[int] | None
    ) -> torch.Tensor:
        file = self.weight_map[disk_key]
        if file not in handles:
            path = self.folder / file
            if not path.exists():
                raise CheckpointError(
                    f"{path} (listed in {INDEX_FILE} for {disk_key}) is missing; download it"
                )
            handles[file] = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
        if rows is None:
            return handles[file].get_tensor(disk_key)
        view = handles[file].get_slice(disk_key)
        return torch.cat([view[row : row + 1] for row in rows])

    def _assemble(
        self,
        target: _Target,
        load: Callable[..., torch.Tensor],
        experts: list[int] | None,
        dtype: torch.dtype | None,
    ) -> torch.Tensor:
        pieces = target.pieces
        if () in pieces:  # stored whole under this (or its official one-to-one) name
            stacked_experts = experts is not None and is_routed_experts(target.name)
            return load(pieces[()], dtype, experts if stacked_experts else None)
        if is_conv_weight(target.name):  # q, k, v thirds
            absent = [which for which in CONV_ORDER if (which,) not in pieces]
            if absent:
                raise CheckpointError(f"{self.where(target.name)} lacks the {absent} conv1d weights")
            return torch.cat([load(pieces[(which,)], dtype) for which in CONV_ORDER], dim=0)
        chosen = experts if experts is not None else list(range(self.config.n_routed_experts))
        parts = ("down",) if target.name.endswith("down_proj") else ("gate", "up")
        absent = [(e, part) for e in chosen for part in parts if (e, part) not in pieces]
        if absent:
            raise CheckpointError(
                f"{self.where(target.name)} lacks expert weights {absent[:4]}; "
                "check n_routed_experts in config.json"
            )
        stacked: torch.Tensor | None = None
        for slot, expert in enumerate(chosen):  # filled in place: one expert's pieces exist twice at most
            block = torch.cat([load(pieces[(expert, part)], dtype) for part in parts], dim=0)
            if stacked is None:
                stacked = block.new_empty((len(chosen), *block.shape))
            stacked[slot] = block
        assert stacked is not None, "a MoE layer has at least one expert"
        return stacked


def read_state_dict(
    folder: str | Path, layers: list[int] | None = None, experts: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """Internal-name state dict of a checkpoint folder (stored dtypes; FP8 dequantised to fp32), CPU.

    `layers`: only these decoder layers (plus embeddings, final norm and head). `experts`: only these
    routed experts, in this order, in every MoE layer (`experts.gate_up_proj` [len(experts), 2I, D]); the
    router keeps all experts. Tensors outside the request are never read.
    """
    reader = CheckpointReader(folder)
    _check_layers(layers, reader.config, str(folder))
    return reader.read(reader.names(layers), experts)


# -------------------------------------------------------------------------------------------- model loading
def _check_layers(layers: list[int] | None, config: ModelConfig, source: str) -> None:
    if layers is None:
        return
    bad = [layer for layer in layers if not 0 <= layer < config.num_hidden_layers]
    if bad:
        raise CheckpointError(
            f"layers {bad} do not exist in {source}: it has layers 0..{config.num_hidden_layers - 1}"
        )


def _resolve(path_or_preset: str | Path) -> tuple[ModelConfig, Path | None]:
    """(config, checkpoint folder or None for a preset)."""
    path = Path(path_or_preset)
    if path.is_dir():
        if not (path / CONFIG_FILE).exists():
            raise CheckpointError(
                f"{path} has no {CONFIG_FILE}; a checkpoint folder needs config.json + safetensors"
            )
        return ModelConfig.from_file(path), path
    if path.exists() or os.sep in str(path_or_preset):
        raise CheckpointError(
            f"{path_or_preset} is not a checkpoint folder; give a folder with {CONFIG_FILE} and safetensors, "
            "or a preset name"
        )
    try:
        return ModelConfig.preset(str(path_or_preset)), None
    except ConfigError as exc:
        raise CheckpointError(
            f"{exc}; or give a checkpoint folder holding {CONFIG_FILE} and safetensors"
        ) from exc


def load_model(
    path_or_preset: str | Path,
    dtype: torch.dtype = torch.float32,
    options: RunOptions | None = None,
    layers: list[int] | None = None,
    device: torch.device | str | None = None,
) -> GlmForCausalLM:
    """A `GlmForCausalLM` from a preset name (random init) or a checkpoint folder (official or internal
    layout, single-file or sharded, FP8 or not).

    `layers`: materialise only these decoder layers (plus embeddings, final norm, head); the others stay on
    the meta device (no memory; they cannot run) and their weights are never read. Parameters the model
    declares fp32 (router, conv, gate constants, mHC base/scale) stay fp32; the rest are `dtype`.
    """
    options = options if options is not None else RunOptions()
    device = torch.device(device if device is not None else "cpu")
    config, folder = _resolve(path_or_preset)
    _check_layers(layers, config, str(path_or_preset))
    from genomelm.model.model import GlmForCausalLM  # the model imports its parts; keep checkpoint.py light

    if folder is None and layers is None:
        return GlmForCausalLM.from_config(config, options, dtype, device)
    # Build every module on the meta device (no memory), then give storage only to what is wanted.
    model = GlmForCausalLM.from_config(config, options, dtype, "meta")
    wanted = range(config.num_hidden_layers) if layers is None else sorted(set(layers))
    if folder is None:
        for module in [model.embed_tokens, model.norm, model.lm_head, *(model.layers[i] for i in wanted)]:
            module.to_empty(device=device)
        model.init_weights()  # a no-op on what stays on the meta device
        return model

    expected = model.state_dict()
    reader = CheckpointReader(folder, config)
    for group in [None, *wanted]:  # top-level tensors, then one layer at a time: peak memory ~ one layer
        names = [name for name in expected if layer_of(name) == group]
        on_disk = {
            name for name in reader.names(None if group is None else [group]) if layer_of(name) == group
        }
        unexpected = sorted(on_disk - set(names))
        if unexpected:
            raise CheckpointError(
                f"{reader.where(unexpected[0])} (and {len(unexpected) - 1} more: {unexpected[1:4]}) has no "
                f"place in the model built from {folder / CONFIG_FILE}; fix config.json (layer_types, "
                "mlp_layer_types, indexer_types, attention_bias) to match the weights"
            )
        tensors = reader.read(names, dtypes={name: expected[name].dtype for name in names})
        for name, tensor in tensors.items():
            want = expected[name]
            if tuple(tensor.shape) != tuple(want.shape):
                raise CheckpointError(
                    f"{reader.where(name)} has shape {tuple(tensor.shape)} but the model built from "
                    f"{folder / CONFIG_FILE} expects {name} of shape {tuple(want.shape)}; config.json does "
                    "not match the weights"
                )
            tensors[name] = tensor.to(device)
        model.load_state_dict(tensors, strict=False, assign=True)
    return model


# -------------------------------------------------------------------------------------------------- saving
def hf_config_dict(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A `glm5_next` config.json for `Glm5NextForConditionalGeneration`, with a 1-block vision tower.

    The vision tower's weights are not saved (genomelm is text only); transformers initialises them.
    """
    text = {
        k: v for k, v in config.text_config_dict().items() if k not in _DROPPED_CONFIG_KEYS - {"model_type"}
    }
    outer = {k: text.pop(k) for k in _OUTER_ONLY_KEYS & set(text)}
    outer |= {k: v for k, v in config.extra.get("_outer", {}).items() if k not in _DROPPED_CONFIG_KEYS}
    vision = {
        "model_type": "glm5_next_vision",
        "depth": 1,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 32,
        "out_hidden_size": config.hidden_size,  # the merger's output becomes text embeddings
        "projection_intermediate_size": 32,
    }
    return {
        **outer,
        "model_type": "glm5_next",
        "architectures": ["Glm5NextForConditionalGeneration"],
        "dtype": str(dtype).removeprefix("torch."),
        "tie_word_embeddings": config.tie_word_embeddings,
        "text_config": text,
        "vision_config": vision,
    }


def save_model(
    model: GlmForCausalLM, folder: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> None:
    """Write `model` in the official layout (see `save_state_dict`)."""
    save_state_dict(model.state_dict(), model.config, folder, max_shard_bytes)


def save_state_dict(
    state: dict[str, torch.Tensor],
    config: ModelConfig,
    folder: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write an internal-name state dict in the official layout: `model-0000i-of-0000n.safetensors` shards
    of at most `max_shard_bytes` (one tensor may exceed it), `model.safetensors.index.json` and `config.json`.

    Written to a temporary folder beside `folder`, then renamed into place (replacing an older `folder`).
    """
    folder = Path(folder)
    unloaded = [name for name, tensor in state.items() if tensor.device.type == "meta"]
    if unloaded:
        raise CheckpointError(
            f"cannot save {folder}: {len(unloaded)} tensors (e.g. {unloaded[0]}) were never loaded (a model "
            "loaded with layers=...); load all layers to save"
        )
    official = [pair for name, tensor in state.items() for pair in official_tensors(name, tensor)]
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    shard_bytes = 0
    for disk_key, tensor in official:
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((disk_key, tensor))
        shard_bytes += size

    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    staging.chmod(0o755)  # mkdtemp makes it private
    try:
        weight_map: dict[str, str] = {}
        for number, shard in enumerate(shards, start=1):
            file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            # copies: views of one internal tensor share storage, which safetensors refuses
            tensors = {key: tensor.detach().to("cpu", copy=True).contiguous() for key, tensor in shard}
            save_file(tensors, staging / file, metadata={"format": "pt"})
            weight_map.update({key: file for key in tensors})
            del tensors
        total = sum(tensor.numel() * tensor.element_size() for _, tensor in official)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        dtype = state["embed_tokens.weight"].dtype
        (staging / CONFIG_FILE).write_text(json.dumps(hf_config_dict(config, dtype), indent=2) + "\n")
        if folder.exists():
            old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
            folder.rename(old)
            staging.rename(folder)
            shutil.rmtree(old)
        else:
            staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
