"""`genomelm variants`: windows and LLRs checked against independent `token_logprobs` calls, the VCF/TSV
outputs read back through pysam, the contig rule and map, bad input, and the command end to end."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pysam
import pytest
import torch
from data_fixtures import DMEL, DMEL_RECORD, fly_windows, read_records, tiny_run, write_fasta

from genomelm.cli import main as cli_main
from genomelm.commands.train import main as train_main
from genomelm.data.faidx import region_index
from genomelm.data.vocab import CODE_LETTERS
from genomelm.eval.variants import (
    FOLLOWING_BASES,
    VariantError,
    allele_scores,
    contig_rule,
    load_variants,
    result_rows,
    score_sites,
    window_tokens,
    write_variant_outputs,
)
from genomelm.model import load_model
from genomelm.run.config import TrainConfig

FLY = read_records(DMEL)[DMEL_RECORD]
CODE = {"A": 1, "C": 2, "G": 3, "T": 4, "N": 5}
TOKENS = 128  # the test run's SEQ: every window scored
HEADER = "##fileformat=VCFv4.2\n#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n"


def other(base: str) -> str:
    """A base that is not `base`."""
    return "C" if base.upper() != "C" else "G"


def ref(pos: int, length: int = 1) -> str:
    """The fly record's bases at the 1-based `pos`, as a VCF writes REF (upper case)."""
    return FLY[pos - 1 : pos - 1 + length].upper()


def vcf_text(records: list[tuple[str, int, str, str]]) -> str:
    """A VCF of (CHROM, POS, REF, ALT) records."""
    return HEADER + "".join(f"{c}\t{p}\t.\t{r}\t{a}\t.\t.\t.\n" for c, p, r, a in records)


# the records of the main test VCF (contig "4": the fly record through the contig map), in this order
SNV = ("4", 300_000, ref(300_000), other(ref(300_000)))
MNV = ("4", 300_500, ref(300_500, 2), other(ref(300_500)) + other(ref(300_501)))
INSERTION = ("4", 301_000, ref(301_000), ref(301_000) + "GTA")
DELETION = ("4", 301_500, ref(301_500, 4), ref(301_500))
MULTI = ("4", 302_000, ref(302_000), ",".join([b for b in "ACGT" if b != ref(302_000)][:2]))  # 2 ALTs
MISMATCHED = ("4", 302_500, other(ref(302_500)), ref(302_500))
SYMBOLIC = ("4", 303_000, ref(303_000), "<DEL>")
NEAR_START = ("4", 10, ref(10), other(ref(10)))
RECORDS = [NEAR_START, SNV, MNV, INSERTION, DELETION, MULTI, MISMATCHED, SYMBOLIC]
FIRST_LINE = 3  # after the ##fileformat and #CHROM lines


@pytest.fixture(scope="module")
def fly_data(tmp_path_factory) -> Path:
    """A prepared folder of 128-token fly windows: its manifest names the bundled genome as the reference."""
    return fly_windows(tmp_path_factory.mktemp("variants") / "fly", "1-8192", TOKENS, heldout="200001-201024")


def write_inputs(folder: Path, records: list[tuple[str, int, str, str]]) -> tuple[Path, Path]:
    """(VCF of `records`, contig map 4 -> the fly record) in `folder`."""
    vcf = folder / "in.vcf"
    vcf.write_text(vcf_text(records))
    mapping = folder / "contigs.txt"
    mapping.write_text(f"# VCF name, reference record\n4\t{DMEL_RECORD}\n")
    return vcf, mapping


def config_for(data: Path, vcf: Path, **settings: object) -> TrainConfig:
    return TrainConfig(data=str(data), seq=str(TOKENS), model="tiny", run="r").replace(
        vcf=str(vcf), **settings
    )


