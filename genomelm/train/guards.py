"""Checks the trainer makes before its first step, each with a message that says what to do.

- a random full-size model (a preset, not a checkpoint) is refused unless asked for
  (`allow_random_init=true`);
- the data's token ids must be the model's: the tokenizer in a checkpoint folder, or the vocabulary size and
  padding id of a preset;
- a resumed run must be the same run: model, window length, data and vocabulary; and its steps must mean the
  same (`same_step`): as many windows per optimizer step (dp x grad_accum), kept by raising or lowering
  grad_accum when the dp changed, refused when no grad_accum can keep it;
- the run folder must take what the run writes (`check_run_folder`): a file standing where a checkpoint goes,
  or a folder that cannot be written, is refused before the first step instead of when the step is saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from genomelm.data.vocab import Vocabulary, tokenizer_vocabulary
from genomelm.model import GlmForCausalLM, ModelConfig
from genomelm.parallel.checkpoint import Checkpointer
from genomelm.run.lock import check_writable

RANDOM_INIT_LIMIT = 1e9  # parameters above which a random initialisation is refused without allow_random_init
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class RunMismatch(ValueError):
    """A run setting that contradicts the model, the data or the checkpoint being resumed."""


class RunFolderBlocked(ValueError):
    """The run folder cannot take what the run will write; the message names the path and the fix."""


def check_run_folder(checkpointer: Checkpointer, start_step: int, last_step: int) -> None:
    """Refuse a run whose checkpoints of steps after `start_step` up to `last_step` could not be written: a
    file in their way (`Checkpointer.blocked`) or a run or checkpoints folder this process cannot write to."""
    blocked = checkpointer.blocked(start_step, last_step)
    if blocked:
        path, what = blocked[0]
        more = f" (and {len(blocked) - 1} more such entries)" if len(blocked) > 1 else ""
        raise RunFolderBlocked(
            f"{path} is a file where the run writes {what}{more}: move it out of {path.parent} (or remove "
            "it) and run again"
        )
    for folder in (checkpointer.run_dir, checkpointer.root):
        if folder.is_dir():
            check_writable(folder)


def parameter_count(config: ModelConfig) -> int:
    """Exact parameter count, from the model built on the meta device (no memory, about a second at full
    size)."""
    model = GlmForCausalLM.from_config(config, device="meta")
    return sum(p.numel() for p in model.parameters())


def check_random_init(model: str, preset: ModelConfig | None, allow_random_init: bool) -> None:
    """Refuse training a preset of more than RANDOM_INIT_LIMIT parameters from random weights."""
    if preset is None or allow_random_init:
        return
    count = parameter_count(preset)
    if count > RANDOM_INIT_LIMIT:
        raise RunMismatch(
            f"model={model} is a preset: {count / 1e9:.1f}B parameters of random weights, so training would "
            "start from noise (and first save the random weights as the run's 'before' model). Give the "
            "released checkpoint folder instead: make train MODEL=/path/to/GLM-5.3-Flash "
            "(or model=<folder>); for memory and speed benchmarks only, add allow_random_init=true"
        )


def check_vocabulary(data_vocab: Vocabulary, data_dir: Path, model: str, config: ModelConfig) -> None:
    """The data's token ids must be the model's.

    A checkpoint folder with a tokenizer: the data must have been prepared with it (same ids for A, C, G, T, N
    and padding). Otherwise: every id must be inside the model's vocabulary, and the padding id must be the
    model's `pad_token_id` when it has one.
    """
    folder = Path(model)
    source = model if folder.is_dir() else "/path/to/the/checkpoint/folder"  # a preset has no tokenizer
    fix = f"make data TOKENIZER={source} (genomelm data tokenizer={source})"
    if folder.is_dir() and any((folder / name).exists() for name in TOKENIZER_FILES):
        wanted = tokenizer_vocabulary(folder)
        if tuple(wanted.code_to_id) != tuple(data_vocab.code_to_id):
            raise RunMismatch(
                f"{data_dir} was tokenised with {_describe(data_vocab)}, but the model {model} uses ids "
                f"{_ids(wanted)} from its tokenizer: prepare the data again with {fix}"
            )
        return
    largest = max(data_vocab.code_to_id)
    pad_mismatch = config.pad_token_id is not None and data_vocab.pad_id != config.pad_token_id
    if largest >= config.vocab_size or pad_mismatch:
        raise RunMismatch(
            f"{data_dir} was tokenised with {_describe(data_vocab)}, but the model {model} has a "
            f"{config.vocab_size:,}-token vocabulary with padding id {config.pad_token_id}: prepare the data "
            f"with the model's tokenizer, {fix}"
        )


def _ids(vocab: Vocabulary) -> str:
    names = ("pad", "A", "C", "G", "T", "N")
    return ", ".join(f"{n}={i}" for n, i in zip(names, vocab.code_to_id, strict=True))


def _describe(vocab: Vocabulary) -> str:
    source = f"the tokenizer {vocab.tokenizer}" if vocab.tokenizer else "the built-in vocabulary"
    return f"{source} (ids {_ids(vocab)}; {vocab.vocab_size} entries)"


def run_identity(config: Any, data_manifest: dict) -> dict[str, Any]:
    """What must not change between a run and its resumption."""
    return {
        "model": config.model,
        "seq": config.seq_len,
        "data_fingerprint": data_manifest.get("fingerprint"),
        "vocabulary": list(data_manifest["vocab"]["code_to_id"]),
        "optimizer": config.optim.optimizer,  # the weights' dtype and the moments are its own
    }


IDENTITY_BEFORE = {"optimizer": "adamw"}  # what a checkpoint written before a key existed had


def check_resume(saved: dict[str, Any] | None, current: dict[str, Any], checkpoint: Path) -> None:
    """Refuse to continue `checkpoint` (whose trainer state stored `saved`) with a different run."""
    if saved is None:
        return
    differ = [
        f"{key}: {saved.get(key, IDENTITY_BEFORE.get(key))!r} then, {value!r} now"
        for key, value in current.items()
        if saved.get(key, IDENTITY_BEFORE.get(key)) != value
    ]
    if differ:
        raise RunMismatch(
            f"resume=auto found {checkpoint}, written by a different run ({'; '.join(differ)}). Continue "
            "with the original settings, or start a new run beside it: resume=never run=<new name>"
        )


def same_step(config: Any, saved: dict[str, Any] | None, checkpoint: Path) -> tuple[Any, str | None]:
    """`config` resuming `checkpoint` (whose trainer state stored the settings `saved`) with as many windows
    per optimizer step (dp x grad_accum) as the run had: grad_accum changed to keep them when dp changed; and
    a line saying what changed of the layout (dp, cp, ep) and that the step means the same, None when nothing
    did. `RunMismatch` when the new dp does not divide the windows per step."""
    if saved is None:
        return config, None
    parallel, optim = saved.get("parallel", {}), saved.get("optim", {})
    then = {name: int(parallel.get(name, 1)) for name in ("dp", "cp", "ep")}
    now = {name: int(getattr(config.parallel, name)) for name in ("dp", "cp", "ep")}
    windows = then["dp"] * int(optim.get("grad_accum", 1))
    accum = config.optim.grad_accum
    if now["dp"] * accum != windows:
        if windows % now["dp"]:
            raise RunMismatch(
                f"{checkpoint} trained {windows} windows per optimizer step (dp={then['dp']} x grad_accum="
                f"{windows // then['dp']}), which dp={now['dp']} cannot keep: resume with a dp that divides "
                f"{windows} (grad_accum then follows), or start a new run beside it: resume=never "
                "run=<new name>"
            )
        config = config.replace(grad_accum=windows // now["dp"])
    if then == now and config.optim.grad_accum == accum:
        return config, None
    layout = (
        " ".join(f"{k}={v}" for k, v in then.items()) + " -> " + " ".join(f"{k}={v}" for k, v in now.items())
    )
    kept = (
        f"; grad_accum={accum} -> {config.optim.grad_accum} to keep them"
        if config.optim.grad_accum != accum
        else ""
    )
    return config, (
        f"resuming {checkpoint.name} at another layout ({layout}): {windows} windows per optimizer step as "
        f"before{kept}, so each step means the same (sums may differ in their last bits)"
    )
