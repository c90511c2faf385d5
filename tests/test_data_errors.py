"""Bad input gives a clear error and leaves no output; re-runs are no-ops; killed runs leave nothing
complete."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from data_fixtures import (
    DMEL,
    DMEL_RECORD,
    HG38_FRAGMENTS,
    HG38_RECORDS,
    ROOT,
    build,
    read_records,
    write_fasta,
)

from genomelm.commands.data import main
from genomelm.data import DataError, read_manifest

FRAG = read_records(HG38_FRAGMENTS)[HG38_RECORDS[1]]


def assert_nothing_left(tmp_path: Path, name: str = "out") -> None:
    assert not (tmp_path / name).exists()
    assert not list(tmp_path.glob(f".{name}.*"))


def bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, dict, str]]:
    """name -> (FASTA, settings, text the error must contain)."""
    truncated = tmp_path / "trunc.fa.gz"
    truncated.write_bytes(HG38_FRAGMENTS.read_bytes()[:12_000])
    empty = tmp_path / "empty.fa"
    empty.write_bytes(b"")
    notfasta = tmp_path / "notes.txt"
    notfasta.write_text("these are notes\nACGT\n")
    dup = write_fasta(tmp_path / "dup.fa", {"a": FRAG[:3000], "b": FRAG[:3000]})
    dup.write_text(dup.read_text().replace(">b ", ">a "))
    stray = write_fasta(tmp_path / "stray.fa", {"a": FRAG[:2000] + "X" + FRAG[2001:4000], "b": FRAG[:3000]})
    ok = write_fasta(tmp_path / "ok.fa", {"a": FRAG[:3000], "b": FRAG[:3000]})
    return {
        "truncated gzip": (truncated, {"heldout": ["x"]}, "truncated or corrupt gzip"),
        "empty": (empty, {"heldout": ["x"]}, "file is empty"),
        "not FASTA": (notfasta, {"heldout": ["x"]}, "not a FASTA file"),
        "duplicate names": (dup, {"heldout": ["a"]}, "duplicate record name 'a'"),
        "stray character": (
            stray,
            {"heldout": ["b"]},
            "record a, base 2,001 (1-based): invalid character 'X'",
        ),
        "unknown chromosome": (ok, {"heldout": ["chr9"]}, "'chr9' (heldout); records present: a, b"),
        "SEQ longer than record": (ok, {"heldout": ["b"], "seq": 4096}, "fewer than SEQ=4,096"),
        "region past the end": (
            ok,
            {"heldout": ["b:1-2000"], "train": ["a:1-9000"]},
            "record a has 3,000 bases",
        ),
        "overlapping splits": (
            ok,
            {"train": ["a:1-2000"], "heldout": ["a:1500-3000"]},
            "same bases are in both",
        ),
        "whole and region overlap": (ok, {"train": ["a"], "heldout": ["a:1-2000", "b"]}, "share bases of a"),
    }


CASES = [
    "truncated gzip",
    "empty",
    "not FASTA",
    "duplicate names",
    "stray character",
    "unknown chromosome",
    "SEQ longer than record",
    "region past the end",
    "overlapping splits",
    "whole and region overlap",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_errors_and_leaves_nothing(tmp_path: Path, case: str) -> None:
    fasta, settings, message = bad_inputs(tmp_path)[case]
    settings = {"seq": 1000, **settings}
    with pytest.raises(DataError) as err:
        build(tmp_path, fasta, **settings)
    assert message in str(err.value)
    if "overlap" not in case:  # overlaps are found from the settings alone, before reading
        assert str(fasta) in str(err.value)
    assert_nothing_left(tmp_path)


def test_cli_error_exit_status_and_config_override(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "demo"
    assert main(["--genome", "demo", "--seq", "2M", "--out", str(out), "--no-progress"]) == 2
    assert "fewer than SEQ=2,097,152" in capsys.readouterr().err
    assert_nothing_left(tmp_path, "demo")
    assert main(["--genome", "nosuch", "--no-progress"]) == 2
    assert "unknown genome 'nosuch'" in capsys.readouterr().err


def test_rerun_is_noop_and_changed_settings_rebuild(tmp_path: Path) -> None:
    fasta = write_fasta(tmp_path / "g.fa", {"a": FRAG[:4000], "b": FRAG[1000:3500]})
    out, _ = build(tmp_path, fasta, seq=1000, heldout=["b"])
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    _, logs = build(tmp_path, fasta, seq=1000, heldout=["b"])
    assert any("up to date" in line and "nothing to do" in line for line in logs)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    _, logs = build(tmp_path, fasta, seq=1000, stride=500, heldout=["b"])
    assert not any("up to date" in line for line in logs)
    assert read_manifest(out)["stride"] == 500
    assert not list(tmp_path.glob(".out.*"))


def test_existing_foreign_folder_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    fasta = write_fasta(tmp_path / "g.fa", {"a": FRAG[:4000], "b": FRAG[:2000]})
    with pytest.raises(DataError, match="not a prepared dataset"):
        build(tmp_path, fasta, seq=1000, heldout=["b"])
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_interrupted_run_leaves_nothing_complete(tmp_path: Path, sig: signal.Signals) -> None:
    # A tiny stride makes ~80k windows from the 1.35 Mb demo genome: slow enough to interrupt mid-way.
    out = tmp_path / "out"
    slow = [
        "--fasta",
        str(DMEL),
        "--seq",
        "4096",
        "--stride",
        "16",
        "--heldout",
        f"{DMEL_RECORD}:1000001-1348131",
    ]
    cmd = [sys.executable, "-m", "genomelm.commands.data", *slow, "--out", str(out), "--no-progress"]
    # SIGINT as a terminal delivers it: a shell that starts the suite in the background (`cmd &` without job
    # control) leaves it ignored, and a child would inherit that
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size > 1 << 20 for p in tmp_path.glob(".out.tmp-*/*.bin")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    os.kill(proc.pid, sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == (-9 if sig == signal.SIGKILL else 130), stderr
    assert not out.exists() and read_manifest(out) is None
    assert not list(tmp_path.glob(".out.*/manifest.json"))
    if sig == signal.SIGINT:
        assert "interrupted" in stderr and not list(tmp_path.glob(".out.*"))
    assert main([*slow[:4], "--heldout", slow[-1], "--out", str(out), "--no-progress"]) == 0
    assert read_manifest(out)["seq_len"] == 4096
    assert not list(tmp_path.glob(".out.*"))


def test_truncated_gzip_names_file_in_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    broken = tmp_path / "broken.fa.gz"
    broken.write_bytes(gzip.compress(b">a\n" + FRAG[:5000].encode())[:-20])
    assert (
        main(["--fasta", str(broken), "--seq", "1000", "--heldout", "a", "--out", str(tmp_path / "o")]) == 2
    )
    assert f"{broken}: truncated or corrupt gzip" in capsys.readouterr().err
