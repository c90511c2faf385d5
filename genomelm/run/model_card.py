"""The model card (`README.md`) of an exported folder (`genomelm.run.hf_folder`): base model, data and splits
with their checksums (from the prepared data's manifest), training settings, the run's before/after table
(from `results/<run>/buckets.json`, when `genomelm eval` wrote one), licences, and how to load and score."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import yaml

from genomelm.data.vocab import CODE_NAMES, Vocabulary
from genomelm.model.config import ModelConfig, RunOptions, is_preset
from genomelm.model.model import GlmForCausalLM
from genomelm.run.config import TrainConfig

BUCKETS_FILE = "buckets.json"
# what the data stage's sources are known to be distributed under (by file name or source kind)
DATA_TERMS = {
    "dmel_chr4.fa.gz": "D. melanogaster chr4, RefSeq NC_004353.4: INSDC / RefSeq data, which NCBI "
    "distributes without restriction (genomelm's data/NOTICE.md)",
    "hg38": "GRCh38 from UCSC goldenPath: the UCSC download folder states the hg38 files are freely usable "
    "for any purpose",
}


def _front_matter(base: str, licence: str) -> str:
    meta: dict[str, Any] = {
        "library_name": "transformers",
        "license": licence,
        "tags": ["genomics", "dna", "glm5_next", "genomelm", "long-context"],
    }
    if base:
        meta["base_model"] = base
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def _base_model(settings: TrainConfig | None, identity: dict[str, Any]) -> tuple[str, str, str]:
    """(base model name for the front matter, a sentence about it, its licence id)."""
    model = settings.model if settings is not None else identity.get("model")
    if not model:
        return "", "The base model is not recorded in the checkpoint.", "other"
    if is_preset(model):
        return (
            "",
            f"No pretrained base: genomelm's `{model}` preset of the GLM-5.3-Flash architecture "
            "(`glm5_next`), initialised at random and trained from scratch on this data.",
            "apache-2.0",
        )
    licence, where = _folder_licence(Path(model))
    return (
        Path(model).name,
        f"Fine-tuned from the checkpoint `{Path(model).name}` (GLM-5.3-Flash architecture, `glm5_next`); "
        f"its licence: {where}.",
        licence,
    )


def _folder_licence(folder: Path) -> tuple[str, str]:
    """(licence id, where it was found) of a base checkpoint folder: its model card's `license:`."""
    card = folder / "README.md"
    if card.is_file():
        text = card.read_text(errors="replace")
        if text.startswith("---"):
            try:
                meta = yaml.safe_load(text.split("---", 2)[1]) or {}
            except yaml.YAMLError:
                meta = {}
            if isinstance(meta, dict) and meta.get("license"):
                return str(meta["license"]), f"`{meta['license']}` (from its model card)"
    return "other", "not found beside it (no model card with `license:`); the base model's terms apply"


def _data_section(manifests: list[tuple[str, float, dict | None]], identity: dict[str, Any]) -> list[str]:
    lines = ["## Data", ""]
    if not manifests:
        return [*lines, "Not recorded in the checkpoint.", ""]
    if identity.get("data_fingerprint"):
        lines += [f"Prepared-data fingerprint recorded by the run: `{identity['data_fingerprint']}`.", ""]
    terms: list[str] = []
    for folder, weight, manifest in manifests:
        lines.append(f"### `{folder}` (weight {weight:g})")
        lines.append("")
        if manifest is None:
            lines += [f"The folder's `manifest.json` was not found at export time (`{folder}`).", ""]
            continue
        lines.append(
            f"Made by `{manifest.get('command', '?')}`; fingerprint `{manifest.get('fingerprint')}`."
        )
        lines += ["", "| source | format | bytes | md5 |", "|---|---|---|---|"]
        for entry in manifest.get("sources", []):
            path = Path(str(entry.get("path", "?")))
            lines.append(
                f"| `{path.name}` | {entry.get('format', '?')} | {entry.get('bytes', 0):,} | "
                f"`{entry.get('md5') or '-'}` |"
            )
            terms.append(DATA_TERMS.get(path.name, ""))
        if manifest.get("settings", {}).get("source") == "hg38":
            terms.append(DATA_TERMS["hg38"])
        lines += ["", "| split | regions | windows | bases | soft-masked |", "|---|---|---|---|---|"]
        for split, entry in manifest.get("splits", {}).items():
            regions = ", ".join(r.get("spec", "?") for r in entry.get("regions", [])[:6])
            more = len(entry.get("regions", [])) - 6
            regions += f" (+{more} more)" if more > 0 else ""
            stats = entry.get("stats", {})
            lines.append(
                f"| {split} | {regions} | {stats.get('windows', 0):,} "
                f"| {stats.get('bases', 0):,} | {stats.get('softmasked', 0):,} |"
            )
        checksums = manifest.get("checksums", {})
        lines += [
            "",
            f"Checksums of the prepared files ({checksums.get('hash', '?')} of each "
            f"{checksums.get('block_bytes', 0) / 2**20:g} MiB block):",
            "",
        ]
        lines += ["| file | bytes | first block | blocks |", "|---|---|---|---|"]
        for name, entry in checksums.get("files", {}).items():
            blocks = entry.get("blocks", [])
            lines.append(
                f"| `{name}` | {entry.get('bytes', 0):,} | `{blocks[0] if blocks else '-'}` | {len(blocks)} |"
            )
        lines.append("")
    known = sorted({term for term in terms if term})
    lines += [
        "Data licence: " + ("; ".join(known) if known else "the terms of the sources listed above") + ".",
        "",
    ]
    return lines


