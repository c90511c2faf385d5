"""GenBank and EMBL genomes and BED splits prepare exactly what the equivalent FASTA and region strings do."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyfaidx
import pytest
from Bio import SeqIO, bgzf
from Bio.Seq import Seq
from Bio.SeqRecord import SeqRecord
from data_fixtures import DMEL, DMEL_RECORD, HG38_FRAGMENTS, HG38_RECORDS, build, read_records, write_fasta

from genomelm.commands.data import main
from genomelm.data import DataError, read_manifest

BINS = ("train.bin", "train.idx", "train.softmask.bin", "heldout.bin", "heldout.idx", "heldout.softmask.bin")
FLY = read_records(DMEL)[DMEL_RECORD]
HUMAN = read_records(HG38_FRAGMENTS)[HG38_RECORDS[1]]


def assert_same_windows(a: Path, b: Path, files: tuple[str, ...] = BINS) -> None:
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    splits_a, splits_b = read_manifest(a)["splits"], read_manifest(b)["splits"]
    for split in ("train", "heldout"):
        assert splits_a[split]["windows"] == splits_b[split]["windows"]
        assert splits_a[split]["stats"] == splits_b[split]["stats"]


def assert_nothing_left(tmp_path: Path, name: str = "out") -> None:
    assert not (tmp_path / name).exists() and not list(tmp_path.glob(f".{name}.*"))


def seq_records(records: dict[str, str]) -> list[SeqRecord]:
    return [
        SeqRecord(
            Seq(seq),
            id=name,
            name=name.split(".")[0][:16],
            description=f"{name} from the bundled data",
            annotations={"molecule_type": "DNA"},
        )
        for name, seq in records.items()
    ]


@pytest.fixture(scope="module")
def genome() -> dict[str, str]:
    """Two real records: 200 kb of fly chr4 with IUPAC codes planted, and a human fragment."""
    fly = list(FLY[:200_000])
    for spot, code in zip(range(1000, 200_000, 9973), "RYKMSWBDHVrykmswbdhv"):
        fly[spot] = code
    return {DMEL_RECORD: "".join(fly), "chr4_fragment.1": HUMAN}


def test_genbank_and_embl_prepare_what_fasta_does(genome: dict[str, str], tmp_path: Path) -> None:
    settings = {"seq": 4096, "stride": 3000, "heldout": ["chr4_fragment.1"]}
    upper = write_fasta(tmp_path / "upper.fa", {name: seq.upper() for name, seq in genome.items()})
    SeqIO.write(seq_records(genome), tmp_path / "genome.gb", "genbank")
    with gzip.open(tmp_path / "genome.embl.gz", "wt") as handle:
        SeqIO.write(seq_records(genome), handle, "embl")
    disguised = tmp_path / "genbank_named.fa"  # told apart by content, not by name
    disguised.write_bytes((tmp_path / "genome.gb").read_bytes())
    assert (tmp_path / "genome.gb").read_text().startswith("LOCUS")
    fasta, _ = build(tmp_path, upper, name="fasta", **settings)
    for name, path, fmt in (
        ("gb", tmp_path / "genome.gb", "genbank"),
        ("embl", tmp_path / "genome.embl.gz", "embl"),
        ("disguised", disguised, "genbank"),
    ):
        out, _ = build(tmp_path, path, name=name, **settings)
        assert_same_windows(out, fasta)
        assert read_manifest(out)["sources"][0]["format"] == fmt
    stats = read_manifest(fasta)["splits"]["train"]["stats"]
    assert stats["iupac_as_n"] == 20 and stats["softmasked"] == 0 and stats["windows"] == 66
    # GenBank and EMBL keep no case, so the soft-masked FASTA gives the same tokens and a non-empty mask
    masked, _ = build(tmp_path, write_fasta(tmp_path / "masked.fa", genome), name="masked", **settings)
    for name in ("train.bin", "heldout.bin"):
        assert (masked / name).read_bytes() == (tmp_path / "gb" / name).read_bytes()
    assert read_manifest(masked)["splits"]["train"]["stats"]["softmasked"] > 10_000


def test_genbank_errors_name_file_record_and_offset(genome: dict[str, str], tmp_path: Path) -> None:
    good = tmp_path / "good.gb"
    SeqIO.write(seq_records(genome), good, "genbank")
    text = good.read_text()
    origin = text.index("ORIGIN")
    line_start = text.index("\n       61 ", origin) + len("\n       61 ")  # bases 61.. of the first record
    bad = tmp_path / "bad.gb"
    bad.write_text(text[:line_start] + "acgtx" + text[line_start + 5 :])  # base 65 becomes 'x'
    truncated = tmp_path / "truncated.gb"
    truncated.write_text(text[: origin + 50_000])
    protein = tmp_path / "protein.gb"
    SeqIO.write(
        [SeqRecord(Seq("MKVLAAGIVG" * 50), id="P1.1", annotations={"molecule_type": "protein"})],
        protein,
        "genbank",
    )
    cases = [
        (bad, "record NC_004353.4, base 65 (1-based): invalid character 'X'"),
        (
            truncated,
            "record NC_004353.4: Premature end of file in sequence data; the GenBank file is truncated",
        ),
        (protein, "record P1.1 is a protein sequence"),
    ]
    for path, message in cases:
        with pytest.raises(DataError) as err:
            build(tmp_path, path, seq=4096, heldout=["chr4_fragment.1"])
        assert message in str(err.value) and str(path) in str(err.value)
        assert_nothing_left(tmp_path)


def write_bed(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def fly_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Fly chr4 (plus a second record) as plain FASTA and as BGZF, each with a samtools-style index."""
    tmp = tmp_path_factory.mktemp("fly")
    plain = write_fasta(tmp / "fly.fa", {DMEL_RECORD: FLY, "other": HUMAN})
    packed = tmp / "fly.fa.gz"
    with bgzf.BgzfWriter(str(packed), "wb") as handle:
        handle.write(plain.read_bytes())
    indexed = tmp / "indexed"
    indexed.mkdir()
    files = {"plain": plain, "bgzf": packed}
    for name, source in list(files.items()):
        copy = indexed / source.name
        copy.write_bytes(source.read_bytes())
        pyfaidx.Faidx(str(copy)).close()  # writes copy.fai (and copy.gzi), as `samtools faidx` does
        files[f"indexed {name}"] = copy
    return files


