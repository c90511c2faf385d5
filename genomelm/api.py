"""The Python API: `genomelm.load(run_or_folder)` -> `GenomeModel`, for notebooks and scripts.

    import genomelm
    model = genomelm.load("runs/demo")                  # a run (its newest checkpoint), or an exported folder
    loss = model.score("ACGTTGCA...")                   # float32 [bases]: nats per base, NaN where unscored
    loss = model.score("NC_004353.4:1000001-1010000")   # a region of the run's reference (or fasta=...)
    vector = model.embed("NC_004353.4:1000001-1010000") # float32 [D]: mean over its A/C/G/T bases
    rows = model.score_variants("variants.vcf.gz", "reference.fa")

Everything runs in this process, on the GPU when there is one, through the commands' own code: the models
`genomelm eval` scores (`load_scoring_model`), the track windows and their per-token losses
(`genomelm track`), the layer states `genomelm embed` reads, the variant windows of `genomelm variants`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from genomelm.data.integrity import load_manifest
from genomelm.data.reference import read_reference, source_files
from genomelm.data.regions import Interval
from genomelm.data.vocab import CODE_NAMES, IGNORE_INDEX, INVALID, LETTERS, SCAN_BYTES, Vocabulary
from genomelm.data.windows import Window
from genomelm.eval.embed import resolve_layer
from genomelm.eval.tracks import RegionBases, parse_region, region_windows
from genomelm.eval.variants import allele_scores, load_variants, score_sites, window_tokens
from genomelm.model.checkpoint import CONFIG_FILE
from genomelm.model.config import ModelConfig
from genomelm.parallel.checkpoint import MODEL_DIR, STATE_DIR
from genomelm.run.config import TrainConfig
from genomelm.run.hf_folder import find_source, run_vocabulary
from genomelm.run.models import device_rows, run_device
from genomelm.run.precision import autocast_for
from genomelm.run.scoring import ScoringRun, WindowShare, load_scoring_model, token_losses

REGION = re.compile(r"^[^\s:]+:[\d,]+-[\d,]+$")
DEFAULT_SEQ = 16384  # window length for an exported folder that does not record one


@dataclass
class GenomeModel:
    """A loaded model with its vocabulary: `seq` tokens a window (longer inputs are scored window by window,
    each window's first base the last one the window before predicts), `settings` the run's (None for an
    exported folder), `source` what was loaded."""

    model: torch.nn.Module
    vocab: Vocabulary
    seq: int
    settings: TrainConfig
    source: str
    run: bool  # loaded from a run folder (its reference is known)
    progress: bool = True

    # ------------------------------------------------------------------------------------------- inputs
    def _bases(self, what: str, fasta: str | None) -> tuple[RegionBases, int, int]:
        """(the bases to read, the first and the end base (0-based) the answer covers) of a sequence or a
        region `chr:start-end` (1-based, inclusive)."""
        if what.endswith((".bed", ".bed.gz")):
            raise ValueError(
                f"{what}: one region or sequence at a time; `genomelm track region={what}` reads BED"
            )
        if not REGION.match(what):
            text = "".join(what.split())
            scan = np.frombuffer(text.encode().translate(SCAN_BYTES), dtype=np.uint8)
            bad = np.flatnonzero(scan == INVALID)
            if len(bad):
                raise ValueError(
                    f"base {bad[0] + 1}: {text[bad[0]]!r} is no base; give A C G T N or IUPAC codes"
                )
            return RegionBases(Interval("api", what[:20], "sequence", 0, len(scan)), 0, scan), 0, len(scan)
        paths = [Path(p) for p in fasta.split(",")] if fasta else self._reference()
        sizes, _ = read_reference(paths, {})
        (interval,) = parse_region(what, sizes, [str(p) for p in paths])
        assert interval.end is not None  # parse_region gives every interval its end
        first = max(interval.start - 1, 0)  # the base before: context for the region's first base
        _, bases = read_reference(paths, {interval.record: [(first, interval.end)]})
        return RegionBases(interval, first, bases[interval.record, first]), interval.start, interval.end

    def _reference(self) -> list[Path]:
        manifest = load_manifest(self.settings.data_dir) if self.run else None
        if manifest is None:
            raise ValueError(
                f"{self.source}: no reference known for a region (the run's prepared data is not here, or an "
                "exported folder); give fasta=FILE"
            )
        return source_files(self.settings.data_dir, manifest)

    def _windows(self, part: RegionBases) -> list[Window]:
        return region_windows([part], self.seq, self.vocab)

    def _bar(self, windows: list[Window], what: str) -> tqdm:
        return tqdm(windows, desc=what, unit="window", disable=not self.progress or len(windows) < 2)

    # ------------------------------------------------------------------------------------------ methods
    def score(self, what: str, fasta: str | None = None) -> np.ndarray:
        """float32 [bases]: the loss (nats) of each base of `what` given the bases before it, NaN where
        nothing is scored (the first base of a sequence or record, N). `what`: a DNA sequence, or a region
        `chr:start-end` (1-based, inclusive) of `fasta` (default: the run's source reference)."""
        part, lo, hi = self._bases(what, fasta)
        out = np.full(hi - lo, np.nan, dtype=np.float32)
        precision = self.settings.memory.precision
        with torch.no_grad():
            for window in self._bar(self._windows(part), "score"):
                count = window.end - window.start - 1  # positions predicting a base of the window
                losses = token_losses(self.model, window, precision)[:count]
                valid = (window.labels[:count] != IGNORE_INDEX).numpy()
                bases = np.arange(window.start + 1, window.end)
                keep = (bases >= lo) & (bases < hi) & valid
                out[bases[keep] - lo] = losses[keep]
        return out

    def embed(self, what: str, layer: int = -1, pool: str = "mean", fasta: str | None = None) -> np.ndarray:
        """The hidden states of decoder layer `layer` (-1: the last; `embed_layer` of `genomelm embed`) over
        `what` (a sequence or a region, as `score`), read window by window: pool "mean" float32 [D], averaged
        over the A/C/G/T bases; "base" float32 [bases, D], one row per base."""
        if pool not in ("mean", "base"):
            raise ValueError(f"pool={pool!r}: give 'mean' or 'base'")
        part, lo, hi = self._bases(what, fasta)
        upto = resolve_layer(layer, self.model.config.num_hidden_layers, self.source)
        device = next(self.model.parameters()).device
        pad_id, n_id = self.vocab.ignored_ids
        rows: list[np.ndarray] = []
        total, count = None, 0
        with torch.no_grad():
            # the windows `score` reads, each of its bases once: the first window from its first base
            for window in self._bar(self._windows(part), "embed"):
                skip = 0 if window.start == part.first else 1
                (ids,) = device_rows([window.ids], device)
                with autocast_for(self.settings.memory.precision, device):
                    states = self.model.hidden_states(ids, upto_layer=upto)[0].float()
                bases = np.arange(window.start, window.end)[skip:]
                keep = (bases >= lo) & (bases < hi)
                chosen = states[skip : window.end - window.start][torch.from_numpy(keep).to(device)]
                if pool == "base":
                    rows.append(chosen.cpu().numpy())
                    continue
                real = ids[0, skip : window.end - window.start][torch.from_numpy(keep).to(device)]
                real = (real != pad_id) & (real != n_id)
                summed = chosen[real].double().sum(0)
                total = summed if total is None else total + summed
                count += int(real.sum())
        if pool == "base":
            return np.concatenate(rows).astype(np.float32)
        if not count:
            raise ValueError(f"{what[:40]}: no A, C, G or T base to average")
        return (total / count).float().cpu().numpy()

    def score_variants(
        self, vcf: str | Path, fasta: str | Path | None = None, context: int = 0, position: str = "end"
    ) -> list[dict]:
        """Zero-shot effects of the VCF's ALT alleles, as `genomelm variants` scores them: per allele (VCF
        order) its chrom, pos, ref, alt, status ("" when scored) and `llr` = log P(ALT window) - log P(REF
        window) in nats (`llr_per_base` over the scored bases); windows of `context` tokens (0: the model's
        `seq`), the variant at the window's `position` ("end" or "center"). `fasta`: the reference (default:
        the run's)."""
        config = self.settings.replace(
            vcf=str(vcf),
            fasta=None if fasta is None else str(fasta),
            variant_context=context or self.seq,
            variant_position=position,
            dp=1,
            cp=1,
            ep=1,
        )
        tokens = window_tokens(config)
        variants = load_variants(config, tokens, None if self.run else self.vocab)
        sums = score_sites(self.model, variants.plan, config.memory.precision, progress=self.progress)
        scores = allele_scores({"before": sums, "after": sums})
        site_of = {(s.allele.record, s.allele.index): i for i, s in enumerate(variants.plan.sites)}
        rows = []
        for allele in variants.alleles:
            i = site_of.get((allele.record, allele.index))
            scored = i is not None
            rows.append(
                {
                    "chrom": allele.contig,
                    "pos": allele.pos,
                    "ref": allele.ref,
                    "alt": allele.alt,
                    "status": allele.status or "",
                    "llr": float(scores.llr["after"][i]) if scored else float("nan"),
                    "llr_per_base": float(scores.per_base["after"][i]) if scored else float("nan"),
                }
            )
        return rows


def _tokenizer_vocabulary(folder: Path, model: ModelConfig) -> tuple[Vocabulary, int | None]:
    """The ids of an exported folder's tokenizer (`genomelm export`) and its window length; the built-in
    vocabulary when there is no tokenizer and the model's vocabulary is that small."""
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file():
        if model.vocab_size > 64:
            raise ValueError(f"{folder} has no tokenizer.json: export the run with `genomelm export`")
        return Vocabulary(tuple(range(len(CODE_NAMES))), model.vocab_size), None
    ids = json.loads(tokenizer.read_text())["model"]["vocab"]
    code_to_id = (ids["<pad>"], *(ids[letter] for letter in LETTERS))
    settings = folder / "tokenizer_config.json"
    seq = json.loads(settings.read_text()).get("model_max_length") if settings.is_file() else None
    return Vocabulary(tuple(int(i) for i in code_to_id), model.vocab_size), seq


def load(
    path: str | Path, device: str | torch.device | None = None, seq: int | None = None, progress: bool = True
) -> GenomeModel:
    """A model to score, embed and score variants with: `path` a run folder (`runs/<run>`: its newest
    checkpoint, either layout, with the run's settings and vocabulary), a checkpoint's step folder, or a
    Hugging Face folder (`genomelm export`'s, or any `glm5_next` checkpoint). `device`: default the GPU when
    there is one; `seq`: tokens per window (default: the run's, or the tokenizer's `model_max_length`)."""
    path = Path(path)
    device = torch.device(device) if device is not None else run_device()
    scoring = ScoringRun(None, device, WindowShare(device=device))
    if (path / CONFIG_FILE).is_file() and not (path / STATE_DIR).is_dir():
        config = ModelConfig.from_file(path)
        vocab, folder_seq = _tokenizer_vocabulary(path, config)
        settings = TrainConfig().replace(model=str(path))
        model = load_scoring_model(str(path), settings, scoring)
        return GenomeModel(
            model, vocab, seq or int(folder_seq or DEFAULT_SEQ), settings, str(path), False, progress
        )
    source = find_source(path)
    settings = source.settings if source.settings is not None else TrainConfig()
    weights = source.step if source.sharded else source.step / MODEL_DIR
    model = load_scoring_model(str(weights), settings.replace(dp=1, cp=1, ep=1), scoring)
    vocab = run_vocabulary(source, model.config)
    return GenomeModel(model, vocab, seq or settings.seq_len, settings, str(weights), True, progress)