def _settings_section(settings: TrainConfig | None, step: int) -> list[str]:
    lines = ["## Training", ""]
    if settings is None:
        return [*lines, f"Checkpoint after step {step}; its settings were not recorded.", ""]
    optim = settings.optim
    lines += [
        f"Run `{settings.run}`, checkpoint after optimizer step {step} of {optim.steps}: windows of "
        f"{settings.seq_len:,} tokens (one per base), optimizer `{optim.optimizer}`, peak lr {optim.lr:g} "
        f"({optim.warmup_steps} warm-up steps, then cosine to {optim.min_lr_ratio:g} x), weight decay "
        f"{optim.weight_decay:g}, gradient clip {optim.grad_clip}, {optim.grad_accum} window(s) per step and "
        f"rank, seed {optim.seed}, mesh dp={settings.parallel.dp} cp={settings.parallel.cp} "
        f"ep={settings.parallel.ep}, precision `{settings.memory.precision}`, reverse-complement "
        f"augmentation {settings.data_options.rc_aug:g}, soft-masked loss weight "
        f"{settings.data_options.softmask_weight:g}.",
        "",
        "<details><summary>Every setting (as the run's <code>runs/&lt;run&gt;/config.yaml</code> holds them; "
        "<code>genomelm train</code> reads this YAML as a run config)</summary>",
        "",
        "```yaml",
        yaml.safe_dump(settings.to_dict(), sort_keys=False).rstrip(),
        "```",
        "",
        "</details>",
        "",
    ]
    return lines


def _loss(value: Any) -> str:
    return "-" if value is None else f"{value:.4f}"


def _change(row: dict) -> str:
    """A bucket's (or the overall) relative change with its paired 95% interval, as `genomelm eval` prints
    it (the `intervals` entry of a result; its bare value for a result written without one)."""
    interval = row.get("intervals", {}).get("change")
    if interval is None or interval["value"] is None:
        return "-" if row["change"] is None else f"{100 * row['change']:+.2f}%"
    if interval["low"] is None or interval["high"] is None:
        return f"{100 * interval['value']:+.2f}% (n/a: {interval['note']})"
    half = 100 * (interval["high"] - interval["low"]) / 2
    return f"{100 * interval['value']:+.2f} ± {half:.2f}%" + (" *" if interval["excludes_zero"] else "")


def _results_section(settings: TrainConfig | None) -> list[str]:
    lines = ["## Held-out loss by position, before and after training", ""]
    path = settings.results_path / BUCKETS_FILE if settings is not None else None
    if path is None or not path.is_file():
        where = f" (`{path}`)" if path is not None else ""
        return [*lines, f"No evaluation found{where}: `genomelm eval` writes it.", ""]
    result = json.loads(path.read_text())
    sets = [(entry["name"], entry) for entry in result["sets"]] if "sets" in result else [("", result)]
    provenance = result.get("provenance", {})
    lines.append(
        f"From `{path}` (written by `genomelm eval`): before = `{provenance.get('before_model', '?')}`, "
        f"after = `{provenance.get('after_model', '?')}`; loss in nats per base; change: relative, ± the "
        "half-width of its 95% interval paired across windows, * where the interval excludes 0."
    )
    for name, one in sets:
        lines += ["", f"**{name}**", ""] if name else [""]
        lines += ["| positions | tokens | windows | before | after | change |", "|---|---|---|---|---|---|"]
        for bucket in one["buckets"]:
            lines.append(
                f"| {bucket['start']:,}-{bucket['end']:,} | {bucket['after']['tokens']:,} | "
                f"{bucket['after']['windows']} | {_loss(bucket['before']['loss'])} | "
                f"{_loss(bucket['after']['loss'])} | {_change(bucket)} |"
            )
        overall = one["overall"]
        lines.append(
            f"| all | {overall['tokens']:,} | {overall.get('windows', '-')} | "
            f"{_loss(overall['loss_before'])} | {_loss(overall['loss_after'])} | {_change(overall)} |"
        )
    return [*lines, ""]