def test_bed_splits_equal_region_strings(fly_files: dict[str, Path], tmp_path: Path) -> None:
    train = write_bed(
        tmp_path / "train.bed",
        [
            "track name=train",
            "# fly chr4, two pieces",
            f"{DMEL_RECORD}\t0\t100000\tfirst\t0\t+",
            f"{DMEL_RECORD}\t500000\t600000",
            "other\t0\t5000",
        ],
    )
    held = write_bed(tmp_path / "held.bed", [f"{DMEL_RECORD}\t1000000\t1348131"])
    regions = {
        "train": [f"{DMEL_RECORD}:1-100000", f"{DMEL_RECORD}:500001-600000", "other:1-5000"],
        "heldout": [f"{DMEL_RECORD}:1000001-1348131"],
    }
    expected, _ = build(tmp_path, fly_files["plain"], name="regions", seq=4096, **regions)
    for kind, path in fly_files.items():
        out, logs = build(
            tmp_path, path, name=kind.replace(" ", "_"), seq=4096, train=[str(train)], heldout=[str(held)]
        )
        assert_same_windows(out, expected)
        manifest = read_manifest(out)
        source = manifest["sources"][0]
        assert ("index" in source) == kind.startswith("indexed"), kind
        assert [f["intervals"] for f in manifest["split_files"]] == [3, 1]
        if not kind.startswith("indexed"):
            assert any("reading the whole file" in line for line in logs)
    held_stats = read_manifest(expected)["splits"]["heldout"]["stats"]
    assert (
        held_stats["n"] == 17_000 and held_stats["dropped_n_windows"] == 4
    )  # the N run: 4 windows over 50% N


