"""Results written as a set (`genomelm.eval.report.write_result_set`): eval's and the probe's files are
replaced whole or not at all, a full disk leaves the previous set and says so in one line, and the two sets
share results/<run>/ without touching each other."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from data_fixtures import DMEL, DMEL_RECORD, read_records
from test_eval_buckets import run_synthetic_eval
from test_eval_probe import Recorder, window

from genomelm.commands import eval as command
from genomelm.commands import probe
from genomelm.eval import evaluate
from genomelm.eval import probe as probe_outputs
from genomelm.eval.evaluate import HeldoutSet
from genomelm.eval.probe import run_probe, write_probe_outputs
from genomelm.eval.report import WriteError, file_system, write_error, write_result_set
from genomelm.run.config import TrainConfig

EVAL_FILES = ("buckets.json", "buckets.csv", "windows.csv", "loss_by_position.png")
PROBE_FILES = ("copy_probe.json", "copy_probe.csv", "copy_probe.png")
FLY = read_records(DMEL)[DMEL_RECORD]


def contents(folder: Path, names: tuple[str, ...]) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in names}


def entries(folder: Path) -> list[str]:
    """The names in `folder`, sorted, a generation's `.<set>.gen-<hex>` written `.<set>.gen`."""
    return sorted(
        e.name.split(".gen-")[0] + ".gen" if ".gen-" in e.name else e.name for e in folder.iterdir()
    )


def generations(folder: Path, files: tuple[str, ...]) -> set[str]:
    """The generation folders `files` resolve into: exactly one for a whole set."""
    return {Path(os.path.realpath(folder / file)).parent.name for file in files}


def no_space(result: dict, path: Path) -> None:
    """A figure writer on a full disk: part of the PNG, then ENOSPC, after the JSON and CSV were written."""
    assert (path.parent / "buckets.json").is_file() and (path.parent / "buckets.csv").is_file()
    path.write_bytes(b"\x89PNG\r\n")
    raise OSError(errno.ENOSPC, "No space left on device")


def no_space_probe(result: dict, path: Path) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def probe_result(distances: str = "32,64") -> dict:
    config = TrainConfig().replace(run="synthetic", probe_length=16, probe_distances=distances)
    heldout = HeldoutSet(
        "fly", [window(FLY[200_000:201_000])], {"data_dir": "fly", "windows": [{"index": 0}]}
    )
    return run_probe(config, heldout, {"a": Recorder(), "b": Recorder()}.__getitem__, "a", "b")


def test_disk_full_mid_set_keeps_the_previous_set_whole(tmp_path, monkeypatch) -> None:
    run_synthetic_eval(tmp_path, seq=10, bucket=4)
    previous = contents(tmp_path, EVAL_FILES)
    monkeypatch.setattr(evaluate, "save_figure", no_space)
    with pytest.raises(WriteError) as raised:
        run_synthetic_eval(tmp_path, seq=12, bucket=3)
    message = str(raised.value)
    assert message.startswith(f"no space left on {file_system(tmp_path)} writing ")
    assert f"writing {tmp_path / 'loss_by_position.png'};" in message and "\n" not in message
    assert raised.value.errno == errno.ENOSPC
    assert contents(tmp_path, EVAL_FILES) == previous  # complete: the old JSON, CSV and figure
    assert json.loads(previous["buckets.json"])["settings"]["seq"] == 10
    assert entries(tmp_path) == [".buckets", ".buckets.gen", ".buckets.lock", *sorted(EVAL_FILES)]
    assert len(generations(tmp_path, EVAL_FILES)) == 1


def test_an_exception_in_plotting_leaves_the_previous_set(tmp_path, monkeypatch) -> None:
    run_synthetic_eval(tmp_path, seq=10, bucket=4)
    previous = contents(tmp_path, EVAL_FILES)

    def broken(result: dict, path: Path) -> None:
        raise ValueError("a bug in the figure")

    monkeypatch.setattr(evaluate, "save_figure", broken)
    with pytest.raises(ValueError, match="a bug in the figure"):
        run_synthetic_eval(tmp_path, seq=12, bucket=3)
    assert contents(tmp_path, EVAL_FILES) == previous
    assert entries(tmp_path) == [".buckets", ".buckets.gen", ".buckets.lock", *sorted(EVAL_FILES)]


def test_a_second_eval_replaces_the_whole_set(tmp_path) -> None:
    run_synthetic_eval(tmp_path, seq=10, bucket=4)
    first = contents(tmp_path, EVAL_FILES)
    run_synthetic_eval(tmp_path, seq=12, bucket=3)
    second = contents(tmp_path, EVAL_FILES)
    assert all(first[name] != second[name] for name in EVAL_FILES)
    assert json.loads(second["buckets.json"])["settings"]["seq"] == 12
    assert len(second["buckets.csv"].decode().splitlines()) == 1 + 4  # header, buckets of 3 in 12
    assert second["loss_by_position.png"][:8] == b"\x89PNG\r\n\x1a\n"
    assert entries(tmp_path) == [".buckets", ".buckets.gen", ".buckets.lock", *sorted(EVAL_FILES)]
    assert all((tmp_path / name).is_symlink() for name in EVAL_FILES)  # the paths readers open are kept
    assert len(generations(tmp_path, EVAL_FILES)) == 1


