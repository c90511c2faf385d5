"""`genomelm variants CONFIG vcf=FILE [fasta=FILE] [variant_context=N] [variant_position=end|center]
[skip_mismatch=true] [contig_map=FILE] [--before PATH] [--after PATH]`: zero-shot variant effects.

Every ALT allele of a VCF record (a multi-allelic record gives one per ALT) is scored as a log-likelihood
ratio: log P(ALT window) - log P(REF window), in nats, with the model before and after training. The two
windows are cut from the reference around the variant, N = `variant_context` tokens each (0: the run's SEQ):

    REF window:  C context bases | REF allele | F following bases | (the rest of the window, not scored)
    ALT window:  C context bases | ALT allele | F following bases | (the rest of the window, not scored)

- The leading bases REF and ALT share (a VCF indel's anchor base) are moved into the context, so an allele
  is only what differs (a deletion's ALT allele is empty). The context is the same C reference bases in both
  windows: the windows are aligned on what precedes the variant, and its log-probabilities cancel.
- Scored: the allele and the F reference bases after it (the same F bases in both windows, so the two
  haplotypes are compared up to the same reference position). `llr` is the sum of log-probabilities over
  them, ALT minus REF (an indel sums len(ALT) + F against len(REF) + F bases; below 0: the model finds the
  ALT less likely); `llr_per_base` is the mean log-probability per scored base of the ALT window minus that
  of the REF window (for an SNV or MNV, llr / (allele + F)). N and padding are never scored.
- `variant_position=end` (default): the allele and F = FOLLOWING_BASES (32) following bases end the window,
  the whole rest of it, C = N - L - 32, precedes it (L: the longer allele). `center`: C = (N - L) // 2 and
  F = N - C - L, the rest of the window.
- The shorter allele's window runs on with further reference bases to N tokens: they are not scored and,
  the model being causal, change nothing that is. Every forward pass is N tokens (a window reaching a
  record's end is padded): the DSA indexer breaks ties between equal pool scores by the number of pools in
  the window, so a window of another length can select other pools for the same context (0.007 nats apart
  at a token on the tiny preset's random weights), and the dp replicas run passes of one length
  (`WindowShare`).
- Near a record's start (or end) the window holds the bases there are: fewer than C (or F); the variant is
  scored with them and flagged (`short_context`).

The reference is the run's own source (the prepared folder's manifest names its files) or `fasta=` (any
format `genomelm data` reads, through its readers and the run's vocabulary). VCF contigs are matched to its
records by `contig_rule`, or by a `contig_map=` file. Records whose REF differs from the reference are an
error naming the VCF line (`skip_mismatch=true`: counted and listed); symbolic ALTs (`<DEL>`, `*`,
breakends) and records without an ALT are skipped and counted. Reading the VCF is `genomelm.eval.vcf`,
reading the reference `genomelm.eval.variant_reference`.

Writes `results/<run>/variants.vcf.gz` (bgzipped, with its tabix index `.tbi`: the input's records with the
scores as INFO fields) and `variants.tsv` (one row per ALT, scored or not, with why not) as one set
(`genomelm.eval.report.write_result_set`). With dp, cp or ep above 1 it runs on the run's mesh as `genomelm
eval` does, the dp replicas splitting the forward passes.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pysam
import torch

from genomelm.data import Vocabulary
from genomelm.data.vocab import (
    CODE_LETTERS,
    CODE_MASK,
    IGNORE_INDEX,
    PAD,
    SOFT_BIT,
)
from genomelm.data.windows import Window
from genomelm.eval.report import write_result_set
from genomelm.eval.variant_reference import RecordBases, read_reference, reference_files, run_manifest
from genomelm.eval.vcf import (
    INFO_FIELDS,
    MISMATCH,
    NO_ALT,
    SCORED,
    SYMBOLIC,
    TOO_LONG,
    Allele,
    VariantError,
    codes_of,
    contig_rule,
    describe_records,
    open_vcf,
    read_contig_map,
    read_vcf,
)
from genomelm.run.config import TrainConfig
from genomelm.run.launchers import check_mesh
from genomelm.run.scoring import (
    ScoringRun,
    WindowShare,
    load_scoring_model,
    progress_bar,
    scoring_source,
    token_losses,
)

FOLLOWING_BASES = 32  # reference bases after the allele scored with it at the window's end
MODELS = ("before", "after")
TSV_COLUMNS = (
    "line",
    "chrom",
    "pos",
    "ref",
    "alt",
    "status",
    "record",
    "context",
    "following",
    "ref_bases",
    "alt_bases",
    "llr_before",
    "llr_after",
    "llr_before_per_base",
    "llr_after_per_base",
    "short_context",
    "reference",
)


# ------------------------------------------------------------------------------------------ the windows
@dataclass(frozen=True)
class Site:
    """One ALT allele placed in its windows: `record` (the reference's), the 0-based `start` of the first
    differing base, the alleles after the shared bases (`ref_allele`, `alt_allele`, letters), and in the
    windows the `window_start` (0-based, on the record), `context` bases before the allele and `following`
    bases scored after it; `short` when either is fewer than planned."""

    allele: Allele
    record: str
    start: int
    ref_allele: str
    alt_allele: str
    window_start: int
    context: int
    following: int
    short: bool


def planned(longer: int, tokens: int, position: str) -> tuple[int, int]:
    """(context bases C before the allele, following bases F scored after it) in a window of `tokens` for an
    allele pair whose longer allele has `longer` bases; C < 1 or F < 1 when they do not fit."""
    if position == "end":
        following = FOLLOWING_BASES
        return tokens - longer - following, following
    context = (tokens - longer) // 2
    return context, tokens - context - longer


def window_span(allele: Allele, tokens: int, position: str) -> tuple[int, int]:
    """Reference bases [start, end) (0-based, unclipped) that `allele`'s windows and REF check read."""
    context, _ = planned(allele.longer, tokens, position)
    begin = allele.pos - 1
    return max(0, min(begin, allele.start - max(context, 0))), allele.start + len(allele.ref) + tokens


def place(allele: Allele, record: str, length: int, tokens: int, position: str) -> Site:
    """`allele` on reference `record` (of `length` bases) in windows of `tokens`."""
    shared = allele.shared
    ref_allele, alt_allele = allele.ref[shared:], allele.alt[shared:]
    start = allele.start
    context, following = planned(allele.longer, tokens, position)
    window_start = max(0, start - context)
    available = max(0, length - (start + len(ref_allele)))
    have = start - window_start
    scored = min(following, available)
    short = have < context or scored < following
    return Site(allele, record, start, ref_allele, alt_allele, window_start, have, scored, short)


def site_window(site: Site, bases: RecordBases, vocab: Vocabulary, tokens: int, alt: bool) -> Window:
    """The REF window of `site` (or with `alt` its ALT window): `tokens` token ids of `vocab`, right-padded
    at the record's end; the ALT allele's bases are not soft-masked."""
    allele = site.alt_allele if alt else site.ref_allele
    prefix = bases.fetch(site.window_start, site.start)
    if alt:
        middle = codes_of(allele)
    else:
        middle = bases.fetch(site.start, site.start + len(allele))
    after = site.start + len(site.ref_allele)
    rest = bases.fetch(after, after + tokens - len(prefix) - len(allele))
    scan = np.concatenate([prefix, middle, rest])
    codes = np.full(tokens, PAD, dtype=np.uint8)
    codes[: len(scan)] = scan & CODE_MASK
    softmask = np.zeros(tokens, dtype=bool)
    softmask[: len(scan)] = scan >= SOFT_BIT  # the ALT allele's codes carry no soft-mask bit
    ids = torch.as_tensor(np.asarray(vocab.code_to_id, dtype=np.int64)[codes])
    return Window(
        "variants",
        site.allele.line,  # the window's number: its VCF line
        site.record,
        site.window_start,
        after + len(rest),
        ids,
        torch.from_numpy(softmask),
        vocab,
    )


def scored_positions(site: Site, alt: bool) -> slice:
    """Loss positions scored in a window of `site` (position t predicts token t + 1): those predicting the
    allele and the following bases, [context - 1, context + allele + following - 1), not before 0 (nothing
    predicts a window's first base)."""
    allele = len(site.alt_allele if alt else site.ref_allele)
    return slice(max(site.context - 1, 0), site.context + allele + site.following - 1)


# ------------------------------------------------------------------------------------------ the plan
@dataclass
class VariantPlan:
    """What the ranks score: every site, the reference bases their windows read, the model's vocabulary and
    the window length (tokens)."""

    sites: list[Site]
    bases: dict[str, RecordBases]
    vocab: Vocabulary
    tokens: int
    position: str


@dataclass
class VariantSet:
    """A VCF read against the reference: its records (for the output), every ALT allele with its status, the
    sites to score, the contig names matched and the reference bases at mismatched REFs (by record index)."""

    path: Path
    vcf: pysam.VariantFile
    records: list[pysam.VariantRecord]
    alleles: list[Allele]
    plan: VariantPlan
    reference: list[Path]
    contigs: dict[str, str]
    mismatches: dict[int, str]


def load_variants(config: TrainConfig, tokens: int, vocab: Vocabulary | None = None) -> VariantSet:
    """Read `vcf=` and the reference, match the contigs, check every REF and place every ALT allele in windows
    of `tokens` (VariantError for what cannot be scored and is not to be skipped). The model's token ids are
    `vocab`, else those of the run's prepared data (whose manifest also names the default reference)."""
    path = Path(config.variants.vcf)
    position = config.variants.variant_position
    manifest = run_manifest(config) if vocab is None or not config.variants.fasta else {}
    reference = reference_files(config, manifest)
    mapping = read_contig_map(config.variants.contig_map) if config.variants.contig_map else {}
    vcf = open_vcf(path)
    records, alleles = read_vcf(path, vcf)

    def candidates(contig: str) -> list[str]:
        return [mapping[contig]] if contig in mapping else contig_rule(contig)

    spans: dict[str, list[tuple[int, int]]] = {}  # record name -> the reference bases to read from it
    for allele in alleles:
        needed = [(allele.pos - 1, allele.pos - 1 + len(allele.ref))]  # the REF check's
        if allele.status is None:
            needed.append(window_span(allele, tokens, position))
        for name in candidates(allele.contig):
            spans.setdefault(name, []).extend(needed)
    lengths, bases = read_reference(reference, spans.get)

    contigs: dict[str, str] = {}  # VCF contig -> reference record
    for allele in (a for a in alleles if a.contig not in contigs):
        found = next((name for name in candidates(allele.contig) if name in lengths), None)
        if found is None:
            how = (
                f"contig_map={config.variants.contig_map} maps it to" if allele.contig in mapping else "tried"
            )
            raise VariantError(
                f"{path}, line {allele.line}: contig {allele.contig!r} is not a record of the reference "
                f"{', '.join(map(str, reference))} ({how} {', '.join(candidates(allele.contig))}); its "
                f"records: {describe_records(lengths)}. Give contig_map=FILE with lines 'VCF-contig "
                "record-name', or the VCF's reference as fasta=FILE"
            )
        contigs[allele.contig] = found

    mismatches: dict[int, str] = {}  # record index -> the reference's bases where its REF is
    for allele in alleles:
        if allele.index == 0:  # REF is checked once per record, at its first ALT
            record = contigs[allele.contig]
            found = reference_text(bases[record], allele)
            if found != CODE_LETTERS[codes_of(allele.ref)].tobytes().decode():  # IUPAC codes as N
                if not config.variants.skip_mismatch:
                    raise mismatch_error(path, records[allele.record], allele, record, reference, found)
                mismatches[allele.record] = found

    sites: list[Site] = []
    final: list[Allele] = []
    for allele in alleles:
        status = allele.status
        if status is None and allele.record in mismatches:
            status = MISMATCH
        elif status is None and min(planned(allele.longer, tokens, position)) < 1:
            status = TOO_LONG
        elif status is None:
            record = contigs[allele.contig]
            sites.append(place(allele, record, lengths[record], tokens, position))
        final.append(dataclasses.replace(allele, status=status))
    vocab = vocab if vocab is not None else Vocabulary.from_json(manifest["vocab"])
    plan = VariantPlan(sites, {s.record: bases[s.record] for s in sites}, vocab, tokens, position)
    return VariantSet(path, vcf, records, final, plan, reference, contigs, mismatches)


def reference_text(bases: RecordBases, allele: Allele) -> str:
    """The reference's bases where `allele`'s REF lies (upper case; IUPAC codes as N), as many as the
    record has there."""
    begin = allele.pos - 1
    codes = bases.fetch(begin, begin + len(allele.ref)) & CODE_MASK
    return CODE_LETTERS[codes].tobytes().decode()


def mismatch_error(
    path: Path, rec: pysam.VariantRecord, allele: Allele, record: str, reference: list[Path], found: str
) -> VariantError:
    """A REF that differs from the reference: the VCF line, both alleles and the reference's bases."""
    ends = "" if len(found) == len(allele.ref) else " (the record ends there)"
    return VariantError(
        f"{path}, line {allele.line}: REF {allele.ref} (ALT {','.join(rec.alts or ['.'])}) at "
        f"{allele.contig}:{allele.pos} does not match the reference: record {record} of "
        f"{', '.join(map(str, reference))} has {found or 'no bases'} there{ends}. Check that the VCF was "
        "called on this reference (or give that one as fasta=FILE), or give skip_mismatch=true to count and "
        "list such records instead"
    )


# ------------------------------------------------------------------------------------------ scoring
def score_sites(
    model: torch.nn.Module,
    plan: VariantPlan,
    precision: str = "auto",
    progress: bool = False,
    share: WindowShare | None = None,
) -> np.ndarray:
    """float64 [S, 2, 2]: for each site, its REF then its ALT window, (summed loss over the scored positions
    in nats, positions scored). One job per window, every one a forward pass of `plan.tokens` tokens, so the
    dp replicas of `share` stay in step; the results are gathered on every rank."""

    def job(i: int, alt: bool) -> tuple[float, int]:
        site = plan.sites[i]
        window = site_window(site, plan.bases[site.record], plan.vocab, plan.tokens, alt)
        span = scored_positions(site, alt)
        losses = token_losses(model, window, precision)[span]  # 0 where the label is N or padding
        valid = (window.labels[span] != IGNORE_INDEX).numpy()
        return float(losses.astype(np.float64).sum()), int(valid.sum())

    jobs = [functools.partial(job, i, alt) for i in range(len(plan.sites)) for alt in (False, True)]
    model.eval()
    with torch.no_grad():
        results = (share or WindowShare()).run(jobs, progress_bar("variants", "pass") if progress else None)
    return np.asarray(results, dtype=np.float64).reshape(len(plan.sites), 2, 2)


def score_variants(config: TrainConfig, plan: VariantPlan, before: str, after: str) -> dict:
    """{"before": [S, 2, 2], "after": [S, 2, 2]} (`score_sites`) with the models `before` and `after`, on this
    rank's place in the run's mesh (or in this one process); what `run_scoring` launches."""
    run = ScoringRun.from_environment(config)
    load = functools.partial(load_scoring_model, config=config, run=run)
    sources = scoring_source(before, run), scoring_source(after, run)
    out: dict = {}
    for name, path in zip(MODELS, sources):
        began = time.perf_counter()
        print(
            f"scoring {len(plan.sites)} ALT allele(s), 2 windows of {plan.tokens:,} tokens each, with the "
            f"{name} model {path}",
            flush=True,
        )
        model = load(path)
        out[name] = score_sites(model, plan, config.memory.precision, progress=True, share=run.share)
        del model
        print(f"  {time.perf_counter() - began:.1f} s", flush=True)
    return out


@dataclass
class AlleleScores:
    """Per model of MODELS, for every site: `llr` [S] (nats) and `per_base` [S] (nats per base), and the
    bases scored [S, 2] (REF window, ALT window)."""

    llr: dict[str, np.ndarray]
    per_base: dict[str, np.ndarray]
    bases: np.ndarray


def allele_scores(sums: dict) -> AlleleScores:
    """The LLRs of `score_variants`'s sums: ALT log-likelihood minus REF's, summed and per scored base."""
    llr, per_base = {}, {}
    bases = sums["before"][:, :, 1].astype(np.int64)
    for name in MODELS:
        loss, count = sums[name][:, :, 0], sums[name][:, :, 1]
        llr[name] = loss[:, 0] - loss[:, 1]
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(count > 0, loss / count, np.nan)
        per_base[name] = mean[:, 0] - mean[:, 1]
    return AlleleScores(llr, per_base, bases)


# ------------------------------------------------------------------------------------------ outputs
def result_rows(variants: VariantSet, scores: AlleleScores | None) -> list[dict]:
    """One row per ALT allele, in VCF order, with TSV_COLUMNS (scores empty where not scored)."""
    site_of = {(s.allele.record, s.allele.index): i for i, s in enumerate(variants.plan.sites)}
    rows = []
    for allele in variants.alleles:
        row: dict = dict.fromkeys(TSV_COLUMNS, "")
        row.update(
            line=allele.line,
            chrom=allele.contig,
            pos=allele.pos,
            ref=allele.ref,
            alt=allele.alt,
            status=allele.status or SCORED,
            record=variants.contigs.get(allele.contig, ""),
            reference=variants.mismatches.get(allele.record, "") if allele.status == MISMATCH else "",
        )
        i = site_of.get((allele.record, allele.index))
        if i is not None and scores is not None:
            site = variants.plan.sites[i]
            row.update(
                context=site.context,
                following=site.following,
                ref_bases=int(scores.bases[i, 0]),
                alt_bases=int(scores.bases[i, 1]),
                short_context=int(site.short),
                **{f"llr_{name}": float(scores.llr[name][i]) for name in MODELS},
                **{f"llr_{name}_per_base": float(scores.per_base[name][i]) for name in MODELS},
            )
        rows.append(row)
    return rows


def write_tsv(rows: Sequence[dict], path: Path) -> Path:
    """variants.tsv: TSV_COLUMNS, one row per ALT allele; floats with 7 significant digits, NaN empty."""
    out = io.StringIO()
    writer = csv.writer(out, delimiter="\t", lineterminator="\n")
    writer.writerow(TSV_COLUMNS)
    for row in rows:
        writer.writerow(
            [
                ("" if not math.isfinite(v) else format(v, ".7g")) if isinstance(v, float) else v
                for v in (row[c] for c in TSV_COLUMNS)
            ]
        )
    path.write_text(out.getvalue())
    return path


def annotate(variants: VariantSet, rows: Sequence[dict]) -> list[pysam.VariantRecord]:
    """The VCF's records with the scores in INFO (INFO_FIELDS; missing where not scored), sorted by contig
    (in order of first appearance) and position, as tabix needs them."""
    by_record: dict[int, list[dict]] = {}
    for row, allele in zip(rows, variants.alleles):
        by_record.setdefault(allele.record, []).append(row)
    for index, rec in enumerate(variants.records):
        for key in INFO_FIELDS:
            if key in rec.info:
                del rec.info[key]  # a re-scored output of this command
        alleles = by_record[index]
        if not rec.alts:
            continue
        scored = [row for row in alleles if row["status"] == SCORED]
        for name in MODELS if scored else ():
            for key, column in (
                (f"GLM_LLR_{name.upper()}", f"llr_{name}"),
                (f"GLM_LLR_{name.upper()}_PER_BASE", f"llr_{name}_per_base"),
            ):
                rec.info[key] = tuple(finite(row[column]) for row in alleles)
        if len(scored) < len(alleles):
            rec.info["GLM_SKIPPED"] = tuple(
                None if row["status"] == SCORED else row["status"] for row in alleles
            )
        if any(row["short_context"] == 1 for row in scored):
            rec.info["GLM_SHORT_CONTEXT"] = True
    first: dict[str, int] = {}
    for rec in variants.records:
        first.setdefault(rec.contig, len(first))
    return sorted(variants.records, key=lambda r: (first[r.contig], r.pos))


def finite(value: object) -> float | None:
    """A score as a VCF value: None (written '.') where missing or not finite."""
    return value if isinstance(value, float) and math.isfinite(value) else None


def write_vcf(variants: VariantSet, records: Sequence[pysam.VariantRecord], models: dict, path: Path) -> Path:
    """variants.vcf.gz: the input's header (plus the INFO declarations and a ##genomelm_variants line naming
    the models and settings) and `records`, bgzipped."""
    settings = ",".join(
        f'{key}="{value}"'
        for key, value in {
            "before": models["before"],
            "after": models["after"],
            "variant_context": variants.plan.tokens,
            "variant_position": variants.plan.position,
            "following_bases": FOLLOWING_BASES,
            "reference": ",".join(map(str, variants.reference)),
        }.items()
    )
    header = variants.vcf.header
    header.add_line(f"##genomelm_variants=<{settings}>")
    with pysam.VariantFile(str(path), "wz", header=header) as out:
        for rec in records:
            out.write(rec)
    return path


def write_variant_outputs(
    variants: VariantSet, rows: Sequence[dict], models: dict, folder: Path
) -> dict[str, Path]:
    """Write variants.vcf.gz, its tabix index variants.vcf.gz.tbi and variants.tsv into `folder` as one set
    (`write_result_set`'s set "variants"): readers see the previous three files or the new three."""
    records = annotate(variants, rows)

    def index(path: Path) -> None:
        pysam.tabix_index(str(path.with_name("variants.vcf.gz")), preset="vcf", index=str(path), force=True)

    return write_result_set(
        folder,
        "variants",
        {
            "variants.vcf.gz": lambda path: write_vcf(variants, records, models, path),
            "variants.vcf.gz.tbi": index,
            "variants.tsv": lambda path: write_tsv(rows, path),
        },
    )


def summary(variants: VariantSet, rows: Sequence[dict]) -> str:
    """What was scored and skipped (counts; the mismatched REFs listed by line) and the scored alleles'
    LLRs, the first 20 of them."""
    counts = {status: 0 for status in (SCORED, MISMATCH, SYMBOLIC, NO_ALT, TOO_LONG)}
    for row in rows:
        counts[row["status"]] += 1
    short = sum(row["short_context"] == 1 for row in rows)
    lines = [
        f"{len(variants.records):,} VCF record(s), {len(rows):,} ALT allele(s): {counts[SCORED]:,} scored "
        f"({short:,} with a short context); skipped: {counts[SYMBOLIC]:,} symbolic, {counts[NO_ALT]:,} "
        f"without an ALT, {counts[MISMATCH]:,} with a REF that differs from the reference, "
        f"{counts[TOO_LONG]:,} longer than the context"
    ]
    for record, text in list(variants.mismatches.items())[:20]:
        rec = variants.records[record]
        line = next(a.line for a in variants.alleles if a.record == record)
        lines.append(
            f"  REF mismatch, line {line}: {rec.contig}:{rec.pos} REF {rec.ref}, reference {text or '(none)'}"
        )
    scored = [row for row in rows if row["status"] == SCORED]
    if scored:
        lines += [
            "",
            f"{'variant':<28} {'llr before':>11} {'llr after':>10} {'/base before':>12} {'/base after':>11}",
        ]
        for row in scored[:20]:
            name = f"{row['chrom']}:{row['pos']} {row['ref']}>{row['alt']}"
            name = name if len(name) <= 28 else name[:25] + "..."
            lines.append(
                f"{name:<28} {row['llr_before']:>+11.4f} {row['llr_after']:>+10.4f} "
                f"{row['llr_before_per_base']:>+12.5f} {row['llr_after_per_base']:>+11.5f}"
            )
        if len(scored) > 20:
            lines.append(f"... {len(scored) - 20:,} more in variants.tsv")
        lines.append(
            "(nats; llr = log P(ALT window) - log P(REF window) over the allele and the following bases; "
            "/base: per scored base)"
        )
    return "\n".join(lines)


def window_tokens(config: TrainConfig) -> int:
    """Tokens of every window scored: `variant_context`, or the run's SEQ; VariantError when no VCF is given,
    a window cannot hold an SNV with its context, or cp cannot split it."""
    if not config.variants.vcf:
        raise VariantError("no VCF: give vcf=FILE (.vcf or .vcf.gz), e.g. make variants VCF=variants.vcf.gz")
    tokens = config.variants.variant_context or config.seq_len
    context, following = planned(1, tokens, config.variants.variant_position)
    if context < 1 or following < 1:
        need = FOLLOWING_BASES + 2 if config.variants.variant_position == "end" else 3
        raise VariantError(
            f"variant_context={tokens}: a window of {tokens} tokens holds no context for an SNV with "
            f"variant_position={config.variants.variant_position}; give variant_context>={need}"
        )
    try:
        check_mesh(config, [tokens])
    except ValueError as exc:
        raise VariantError(
            f"variant_context={tokens}: the run's mesh cannot split windows of that length ({exc}); give a "
            "variant_context it can"
        ) from None
    return tokens
