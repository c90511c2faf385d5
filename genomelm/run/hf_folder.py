"""`genomelm export`: a run's checkpoint as the Hugging Face folder users load.

The folder loads with transformers' Auto classes as they map `glm5_next` (`AutoConfig`,
`AutoModelForImageTextToText` -> `Glm5NextForConditionalGeneration`, `AutoTokenizer`) and with genomelm's own
loader, and holds:
- the weights in the official layout (`model-*.safetensors` + index), from either checkpoint layout: a sharded
  one read layer by layer (`genomelm.parallel.export.write_export`), a one-process one loaded and saved;
- `vision.safetensors`: the architecture's vision tower, all zeros (`VISION_FILE`, see `vision_tensors`);
- `tokenizer.json` / `tokenizer_config.json`: one token per base, the ids the run trained on
  (`genomelm.data.hf_tokenizer`);
- `config.json` with scoring defaults (no KV cache, no BOS/EOS, the pad id of the vocabulary);
- `README.md`, the model card (`genomelm.run.model_card`).

It is written to a temporary folder beside OUT and renamed into place last.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from genomelm.data.hf_tokenizer import dna_tokenizer
from genomelm.data.integrity import load_manifest
from genomelm.data.vocab import Vocabulary
from genomelm.model import load_model
from genomelm.model.checkpoint import CONFIG_FILE, DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, save_model
from genomelm.model.config import ModelConfig
from genomelm.parallel.checkpoint import (
    MODEL_DIR,
    STATE_DIR,
    STEP_PREFIX,
    TRAINER_FILE,
    Checkpointer,
    is_sharded,
    verify_checkpoint,
)
from genomelm.parallel.export import ExportError, move_into_place, write_export
from genomelm.run.config import TrainConfig
from genomelm.run.model_card import model_card

VISION_FILE = "vision.safetensors"
VISION_PREFIX = "model.visual."


@dataclass(frozen=True)
class ExportSource:
    """What `genomelm export` reads: a checkpoint's step folder, the run it belongs to and its settings."""

    step: Path
    sharded: bool
    settings: TrainConfig | None  # the run's settings as the trainer state kept them (None: none kept)
    identity: dict[str, Any]  # the run's identity (model, seq, data fingerprint, vocabulary)

    @property
    def step_number(self) -> int:
        return int(self.step.name.removeprefix(STEP_PREFIX))


def find_source(path: str | Path) -> ExportSource:
    """The checkpoint `genomelm export` reads from `path`: a step folder (`runs/<run>/checkpoints/step-N`) of
    either layout, or a run folder (its newest complete checkpoint). A one-process checkpoint's model files
    are checked against their recorded checksums first."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(
            f"{path} is not a folder; give a run folder (runs/<run>) or one of its checkpoints/step-*"
        )
    if path.name.startswith(STEP_PREFIX) or (path / STATE_DIR).exists() or (path / MODEL_DIR).exists():
        step = path
    else:
        found = Checkpointer(path).complete()
        if not found:
            raise ExportError(
                f"{path} holds no complete checkpoint (checkpoints/{STEP_PREFIX}*); give a run folder that "
                "training saved a checkpoint into (save_every=...), or a step folder"
            )
        step = found[-1]
    sharded = is_sharded(step)
    if not sharded and not (step / MODEL_DIR / CONFIG_FILE).is_file():
        raise ExportError(
            f"{step} holds neither a sharded state ({STATE_DIR}/ with its metadata) nor a model "
            f"({MODEL_DIR}/{CONFIG_FILE}): an incomplete save; export an older step folder"
        )
    if not sharded:
        problems = verify_checkpoint(step, prefix=f"{MODEL_DIR}/")
        if problems:
            raise ExportError(f"{step} is damaged: {'; '.join(problems)}; export an older step folder")
    settings, identity = None, {}
    if (step / TRAINER_FILE).is_file():
        state = Checkpointer.read_trainer_state(step)
        identity = dict(state.get("identity") or {})
        if "config" in state:
            settings = TrainConfig.from_dict(state["config"], f"{step / TRAINER_FILE}", check=False)
    return ExportSource(step, sharded, settings, identity)


def vision_tensors(config: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The vision tower that `Glm5NextForConditionalGeneration` builds from `config` (a `glm5_next`
    config.json), every tensor zero, under its official names. genomelm never trains or runs it: a forward
    given `input_ids` alone never reaches it, so its weights cannot change a DNA score. They are stored so
    that loading initialises nothing at random and reports no missing weights."""
    from transformers import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    vision_config = Glm5NextConfig.from_dict(config).vision_config
    with torch.device("meta"):
        tower = Glm5NextVisionModel._from_config(vision_config)
    return {VISION_PREFIX + name: torch.zeros(t.shape, dtype=dtype) for name, t in tower.state_dict().items()}