def hand_llr(
    model: torch.nn.Module, pos: int, ref_allele: str, alt_allele: str, position: str
) -> tuple[float, float]:
    """(LLR, per-base LLR) by the module's definition, from the sequence text: the shared leading bases moved
    into the context; each window C context bases, the allele, the reference after it, TOKENS long (padded
    at the record's end), scored by its own `token_logprobs` call over the allele and the F following
    bases."""
    shared = 0
    while shared < min(len(ref_allele), len(alt_allele)) and ref_allele[shared] == alt_allele[shared]:
        shared += 1
    start, r, a = pos - 1 + shared, ref_allele[shared:], alt_allele[shared:]
    longer = max(len(r), len(a))
    if position == "end":
        context, following = TOKENS - longer - FOLLOWING_BASES, FOLLOWING_BASES
    else:
        context = (TOKENS - longer) // 2
        following = TOKENS - context - longer
    begin = max(0, start - context)
    total, mean = {}, {}
    for name, allele in (("ref", r), ("alt", a)):
        letters = (FLY[begin:start] + allele + FLY[start + len(r) : start + len(r) + TOKENS]).upper()[:TOKENS]
        ids = torch.tensor([[CODE[c] for c in letters] + [0] * (TOKENS - len(letters))])
        with torch.no_grad():
            logprobs = model.token_logprobs(ids)[0]  # [TOKENS - 1]: position t predicts token t + 1
        first = start - begin  # the allele's first token
        scored = logprobs[max(first - 1, 0) : first + len(allele) + following - 1].double()
        total[name], mean[name] = float(scored.sum()), float(scored.mean())
    return total["alt"] - total["ref"], mean["alt"] - mean["ref"]


def scored_rows(
    fly_data: Path, folder: Path, records: list[tuple[str, int, str, str]], position: str
) -> list[dict]:
    """The result rows of `records` scored with the tiny preset's random weights (as both models), each
    scored row checked against `hand_llr`."""
    vcf, mapping = write_inputs(folder, records)
    config = config_for(fly_data, vcf, contig_map=str(mapping), skip_mismatch=True, variant_position=position)
    variants = load_variants(config, TOKENS)
    torch.manual_seed(0)
    model = load_model("tiny").eval()
    sums = score_sites(model, variants.plan)
    rows = result_rows(variants, allele_scores({"before": sums, "after": sums}))
    expected = [(r[1], alt) for r in records if r not in (MISMATCHED, SYMBOLIC) for alt in r[3].split(",")]
    scored = [row for row in rows if row["status"] == "scored"]
    assert [(row["pos"], row["alt"]) for row in scored] == expected
    for row in scored:
        assert row["record"] == DMEL_RECORD
        llr, per_base = hand_llr(model, row["pos"], row["ref"], row["alt"], position)
        assert row["llr_before"] == pytest.approx(llr, abs=2e-4)
        assert row["llr_before_per_base"] == pytest.approx(per_base, abs=1e-5)
    return rows


def test_llr_equals_independent_token_logprobs(fly_data: Path, tmp_path: Path) -> None:
    """SNVs, an MNV, an insertion, a deletion and a multi-allelic record at the window's end (the default),
    one near the record's start; a REF mismatch and a symbolic ALT skipped and listed."""
    rows = scored_rows(fly_data, tmp_path, RECORDS, "end")
    by_pos = {(row["pos"], row["alt"]): row for row in rows}
    snv = by_pos[SNV[1], SNV[3]]
    assert (snv["context"], snv["following"]) == (TOKENS - 1 - FOLLOWING_BASES, FOLLOWING_BASES)
    assert snv["ref_bases"] == snv["alt_bases"] == 1 + FOLLOWING_BASES
    assert snv["llr_before_per_base"] == pytest.approx(snv["llr_before"] / (1 + FOLLOWING_BASES))
    assert by_pos[MNV[1], MNV[3]]["ref_bases"] == 2 + FOLLOWING_BASES
    insertion, deletion = by_pos[INSERTION[1], INSERTION[3]], by_pos[DELETION[1], DELETION[3]]
    assert (insertion["ref_bases"], insertion["alt_bases"]) == (FOLLOWING_BASES, 3 + FOLLOWING_BASES)
    assert (deletion["ref_bases"], deletion["alt_bases"]) == (3 + FOLLOWING_BASES, FOLLOWING_BASES)
    assert deletion["context"] == TOKENS - 3 - FOLLOWING_BASES  # the anchor base is context
    near = by_pos[NEAR_START[1], NEAR_START[3]]
    assert near["short_context"] == 1 and near["context"] == 9  # the 9 bases before it
    assert sum(row["short_context"] == 1 for row in rows) == 1
    skipped = {row["pos"]: row["status"] for row in rows if row["status"] != "scored"}
    assert skipped == {MISMATCHED[1]: "ref_mismatch", SYMBOLIC[1]: "symbolic"}
    assert [row["reference"] for row in rows if row["status"] == "ref_mismatch"] == [MISMATCHED[3]]