def _vocab_line(vocab: Vocabulary) -> str:
    ids = ", ".join(f"{name}={i}" for name, i in zip(CODE_NAMES, vocab.code_to_id, strict=True))
    return (
        f"One token per base ({ids}; `<pad>` is pad). Lower case (soft-masked repeats) reads as upper case, "
        "IUPAC ambiguity codes and any other letter as N; no BOS or EOS is added. pad and N are never scored "
        "as targets."
    )


USAGE = """## Loading and scoring

```python
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

folder = "{folder}"
config = AutoConfig.from_pretrained(folder)                   # model_type glm5_next
model = AutoModelForImageTextToText.from_pretrained(folder).eval()   # Glm5NextForConditionalGeneration
tokenizer = AutoTokenizer.from_pretrained(folder)

ids = tokenizer("ACGTTGCAnnACGT", return_tensors="pt").input_ids   # one id per base
with torch.no_grad():
    logits = model(input_ids=ids).logits[:, :-1].float()
loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
# loss[0, i]: nats for base i + 1 given bases 0..i; ignore targets that are N or pad
```

`AutoModelForCausalLM` does not map `glm5_next`: transformers registers this architecture for
image-text-to-text. With genomelm installed, `genomelm.load("{folder}")` gives `score`, `embed` and
`score_variants` on the same folder.
"""


def model_card(
    step_dir: Path,
    step: int,
    settings: TrainConfig | None,
    identity: dict[str, Any],
    model: ModelConfig,
    vocab: Vocabulary,
    dtype: torch.dtype,
    manifests: list[tuple[str, float, dict | None]],
) -> str:
    """The README.md of an exported folder."""
    base, base_line, licence = _base_model(settings, identity)
    name = settings.run if settings is not None else step_dir.parent.parent.name
    parameters = _parameter_count(model)
    lines = [
        _front_matter(base, licence),
        f"# {name}: a genome language model (genomelm)",
        "",
        f"Exported by `genomelm export` from `{step_dir}`. {base_line}",
        "",
        f"Architecture: GLM-5.3-Flash text model, {model.num_hidden_layers} layers "
        f"({len(model.kda_layers)} Kimi Delta Attention, {len(model.dsa_layers)} DeepSeek Sparse Attention), "
        f"hidden size {model.hidden_size}, {model.n_routed_experts} routed experts, about {parameters:,} "
        f"text-model parameters; weights {str(dtype).removeprefix('torch.')} (the parameters the model "
        "declares fp32 stay fp32).",
        "",
        "## Tokenizer",
        "",
        _vocab_line(vocab),
        "",
        *_settings_section(settings, step),
        *_data_section(manifests, identity),
        *_results_section(settings),
        "## The vision tower",
        "",
        "`glm5_next` is a vision-language architecture, and its model class always builds a vision tower. "
        "genomelm trains the text model only: `vision.safetensors` holds a one-block placeholder tower "
        "(config.json's `vision_config`), every weight zero. Loading is safe: the folder lists every weight "
        "the class expects, so nothing is initialised at random, and a forward given `input_ids` alone "
        "(no `pixel_values`) never runs the tower, so it cannot change a score. Do not give it images.",
        "",
        "## Licences",
        "",
        f"- Weights: `{licence}` (front matter), "
        + (
            "genomelm's own licence: no base weights went into them; set your terms if you publish them."
            if settings is not None and is_preset(settings.model)
            else "following the base model above."
        ),
        "- genomelm, the code that trained and exported them: Apache-2.0.",
        "- Data: see the Data section.",
        "",
        USAGE.format(folder="path/to/this/folder"),
    ]
    return "\n".join(lines)


def _parameter_count(model: ModelConfig) -> int:
    """Parameters of the text model (built on the meta device: no memory)."""
    meta = GlmForCausalLM.from_config(model, RunOptions(), torch.float32, "meta")
    return sum(p.numel() for p in meta.parameters())