def _scoring_config(config: dict[str, Any], vocab: Vocabulary) -> dict[str, Any]:
    """`config` with the defaults of a model that scores sequence rather than generating text: no KV cache,
    no BOS / EOS, the vocabulary's pad id."""
    text = dict(config["text_config"])
    text |= {"use_cache": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": vocab.pad_id}
    return config | {"text_config": text, "pad_token_id": vocab.pad_id}


def run_vocabulary(source: ExportSource, model: ModelConfig) -> Vocabulary:
    """The ids the run trained on: its identity's (from its data's manifest), else the built-in ones when the
    model's vocabulary can hold them."""
    ids = source.identity.get("vocabulary")
    if ids is None:
        if model.vocab_size > 64:
            raise ExportError(
                f"{source.step / TRAINER_FILE} does not record the run's vocabulary and the model has "
                f"{model.vocab_size:,} token ids: export a checkpoint written by genomelm train"
            )
        ids = list(range(6))
    return Vocabulary(code_to_id=tuple(int(i) for i in ids), vocab_size=model.vocab_size)


def _write_weights(source: ExportSource, folder: Path, dtype: torch.dtype, max_shard_bytes: int) -> None:
    """The model's files in the official layout, straight into `folder`."""
    if source.sharded:
        write_export(source.step, folder, dtype, max_shard_bytes, progress=True)
        return
    # a one-process run fits one process: the model is loaded whole (its fp32-declared parameters stay fp32)
    model = load_model(source.step / MODEL_DIR, dtype=dtype)
    written = folder / ".weights"
    save_model(model, written, max_shard_bytes)
    for path in written.iterdir():
        path.rename(folder / path.name)
    written.rmdir()


def _add_vision(folder: Path, config: dict[str, Any], dtype: torch.dtype) -> None:
    """Write `VISION_FILE` and list its tensors in the weights' index."""
    tensors = vision_tensors(config, dtype)
    save_file(tensors, folder / VISION_FILE, metadata={"format": "pt"})
    index = json.loads((folder / INDEX_FILE).read_text())
    index["weight_map"] |= dict.fromkeys(tensors, VISION_FILE)
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def data_manifests(settings: TrainConfig | None) -> list[tuple[str, float, dict | None]]:
    """(folder, weight, manifest or None where the folder is not here) of each training data folder."""
    if settings is None:
        return []
    return [(folder, weight, load_manifest(folder)) for folder, weight in settings.data_blend]


def export_run(
    source_path: str | Path,
    out: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    force: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> ExportSource:
    """Export the checkpoint at `source_path` (run or step folder, either layout) to the Hugging Face folder
    `out` (see the module docstring); returns what was exported. `dtype`: the weights' dtype but for the
    parameters the model declares fp32. An existing non-empty `out` is replaced only with `force`."""
    out = Path(out)
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not empty; choose another OUT or give force=true")
    source = find_source(source_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it private
    try:
        _write_weights(source, staging, dtype, max_shard_bytes)
        config = json.loads((staging / CONFIG_FILE).read_text())
        model = ModelConfig.from_dict(config)
        vocab = run_vocabulary(source, model)
        config = _scoring_config(config, vocab)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        _add_vision(staging, config, dtype)
        seq = source.settings.seq_len if source.settings is not None else int(source.identity.get("seq", 0))
        dna_tokenizer(vocab, seq or 2**20).save_pretrained(staging)
        card = model_card(
            source.step,
            source.step_number,
            source.settings,
            source.identity,
            model,
            vocab,
            dtype,
            data_manifests(source.settings),
        )
        (staging / "README.md").write_text(card)
        for path in staging.iterdir():
            path.chmod(0o644)  # a folder to share: safetensors writes its files private
        move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return source