def test_centred_windows(fly_data: Path, tmp_path: Path) -> None:
    """`variant_position=center`: C = (N - L) // 2 context bases, the rest of the window scored."""
    rows = scored_rows(fly_data, tmp_path, [SNV, INSERTION, DELETION], "center")
    snv, insertion, deletion = rows
    assert (snv["context"], snv["following"]) == ((TOKENS - 1) // 2, TOKENS - (TOKENS - 1) // 2 - 1)
    following = TOKENS - (TOKENS - 3) // 2 - 3  # with 3 bases inserted or deleted
    assert (insertion["context"], insertion["following"]) == ((TOKENS - 3) // 2, following)
    assert (insertion["ref_bases"], insertion["alt_bases"]) == (following, 3 + following)
    assert (deletion["ref_bases"], deletion["alt_bases"]) == (3 + following, following)


class BaseCost(torch.nn.Module):
    """A stand-in model, fast: its loss at a position is `scale` x the id of the base it predicts (0 where the
    label is -100), so REF and ALT windows differ."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, reduction: str = "none") -> torch.Tensor:
        return torch.where(labels == -100, 0.0, self.scale * labels.float())


def test_outputs_read_back_through_pysam(fly_data: Path, tmp_path: Path) -> None:
    vcf, mapping = write_inputs(tmp_path, RECORDS)
    variants = load_variants(config_for(fly_data, vcf, contig_map=str(mapping), skip_mismatch=True), TOKENS)
    before, after = score_sites(BaseCost(0.1), variants.plan), score_sites(BaseCost(0.3), variants.plan)
    rows = result_rows(variants, allele_scores({"before": before, "after": after}))
    paths = write_variant_outputs(variants, rows, {"before": "tiny", "after": "tiny2"}, tmp_path / "out")

    with open(paths["variants.tsv"]) as handle:
        table = list(csv.DictReader(handle, delimiter="\t"))
    assert len(table) == len(rows) == 9 and table[0]["line"] == str(FIRST_LINE)
    output = pysam.VariantFile(str(paths["variants.vcf.gz"]))
    for key in ("GLM_LLR_BEFORE", "GLM_LLR_AFTER", "GLM_LLR_BEFORE_PER_BASE", "GLM_SHORT_CONTEXT"):
        assert key in output.header.info and output.header.info[key].description
    assert any(line.key == "genomelm_variants" for line in output.header.records)
    seen = 0
    for rec in output:
        mine = [row for row in table if row["pos"] == str(rec.pos)]
        assert [row["alt"] for row in mine] == list(rec.alts)
        for i, row in enumerate(mine):
            for key, column in (
                ("GLM_LLR_BEFORE", "llr_before"),
                ("GLM_LLR_AFTER", "llr_after"),
                ("GLM_LLR_BEFORE_PER_BASE", "llr_before_per_base"),
                ("GLM_LLR_AFTER_PER_BASE", "llr_after_per_base"),
            ):
                value = rec.info.get(key, (None,) * len(mine))[i]
                if row["status"] == "scored":
                    assert value == pytest.approx(float(row[column]), rel=1e-5, abs=1e-6)
                    seen += 1
                else:
                    assert value is None and row[column] == ""
            skipped = rec.info.get("GLM_SKIPPED", (None,) * len(mine))[i]
            assert skipped == (None if row["status"] == "scored" else row["status"])
        assert rec.info.get("GLM_SHORT_CONTEXT", False) == (rec.pos == NEAR_START[1])
    assert seen == 4 * 7
    assert float(table[1]["llr_before"]) != float(table[1]["llr_after"])  # two different models
    fetched = [(r.pos, r.ref) for r in output.fetch("4", MNV[1] - 1, INSERTION[1])]  # through the .tbi
    assert fetched == [(MNV[1], MNV[2]), (INSERTION[1], INSERTION[2])]
    assert sorted(p.name for p in paths.values()) == [
        "variants.tsv",
        "variants.vcf.gz",
        "variants.vcf.gz.tbi",
    ]


def test_contig_rule() -> None:
    assert contig_rule("20") == ["20", "chr20"]
    assert contig_rule("chr20") == ["chr20", "20"]
    assert contig_rule("MT") == ["MT", "chrMT", "chrM", "M"]
    assert contig_rule("chrM") == ["chrM", "M", "MT", "chrMT"]


def test_rule_matches_names_in_another_reference(fly_data: Path, tmp_path: Path) -> None:
    """`fasta=` a FASTA with records chr2L and MT: VCF contigs 2L and chrM find them by the rule, and a BGZF
    copy read through its samtools index gives the same windows."""
    fasta = write_fasta(tmp_path / "ref.fa", {"chr2L": FLY[:5000], "MT": FLY[5000:9000]})
    bgzf = tmp_path / "ref.fa.gz"
    pysam.tabix_compress(str(fasta), str(bgzf))
    pysam.faidx(str(bgzf))
    vcf = tmp_path / "in.vcf"
    records = [("2L", 3000, ref(3000), other(ref(3000))), ("chrM", 1000, ref(6000), other(ref(6000)))]
    vcf.write_text(vcf_text(records))
    assert region_index(bgzf)[0] is not None  # read through pyfaidx, only where the windows lie
    plans = []
    for path in (fasta, bgzf):
        variants = load_variants(config_for(fly_data, vcf, fasta=str(path)), TOKENS)
        assert variants.contigs == {"2L": "chr2L", "chrM": "MT"}
        plans.append(variants.plan)
    streamed, indexed = plans
    assert streamed.sites == indexed.sites and len(streamed.sites) == 2
    for record in ("chr2L", "MT"):
        assert streamed.bases[record].length == indexed.bases[record].length
        assert streamed.bases[record].starts == indexed.bases[record].starts
        for a, b in zip(streamed.bases[record].parts, indexed.bases[record].parts, strict=True):
            assert np.array_equal(a, b)
    start = streamed.sites[0].window_start
    assert CODE_LETTERS[streamed.bases["chr2L"].fetch(start, start + 50) & 7].tobytes().decode() == ref(
        start + 1, 50
    )


def test_errors_name_the_line_and_the_fix(fly_data: Path, tmp_path: Path) -> None:
    vcf, mapping = write_inputs(tmp_path, [SNV, MISMATCHED])
    with pytest.raises(VariantError) as error:
        load_variants(config_for(fly_data, vcf, contig_map=str(mapping)), TOKENS)
    message = str(error.value)
    assert f"line {FIRST_LINE + 1}: REF {MISMATCHED[2]} (ALT {MISMATCHED[3]})" in message
    assert f"record {DMEL_RECORD}" in message and f"has {MISMATCHED[3]} there" in message
    assert "skip_mismatch=true" in message

    with pytest.raises(
        VariantError,
        match=rf"line {FIRST_LINE}: contig '4' is not a record .*tried 4, chr4.*"
        rf"{DMEL_RECORD} \(1,348,131 bases\).*contig_map=FILE",
    ):
        load_variants(config_for(fly_data, vcf), TOKENS)

    broken = tmp_path / "broken.vcf"
    broken.write_text(vcf_text([SNV]) + "4\tabc\t.\tA\tG\t.\t.\t.\n")
    with pytest.raises(
        VariantError, match=rf"broken.vcf, line {FIRST_LINE + 1}: pysam cannot parse .*'4\\tabc"
    ):
        load_variants(config_for(fly_data, broken, contig_map=str(mapping)), TOKENS)

    bad_alt = tmp_path / "bad_alt.vcf"
    bad_alt.write_text(vcf_text([SNV, ("4", 300_100, ref(300_100), "X")]))
    with pytest.raises(VariantError, match=rf"line {FIRST_LINE + 1}: ALT 'X' is neither bases"):
        load_variants(config_for(fly_data, bad_alt, contig_map=str(mapping)), TOKENS)

    bad_map = tmp_path / "bad_map.txt"
    bad_map.write_text("4\n")
    with pytest.raises(VariantError, match="bad_map.txt, line 1: '4' has 1 columns; give two per line"):
        load_variants(config_for(fly_data, vcf, contig_map=str(bad_map)), TOKENS)

    garbage = tmp_path / "garbage.vcf"
    garbage.write_text("no header\n4\t10\n")
    with pytest.raises(VariantError, match="garbage.vcf: not a readable VCF .*#CHROM header line"):
        load_variants(config_for(fly_data, garbage), TOKENS)

    with pytest.raises(VariantError, match="no such file"):
        load_variants(config_for(fly_data, tmp_path / "none.vcf"), TOKENS)


def test_every_form_a_vcf_ships_in_reads_the_same(fly_data: Path, tmp_path: Path) -> None:
    """Plain text, plain gzip (what `gzip` writes: htslib cannot seek in it), bgzip without and with its
    tabix index: the same records, alleles and windows, and a bad record named by its line in each."""
    import gzip
    import shutil

    vcf, mapping = write_inputs(tmp_path, [SNV, MNV, DELETION])
    forms = {"plain": vcf, "gzip": tmp_path / "in.gzip.vcf.gz", "bgzip": tmp_path / "in.bgzip.vcf.gz"}
    forms["gzip"].write_bytes(gzip.compress(vcf.read_bytes()))
    pysam.tabix_compress(str(vcf), str(forms["bgzip"]))
    forms["indexed"] = tmp_path / "indexed" / "in.vcf.gz"
    forms["indexed"].parent.mkdir()
    shutil.copy(forms["bgzip"], forms["indexed"])
    pysam.tabix_index(str(forms["indexed"]), preset="vcf")
    read = {}
    for name, path in forms.items():
        variants = load_variants(config_for(fly_data, path, contig_map=str(mapping)), TOKENS)
        read[name] = [(a.contig, a.pos, a.ref, a.alt, a.line) for a in variants.alleles]
    assert all(alleles == read["plain"] for alleles in read.values()) and len(read["plain"]) == 3
    bad = tmp_path / "bad.vcf.gz"
    bad.write_bytes(gzip.compress((vcf_text([SNV]) + "4\tx\t.\tA\tC\t.\t.\t.\n").encode()))
    with pytest.raises(VariantError, match=f"{bad}, line {FIRST_LINE + 1}: pysam cannot parse this record"):
        load_variants(config_for(fly_data, bad, contig_map=str(mapping)), TOKENS)


def test_alleles_too_long_and_records_without_alt_are_counted(fly_data: Path, tmp_path: Path) -> None:
    """A deletion longer than the window leaves no context: skipped as too_long; ALT '.' as no_alt."""
    vcf, mapping = write_inputs(
        tmp_path, [SNV, ("4", 301_500, ref(301_500, 120), ref(301_500)), (*SNV[:3], ".")]
    )
    variants = load_variants(config_for(fly_data, vcf, contig_map=str(mapping)), TOKENS)
    assert [a.status for a in variants.alleles] == [None, "too_long", "no_alt"]
    assert len(variants.plan.sites) == 1
    with pytest.raises(VariantError, match="variant_context=20: .* give variant_context>=34"):
        window_tokens(config_for(fly_data, vcf, variant_context=20))
    assert window_tokens(config_for(fly_data, vcf, variant_context=20, variant_position="center")) == 20
    assert window_tokens(config_for(fly_data, vcf)) == TOKENS  # 0: the run's SEQ


@pytest.fixture(scope="module")
def trained_run(fly_data: Path, tmp_path_factory) -> list[str]:
    """The settings of a tiny run trained for 2 steps on the fly windows (its checkpoint is "after")."""
    runs = tmp_path_factory.mktemp("runs")
    settings = tiny_run(fly_data, runs, seq=TOKENS)
    assert train_main(settings) == 0
    return settings


def test_command_end_to_end(trained_run: list[str], tmp_path: Path, capsys) -> None:
    vcf, mapping = write_inputs(tmp_path, RECORDS)
    bgzipped = tmp_path / "in.vcf.gz"
    pysam.tabix_compress(str(vcf), str(bgzipped))
    run = [*trained_run, f"results_dir={tmp_path / 'results'}", f"vcf={bgzipped}", f"contig_map={mapping}"]
    assert cli_main(["variants", *run, "skip_mismatch=true"]) == 0
    out = capsys.readouterr().out
    assert "8 VCF record(s), 9 ALT allele(s): 7 scored (1 with a short context); skipped: 1 symbolic" in out
    assert f"REF mismatch, line {FIRST_LINE + 6}" in out and "variants.vcf.gz (+ .tbi)" in out
    folder = tmp_path / "results" / "r"
    with open(folder / "variants.tsv") as handle:
        table = list(csv.DictReader(handle, delimiter="\t"))
    output = {rec.pos: rec for rec in pysam.VariantFile(str(folder / "variants.vcf.gz"))}
    assert set(output) == {r[1] for r in RECORDS}
    snv = next(row for row in table if row["pos"] == str(SNV[1]))
    assert output[SNV[1]].info["GLM_LLR_AFTER"][0] == pytest.approx(float(snv["llr_after"]), rel=1e-5)
    assert math.isfinite(float(snv["llr_before"])) and snv["llr_before"] != snv["llr_after"]

    # the after model is the run's checkpoint: the same LLR scored by hand with it
    runs = next(item.split("=", 1)[1] for item in trained_run if item.startswith("runs_dir="))
    checkpoint = next(Path(runs).glob("r/checkpoints/step-*/model"))
    model = load_model(checkpoint).eval()
    assert float(snv["llr_after"]) == pytest.approx(hand_llr(model, *SNV[1:], "end")[0], abs=2e-4)

    assert cli_main(["variants", *run]) == 2  # the mismatch is an error without skip_mismatch
    assert f"line {FIRST_LINE + 6}: REF" in capsys.readouterr().err
    assert cli_main(["variants", *trained_run]) == 2
    assert "no VCF: give vcf=FILE" in capsys.readouterr().err


@pytest.mark.slow
def test_cp2_and_dp2_equal_one_process(trained_run: list[str], tmp_path: Path, capsys) -> None:
    """`cp=2` (each window split over two local processes) and `dp=2` (two replicas splitting the passes),
    through the launch `genomelm eval` uses, give the one-process LLRs."""
    vcf, mapping = write_inputs(tmp_path, [SNV, INSERTION, DELETION, MULTI])
    tables = {}
    for layout in ("cp=1", "cp=2", "dp=2"):
        results = tmp_path / layout
        run = [*trained_run, f"results_dir={results}", f"vcf={vcf}", f"contig_map={mapping}", layout]
        assert cli_main(["variants", *run, "cp_layout=contiguous"]) == 0
        with open(results / "r" / "variants.tsv") as handle:
            tables[layout] = list(csv.DictReader(handle, delimiter="\t"))
    capsys.readouterr()
    assert len(tables["cp=1"]) == 5
    for layout in ("cp=2", "dp=2"):
        for one, two in zip(tables["cp=1"], tables[layout], strict=True):
            for column in ("llr_before", "llr_after", "llr_before_per_base", "llr_after_per_base"):
                assert float(two[column]) == pytest.approx(float(one[column]), rel=1e-4, abs=1e-5), layout
            assert [one[c] for c in ("pos", "alt", "context", "following", "ref_bases", "alt_bases")] == [
                two[c] for c in ("pos", "alt", "context", "following", "ref_bases", "alt_bases")
            ]
