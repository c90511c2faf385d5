""".2bit input: read through py2bit, it prepares byte for byte what the equivalent FASTA does.

There is no twoBitToFa/faToTwoBit here, so a small writer of the public .2bit format (version 0, little
endian) turns the bundled real genome pieces into .2bit, and py2bit checks the writer.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import numpy as np
import py2bit
import pytest
from data_fixtures import HG38_FRAGMENTS, HG38_RECORDS, build, read_records, write_fasta

from genomelm.commands.data import main
from genomelm.data import DataError
from genomelm.data.fasta import FastaStream
from genomelm.data.streams import open_stream
from genomelm.data.twobit import TwoBitStream

_PACK = np.zeros(256, dtype=np.uint8)  # T=0 C=1 A=2 G=3; N is stored as T, like faToTwoBit does
for _letters, _code in (("Tt", 0), ("Cc", 1), ("Aa", 2), ("Gg", 3)):
    for _letter in _letters:
        _PACK[ord(_letter)] = _code


def _runs(flags: np.ndarray) -> tuple[list[int], list[int]]:
    """Starts and sizes of the runs of True in ``flags``."""
    edges = np.diff(np.concatenate(([0], flags.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return starts.tolist(), (ends - starts).tolist()


def write_2bit(path: Path, records: dict[str, str]) -> Path:
    """A .2bit file of ``records`` (name -> A C G T N text, lower case = soft-masked), as faToTwoBit makes."""
    bodies = []
    for seq in records.values():
        letters = np.frombuffer(seq.encode("ascii"), dtype=np.uint8)
        n_starts, n_sizes = _runs((letters == ord("N")) | (letters == ord("n")))
        m_starts, m_sizes = _runs((letters >= ord("a")) & (letters <= ord("z")))
        codes = _PACK[letters]
        codes = np.concatenate([codes, np.zeros(-len(codes) % 4, dtype=np.uint8)]).reshape(-1, 4)
        packed = (codes[:, 0] << 6) | (codes[:, 1] << 4) | (codes[:, 2] << 2) | codes[:, 3]
        bodies.append(
            struct.pack("<II", len(seq), len(n_starts))
            + struct.pack(f"<{2 * len(n_starts)}I", *n_starts, *n_sizes)
            + struct.pack("<I", len(m_starts))
            + struct.pack(f"<{2 * len(m_starts)}I", *m_starts, *m_sizes)
            + struct.pack("<I", 0)
            + packed.astype(np.uint8).tobytes()
        )
    names = [name.encode("ascii") for name in records]
    offset = 16 + sum(1 + len(name) + 4 for name in names)
    index = b""
    for name, body in zip(names, bodies):
        index += struct.pack("<B", len(name)) + name + struct.pack("<I", offset)
        offset += len(body)
    path.write_bytes(struct.pack("<4I", 0x1A412743, 0, len(records), 0) + index + b"".join(bodies))
    return path


def generated_record() -> str:
    """Random bases with an N run, part of it inside a soft-masked stretch (so 'n'), and a length % 4 == 3."""
    rng = np.random.default_rng(7)
    bases = "".join(rng.choice(list("ACGT"), size=9_003))
    return (
        bases[:2000]
        + bases[2000:2500].lower()
        + "n" * 300
        + "N" * 700
        + bases[2500:5000]
        + "N" * 5
        + bases[5000:]
    )


@pytest.fixture(scope="module")
def genome(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The hg38 fragments plus a generated record, as FASTA and as .2bit."""
    tmp = tmp_path_factory.mktemp("twobit")
    records = {**read_records(HG38_FRAGMENTS), "gen": generated_record()}
    assert list(records)[:2] == list(HG38_RECORDS)
    assert any(c.islower() for c in records[HG38_RECORDS[0]])  # real soft-masking
    return {
        "records": records,
        "fasta": write_fasta(tmp / "genome.fa", records),
        "twobit": write_2bit(tmp / "genome.2bit", records),
    }


def test_writer_is_read_back_by_py2bit(genome: dict) -> None:
    tb = py2bit.open(str(genome["twobit"]), True)
    try:
        assert list(tb.chroms()) == list(genome["records"])
        for name, seq in genome["records"].items():
            assert tb.chroms(name) == len(seq)
            # py2bit: soft-masked bases lower case, every N upper case (even inside a soft-masked block)
            assert tb.sequence(name) == seq.replace("n", "N")
            assert tb.sequence(name, 1001, 2999) == seq[1001:2999].replace("n", "N")
    finally:
        tb.close()