def test_indexed_fasta_reads_only_the_regions(tmp_path: Path) -> None:
    # an invalid character outside every region: the whole-file stream stops at it, the indexed read never
    # sees it
    fasta = write_fasta(tmp_path / "g.fa", {"a": FLY[:50_000] + "X" + FLY[50_001:100_000], "b": HUMAN})
    train = write_bed(tmp_path / "train.bed", ["a\t0\t40000"])
    held = write_bed(tmp_path / "held.bed", ["a\t60000\t100000"])
    with pytest.raises(DataError, match="base 50,001 .* invalid character 'X'"):
        build(tmp_path, fasta, seq=4096, train=[str(train)], heldout=[str(held)])
    pyfaidx.Faidx(str(fasta)).close()
    out, _ = build(tmp_path, fasta, seq=4096, train=[str(train)], heldout=[str(held)])
    assert read_manifest(out)["sources"][0]["md5"] is None
    assert read_manifest(out)["splits"]["heldout"]["windows"]["start"] == list(
        range(60_000, 100_000 - 4095, 4096)
    )


def test_bad_bed_lines_name_file_and_line(fly_files: dict[str, Path], tmp_path: Path) -> None:
    fasta = fly_files["indexed plain"]
    held = write_bed(tmp_path / "held.bed", ["# held out", f"{DMEL_RECORD}\t1000000\t1348131"])
    cases = {
        "end before start": (
            [f"{DMEL_RECORD}\t0\t10000", f"{DMEL_RECORD}\t20000\t15000"],
            "train.bed line 2: end 15,000 is not after start 20,000",
        ),
        "unknown chromosome": (
            [f"{DMEL_RECORD}\t0\t10000", "chrX\t0\t10000"],
            "train.bed line 2: chrX:1-10000 (train); records present: NC_004353.4, other",
        ),
        "overlaps held-out": (
            [f"{DMEL_RECORD}\t0\t10000", f"{DMEL_RECORD}\t990000\t1010000"],
            (
                f"train.bed line 2: {DMEL_RECORD}:990001-1010000 (train) and {held} line 2: "
                f"{DMEL_RECORD}:1000001-1348131 (heldout) share bases"
            ),
        ),
        "too few columns": ([f"{DMEL_RECORD}\t0"], "train.bed line 1: 'NC_004353.4\\t0' has 2 column(s)"),
        "not a number": ([f"{DMEL_RECORD}\t0\t1e5"], "train.bed line 1: start '0' and end '1e5' must be"),
        "past the record": (
            ["other\t1000\t9000"],
            f"other:1001-9000 (train) ends at base 9,000 but record other has {len(HUMAN):,} bases",
        ),
    }
    for case, (lines, message) in cases.items():
        train = write_bed(tmp_path / "train.bed", lines)
        with pytest.raises(DataError) as err:
            build(tmp_path, fasta, seq=4096, train=[str(train)], heldout=[str(held)])
        assert message in str(err.value), (case, str(err.value))
        assert str(tmp_path / "train.bed") in str(err.value), case
        assert_nothing_left(tmp_path)


def test_cli_bed_splits_and_rebuild_on_bed_change(fly_files: dict[str, Path], tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli"
    train = write_bed(tmp_path / "train.bed", [f"{DMEL_RECORD}\t0\t200000"])
    held = write_bed(tmp_path / "held.bed", [f"{DMEL_RECORD}\t1000000\t1348131"])
    argv = [
        "--fasta",
        str(fly_files["indexed bgzf"]),
        "--seq",
        "16k",
        "--train",
        str(train),
        "--heldout",
        str(held),
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    assert read_manifest(out)["splits"]["train"]["stats"]["windows"] == 200_000 // 16384
    assert main(argv) == 0 and "up to date" in capsys.readouterr().out
    write_bed(train, [f"{DMEL_RECORD}\t0\t100000"])  # same file name, other intervals: rebuilt
    assert main(argv) == 0 and "up to date" not in capsys.readouterr().out
    assert read_manifest(out)["splits"]["train"]["stats"]["windows"] == 100_000 // 16384
    write_bed(train, [f"{DMEL_RECORD}\t0\t-5"])
    assert main(argv) == 2
    assert f"{train} line 1: start '0' and end '-5'" in capsys.readouterr().err
    assert json.loads((out / "manifest.json").read_text())["split_files"][0]["path"] == str(train.resolve())