def test_probe_and_eval_sets_share_the_folder(tmp_path, monkeypatch) -> None:
    (tmp_path / "notes.txt").write_text("mine\n")
    run_synthetic_eval(tmp_path, seq=10, bucket=4)
    write_probe_outputs(probe_result(), tmp_path)
    eval_files, probe_files = contents(tmp_path, EVAL_FILES), contents(tmp_path, PROBE_FILES)

    run_synthetic_eval(tmp_path, seq=12, bucket=3)  # a new eval leaves the probe's set
    assert contents(tmp_path, PROBE_FILES) == probe_files
    write_probe_outputs(probe_result("16,32"), tmp_path)  # and a new probe eval's
    assert contents(tmp_path, PROBE_FILES) != probe_files
    assert json.loads((tmp_path / "copy_probe.json").read_text())["settings"]["distances"] == [16, 32]
    assert json.loads((tmp_path / "buckets.json").read_text())["settings"]["seq"] == 12
    eval_files = contents(tmp_path, EVAL_FILES)

    monkeypatch.setattr(probe_outputs, "save_probe_figure", no_space_probe)
    with pytest.raises(WriteError, match="no space left on .* writing .*copy_probe.png"):
        write_probe_outputs(probe_result(), tmp_path)
    assert contents(tmp_path, EVAL_FILES) == eval_files
    assert json.loads((tmp_path / "copy_probe.json").read_text())["settings"]["distances"] == [16, 32]
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    assert entries(tmp_path) == sorted(
        [".buckets", ".buckets.gen", ".buckets.lock", ".copy_probe", ".copy_probe.gen", ".copy_probe.lock"]
        + [*EVAL_FILES, *PROBE_FILES, "notes.txt"]
    )


def test_plain_files_of_an_older_layout_are_adopted(tmp_path) -> None:
    old = {"a.json": b"old json", "a.csv": b"old csv"}  # no figure: the old set had none
    for name, data in old.items():
        (tmp_path / name).write_bytes(data)
    writers = {
        name: (lambda data: lambda path: path.write_bytes(data))(b"new " + name.encode()) for name in old
    }

    def fail(path: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(WriteError):
        write_result_set(tmp_path, "a", {**writers, "a.png": fail})
    assert contents(tmp_path, ("a.json", "a.csv")) == old  # now through links to the adopted generation
    assert not (tmp_path / "a.png").exists()  # as before: no figure
    assert entries(tmp_path) == [".a", ".a.gen", ".a.lock", "a.csv", "a.json"]
    assert os.readlink(tmp_path / "a.json") == ".a/a.json"

    paths = write_result_set(tmp_path, "a", writers)
    assert paths == {name: tmp_path / name for name in old}
    assert contents(tmp_path, ("a.json", "a.csv")) == {"a.json": b"new a.json", "a.csv": b"new a.csv"}
    assert entries(tmp_path) == [".a", ".a.gen", ".a.lock", "a.csv", "a.json"]


def test_what_a_killed_write_left_is_removed(tmp_path) -> None:
    write_result_set(tmp_path, "a", {"a.txt": lambda path: path.write_text("one")})
    (tmp_path / ".a.gen-0123abcd").mkdir()  # killed while writing its files
    (tmp_path / ".a.gen-0123abcd" / "a.txt").write_text("half")
    os.symlink(".a.gen-0123abcd", tmp_path / ".a.tmp-4567ef")  # killed between making a link and renaming it
    (tmp_path / ".ab.gen-89").mkdir()  # another set's: kept
    write_result_set(tmp_path, "a", {"a.txt": lambda path: path.write_text("two")})
    assert (tmp_path / "a.txt").read_text() == "two"
    assert entries(tmp_path) == [".a", ".a.gen", ".a.lock", ".ab.gen", "a.txt"]


def test_write_error_messages(tmp_path) -> None:
    path = tmp_path / "run" / "buckets.json"
    error = write_error(OSError(errno.ENOSPC, "No space left on device"), path)
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC and error.filename == str(path)
    assert str(error) == (
        f"no space left on {file_system(path)} writing {path}; the previous result there is unchanged"
    )
    assert str(tmp_path.anchor) in file_system(path)
    denied = write_error(PermissionError(errno.EACCES, "Permission denied"), path)
    assert str(denied).startswith(f"Permission denied writing {path};")


def test_commands_print_a_full_disk_as_one_line(tmp_path, monkeypatch, capsys) -> None:
    result = run_synthetic_eval(tmp_path / "scratch")
    argv = ["run=synthetic", f"results_dir={tmp_path}"]
    monkeypatch.setattr(command, "model_pair", lambda config, before, after: ("before", "after"))
    monkeypatch.setattr(command, "run_scoring", lambda score, config, *args: result)
    monkeypatch.setattr(evaluate, "save_figure", no_space)
    capsys.readouterr()
    assert command.main(argv) == 1
    out, err = capsys.readouterr()
    assert "bucket" in out and "all" in out  # the table is printed all the same
    assert err.count("\n") == 1 and err.startswith("genomelm eval: no space left on ")
    assert f"writing {tmp_path / 'synthetic' / 'loss_by_position.png'};" in err
    assert not (tmp_path / "synthetic" / "buckets.json").exists()
    assert entries(tmp_path / "synthetic") == [".buckets.lock"]  # a failed first write: nothing to open

    monkeypatch.setattr(probe, "model_pair", lambda config, before, after: ("a", "b"))
    monkeypatch.setattr(probe, "run_scoring", lambda score, config, *args: probe_result())
    monkeypatch.setattr(probe_outputs, "save_probe_figure", no_space_probe)
    assert probe.main([*argv, "probe_distances=32,64", "probe_length=16"]) == 1
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("genomelm probe: no space left on ")
    assert f"writing {tmp_path / 'synthetic' / 'copy_probe.png'};" in err and "distance" in out