def test_stream_gives_the_fasta_events_in_pieces(genome: dict) -> None:
    """With no table, pieces of any size concatenate to the FASTA's text, case and 'n' included."""
    stream = open_stream(genome["twobit"], block_bytes=1001)
    assert isinstance(stream, TwoBitStream) and stream.format == "2bit"
    names, text = [], {}
    for event in stream:
        if isinstance(event, str):
            names.append(event)
            text[event] = []
        else:
            assert 0 < len(event) <= 1001
            text[names[-1]].append(event.decode())
    assert names == list(genome["records"])
    assert {n: "".join(parts) for n, parts in text.items()} == genome["records"]
    assert stream.md5 == hashlib.md5(genome["twobit"].read_bytes()).hexdigest()
    assert stream.bytes_read == genome["twobit"].stat().st_size
    assert type(open_stream(genome["fasta"])) is FastaStream


def test_prepared_dataset_identical_to_fasta(genome: dict, tmp_path: Path) -> None:
    outs = {}
    for kind in ("fasta", "twobit"):
        outs[kind] = tmp_path / kind
        argv = [
            "--fasta",
            str(genome[kind]),
            "--seq",
            "2048",
            "--stride",
            "1500",
            "--heldout",
            f"{HG38_RECORDS[1]},gen:1-5000",
            "--out",
            str(outs[kind]),
            "--no-progress",
        ]
        assert main(argv) == 0
    files = sorted(p.name for p in outs["fasta"].iterdir())
    assert files == sorted(p.name for p in outs["twobit"].iterdir())
    for name in files:
        if name != "manifest.json":
            assert (outs["twobit"] / name).read_bytes() == (outs["fasta"] / name).read_bytes(), name
    fasta, twobit = (json.loads((outs[k] / "manifest.json").read_text()) for k in ("fasta", "twobit"))
    assert twobit["splits"] == fasta["splits"]
    assert (
        fasta["splits"]["heldout"]["stats"]["softmasked"] > 0 and fasta["splits"]["heldout"]["stats"]["n"] > 0
    )
    assert fasta["splits"]["train"]["windows"]["records"] == [HG38_RECORDS[0], "gen"]
    source = twobit["sources"][0]
    assert source["format"] == "2bit"
    assert source["md5"] == hashlib.md5(genome["twobit"].read_bytes()).hexdigest()
    assert source["bytes"] == genome["twobit"].stat().st_size


def _assert_refused(tmp_path: Path, path: Path, pattern: str) -> None:
    with pytest.raises(DataError, match=pattern) as err:
        build(tmp_path, path, seq=1000, heldout=["gen"])
    assert str(path) in str(err.value)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("keep", [10, 40, 200, -1], ids=["header", "index", "record-header", "last-byte"])
def test_truncated_2bit_is_refused(genome: dict, tmp_path: Path, keep: int) -> None:
    data = genome["twobit"].read_bytes()
    if keep == 200:  # inside the block lists of the second record
        keep = (
            struct.unpack_from("<I", data, 16 + 1 + len(HG38_RECORDS[0]) + 4 + 1 + len(HG38_RECORDS[1]))[0]
            + 12
        )
    truncated = tmp_path / "cut.2bit"
    truncated.write_bytes(data[:keep])
    _assert_refused(tmp_path, truncated, re.escape("truncated or corrupt .2bit"))


def test_corrupt_and_unsupported_2bit_are_refused(genome: dict, tmp_path: Path) -> None:
    data = bytearray(genome["twobit"].read_bytes())
    big_endian = tmp_path / "be.2bit"
    big_endian.write_bytes(b"\x1a\x41\x27\x43" + bytes(12))
    _assert_refused(tmp_path, big_endian, "big-endian .*twoBitToFa")
    empty = tmp_path / "none.2bit"
    empty.write_bytes(struct.pack("<4I", 0x1A412743, 0, 0, 0))
    _assert_refused(tmp_path, empty, "no records")
    offset = struct.unpack_from("<I", data, 16 + 1 + len(HG38_RECORDS[0]))[0]
    struct.pack_into("<I", data, offset, 10**9)  # first record claims 1e9 bases
    corrupt = tmp_path / "big.2bit"
    corrupt.write_bytes(bytes(data))
    _assert_refused(tmp_path, corrupt, "corrupt .2bit")
