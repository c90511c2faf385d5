"""Prepared windows equal the source DNA, whatever the input format (plain, gzip, BGZF)."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import numpy as np
import pytest
from Bio import bgzf
from data_fixtures import DMEL, DMEL_RECORD, HG38_FRAGMENTS, HG38_RECORDS, build, read_records, write_fasta

from genomelm.data import WindowDataset

IUPAC = "RYKMSWBDHVrykmswbdhv"


def expected_windows(seq: str, start: int, end: int, size: int, stride: int, max_n: float) -> list[int]:
    """Independent window starts (0-based) of [start, end) kept by the N rule."""
    starts = range(start, end - size + 1, stride)
    return [s for s in starts if seq[s : s + size].upper().count("N") <= max_n * size]


@pytest.fixture(scope="module")
def hg38_variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """hg38 fragments as plain, gzip and BGZF, each prepared with the same settings."""
    tmp = tmp_path_factory.mktemp("formats")
    text = gzip.decompress(HG38_FRAGMENTS.read_bytes())
    plain = tmp / "frag.fa"
    plain.write_bytes(text)
    with bgzf.BgzfWriter(str(tmp / "frag.fa.bgz"), "wb") as handle:
        handle.write(text)
    inputs = {"plain": plain, "gzip": HG38_FRAGMENTS, "bgzf": tmp / "frag.fa.bgz"}
    settings = {"seq": 4096, "stride": 3000, "heldout": [HG38_RECORDS[1]]}
    return {fmt: build(tmp, path, name=fmt, **settings)[0] for fmt, path in inputs.items()}


def test_plain_gzip_bgzf_identical(hg38_variants: dict) -> None:
    manifests = {fmt: json.loads((out / "manifest.json").read_text()) for fmt, out in hg38_variants.items()}
    assert {m["sources"][0]["format"] for m in manifests.values()} == {"plain", "gzip"}
    for out in hg38_variants.values():
        for name in ("train.bin", "train.softmask.bin", "heldout.bin", "heldout.softmask.bin", "train.idx"):
            assert (out / name).read_bytes() == (hg38_variants["plain"] / name).read_bytes()
        assert manifests[out.name]["splits"] == manifests["plain"]["splits"]


def test_windows_match_biopython(hg38_variants: dict) -> None:
    records = read_records(HG38_FRAGMENTS)
    out = hg38_variants["gzip"]
    for split, names in (("train", HG38_RECORDS[:1]), ("heldout", HG38_RECORDS[1:])):
        ds = WindowDataset(out, split)
        expected = [
            (n, s) for n in names for s in expected_windows(records[n], 0, len(records[n]), 4096, 3000, 0.5)
        ]
        assert [(ds[i].record, ds[i].start) for i in range(len(ds))] == expected
        windows = ds.manifest["splits"][split]["windows"]
        for i, (name, start) in enumerate(expected):
            source = records[name][start : start + 4096]
            assert ds.letters(i) == source  # case comes from the soft-mask array
            counts = Counter(ds.codes(i).tolist())
            assert [counts[c] for c in (1, 2, 3, 4, 5)] == [source.upper().count(b) for b in "ACGTN"]
            assert windows["n"][i] == source.upper().count("N")
            assert windows["softmasked"][i] == sum(ch.islower() for ch in source)
            assert ds[i].end == start + 4096


def test_demo_regions_n_run_and_report(tmp_path) -> None:
    seq = read_records(DMEL)[DMEL_RECORD]
    train, heldout = f"{DMEL_RECORD}:1-1000000", f"{DMEL_RECORD}:1000001-1348131"
    out, logs = build(tmp_path, DMEL, seq="16k", train=[train], heldout=[heldout])
    manifest = json.loads((out / "manifest.json").read_text())
    held = manifest["splits"]["heldout"]
    assert held["windows"]["start"] == expected_windows(seq, 1_000_000, 1_348_131, 16384, 16384, 0.5)
    assert held["stats"]["dropped_n_windows"] == 1  # the 17 kb N run covers most of one window
    assert held["stats"]["n"] == seq[1_000_000:].count("N") == 17_000
    assert held["stats"]["dropped_tail_bases"] == 348_131 % 16384
    assert manifest["splits"]["train"]["stats"]["softmasked"] == sum(c.islower() for c in seq[:1_000_000])
    assert manifest["report"] in logs and "dropped N" in manifest["report"]
    ds = WindowDataset(out, "heldout")
    for i in range(len(ds)):
        assert ds.letters(i) == seq[ds[i].start : ds[i].end]


def test_iupac_becomes_n_and_is_counted(tmp_path) -> None:
    dna = read_records(HG38_FRAGMENTS)[HG38_RECORDS[1]][:3000]
    rng = np.random.default_rng(0)
    spots = rng.choice(len(dna), size=len(IUPAC), replace=False)
    mixed = list(dna)
    for spot, code in zip(spots, IUPAC):
        mixed[spot] = code
    fasta = write_fasta(tmp_path / "iupac.fa", {"a": "".join(mixed), "b": dna})
    out, _ = build(tmp_path, fasta, seq=1000, heldout=["b"])
    stats = json.loads((out / "manifest.json").read_text())["splits"]["train"]["stats"]
    assert stats["iupac_as_n"] == len(IUPAC)
    ds = WindowDataset(out, "train")
    letters = "".join(ds.letters(i) for i in range(len(ds)))
    expected = "".join("N" if c in IUPAC.upper() else "n" if c in IUPAC.lower() else c for c in mixed)
    assert letters == expected


def test_allow_short_pads_and_default_train(tmp_path) -> None:
    dna = read_records(HG38_FRAGMENTS)[HG38_RECORDS[1]]
    fasta = write_fasta(tmp_path / "short.fa", {"long": dna, "tiny": dna[:700], "held": dna[1000:3000]})
    out, _ = build(tmp_path, fasta, seq=2048, heldout=["held"], allow_short=True)
    train = WindowDataset(out, "train")
    assert [train[i].record for i in range(len(train))] == ["long", "long", "tiny"]
    tiny = train[2]
    assert (tiny.start, tiny.end) == (0, 700)
    assert train.letters(2) == dna[:700] + "-" * (2048 - 700)
    assert (tiny.labels[699:] == -100).all()
    assert train.manifest["splits"]["train"]["stats"]["padded_short"] == 1
    assert WindowDataset(out, "heldout")[0].end == 2000
