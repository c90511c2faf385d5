"""Prepared data is checked: sizes and block checksums in the manifest, verified by the readers and by the
up-to-date check of `genomelm data`; flipped bytes, truncated and missing files and a broken manifest each
give a DataError naming the file and the command that rebuilds it."""

from __future__ import annotations

import importlib
import json
import os
import shlex
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash
from data_fixtures import DMEL, DMEL_RECORD, fly_windows

from genomelm.commands.data import main as data_main
from genomelm.data import DataError, WindowDataset, read_manifest
from genomelm.data.integrity import BlockHasher, block_digests

TRAIN, SEQ = "1-16384", 1024  # 16 training windows of the fly chromosome, 1 held out


def prepared(tmp_path: Path, name: str = "fly") -> Path:
    return fly_windows(tmp_path / name, TRAIN, SEQ)


def rebuild_command(folder: Path) -> str:
    """What the messages must name: the folder's own `genomelm data` command with force=true."""
    return read_manifest(folder)["command"] + " force=true"


def rerun(command: str) -> int:
    """`genomelm data` again with ``command`` (a manifest's), without force=true."""
    return data_main(shlex.split(command)[2:-1])


def flip(path: Path, at: int, value: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[at] = (data[at] % 4) + 1 if value is None else value  # another base code unless a value is given
    assert data != path.read_bytes()
    path.write_bytes(bytes(data))


def edit_manifest(folder: Path, change: Callable[[dict], None]) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


def test_manifest_records_size_and_block_digests(tmp_path: Path) -> None:
    folder = prepared(tmp_path)
    sums = read_manifest(folder)["checksums"]
    assert sums["hash"] == "xxh3_128" and sums["block_bytes"] == 64 << 20
    names = {f"{s}{k}{e}" for s in ("train", "heldout") for k in ("", ".softmask") for e in (".bin", ".idx")}
    assert set(sums["files"]) == names
    for name, entry in sums["files"].items():
        data = (folder / name).read_bytes()
        assert entry == {"bytes": len(data), "blocks": [xxhash.xxh3_128(data).hexdigest()]}, name
    assert sums["files"]["train.bin"]["bytes"] == 16 * SEQ


def test_block_hasher_splits_pieces_at_block_edges(tmp_path: Path) -> None:
    data = DMEL.read_bytes()[:10_500]
    hasher = BlockHasher(block_bytes=1000)
    for at in range(0, len(data), 333):  # pieces that straddle block edges
        hasher.update(data[at : at + 333])
    blocks = [xxhash.xxh3_128(data[at : at + 1000]).hexdigest() for at in range(0, len(data), 1000)]
    assert hasher.entry() == {"bytes": len(data), "blocks": blocks}
    (tmp_path / "f").write_bytes(data)
    assert [d for _, d in block_digests(tmp_path / "f", len(data), 1000, [10, 3])] == [blocks[10], blocks[3]]
    assert BlockHasher().entry() == {"bytes": 0, "blocks": []}


def _damage(folder: Path, case: str) -> tuple[str, str]:
    """Damage ``folder`` as ``case`` says; returns (the file the message must name, text it must contain)."""
    train_bin, idx = folder / "train.bin", folder / "train.idx"
    changed = "bytes 0-16,384 (block 1 of 1) changed since `genomelm data` wrote them (xxh3_128 differs"
    if case == "valid base changed":
        flip(train_bin, 5 * SEQ + 17)
        return "train.bin", changed
    if case == "invalid code":
        flip(train_bin, 5 * SEQ + 17, 255)
        return "train.bin", changed
    if case == "soft-mask flag flipped":
        mask = folder / "train.softmask.bin"
        flip(mask, 100, 1 - mask.read_bytes()[100])
        return "train.softmask.bin", "bytes 0-16,384 (block 1 of 1) changed"
    if case == "truncated .bin":
        os.truncate(train_bin, 16 * SEQ - 1000)
        return "train.bin", "15,384 bytes, but manifest.json records 16,384 (truncated)"
    if case == "missing .idx":
        idx.unlink()
        return "train.idx", "missing (manifest.json lists it)"
    if case == "changed .idx":
        flip(idx, 40, 7)  # a window length
        return "train.idx", "changed since `genomelm data` wrote them"
    if case == "manifest not JSON":
        text = (folder / "manifest.json").read_text()
        (folder / "manifest.json").write_text(text[: len(text) // 2])
        return "manifest.json", "not valid JSON ("
    if case == "manifest without windows":
        edit_manifest(folder, lambda m: m["splits"]["train"].pop("windows"))
        return "manifest.json", "no 'splits.train.windows' entry"
    if case == "manifest without seq_len":
        edit_manifest(folder, lambda m: m.pop("seq_len"))
        return "manifest.json", "no 'seq_len' entry"
    if case == "manifest without a file's checksum":
        edit_manifest(folder, lambda m: m["checksums"]["files"].pop("train.softmask.bin"))
        return "manifest.json", "no 'checksums.files.train.softmask.bin' entry"
    raise AssertionError(case)


CASES = [
    "valid base changed",
    "invalid code",
    "soft-mask flag flipped",
    "truncated .bin",
    "missing .idx",
    "changed .idx",
    "manifest not JSON",
    "manifest without windows",
    "manifest without seq_len",
    "manifest without a file's checksum",
]


@pytest.mark.parametrize("case", CASES)
def test_damage_is_named_at_open_and_rebuilt_by_genomelm_data(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture
) -> None:
    folder = prepared(tmp_path)
    original = read_manifest(folder)
    command = rebuild_command(folder)
    capsys.readouterr()
    name, text = _damage(folder, case)
    with pytest.raises(DataError) as err:
        WindowDataset(folder, "train")
    message = str(err.value)
    assert f"{folder / name}: " in message and text in message, message
    assert message.endswith(f"; rebuild it: `{command}`"), message  # salvaged even from broken JSON
    # `genomelm data` with the same command does not call the folder up to date: it rebuilds it
    assert rerun(command) == 0
    log = capsys.readouterr().out
    assert f"{folder / name}: " in log and f"rebuilding {folder}" in log and "up to date" not in log, log
    assert read_manifest(folder)["checksums"] == original["checksums"]
    assert read_manifest(folder)["fingerprint"] == original["fingerprint"]  # the same data identity
    assert len(WindowDataset(folder, "train")) == 16
    assert rerun(command) == 0 and "is up to date" in capsys.readouterr().out


def test_damage_in_one_split_does_not_stop_the_other(tmp_path: Path) -> None:
    folder = prepared(tmp_path)
    flip(folder / "train.bin", 3)
    assert WindowDataset(folder, "heldout")[0].end == 201024
    with pytest.raises(DataError, match="train.bin: bytes 0-16,384"):
        WindowDataset(folder, "train")


def test_lazy_verification_hashes_each_block_before_its_first_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = importlib.import_module("genomelm.data.prepare")  # the module, not genomelm.data.prepare()
    monkeypatch.setattr(writer, "HASH_BLOCK_BYTES", 4 * SEQ)  # 4 blocks of 4 windows
    folder = prepared(tmp_path)
    assert len(read_manifest(folder)["checksums"]["files"]["train.bin"]["blocks"]) == 4
    flip(folder / "train.bin", 9 * SEQ + 5)  # window 9, block 3
    ds = WindowDataset(folder, "train", verify="lazy")  # sizes and indexes only
    opened = ds.check.hashed_bytes
    assert opened == sum((folder / n).stat().st_size for n in ("train.idx", "train.softmask.idx"))
    for index in (0, 3, 4, 15):  # blocks 1, 2 and 4
        ds[index]
    assert ds.check.hashed_bytes - opened == 3 * 2 * 4 * SEQ  # each block of both .bin files once
    with pytest.raises(DataError) as err:
        ds[10]
    assert f"{folder / 'train.bin'}: bytes 8,192-12,288 (block 3 of 4) changed" in str(err.value)
    assert str(err.value).endswith(f"rebuild it: `{rebuild_command(folder)}`")
    with pytest.raises(DataError, match="block 3 of 4"):
        WindowDataset(folder, "train")  # verify="open" hashes every block at once


def test_folder_without_checksums_reads_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = prepared(tmp_path)
    expected = [WindowDataset(folder, "train")[i].ids for i in range(16)]
    edit_manifest(folder, lambda m: m.pop("checksums"))  # as genomelm before checksums wrote it
    command = rebuild_command(folder)
    with pytest.warns(UserWarning) as caught:
        ds = WindowDataset(folder, "train")
    note = str(caught[0].message)
    assert note.startswith(f"{folder / 'manifest.json'} has no checksums (prepared by an older genomelm)")
    assert note.endswith(f"rebuild it to add them: `{command}`")
    assert all((ds[i].ids == expected[i]).all() for i in range(16))
    # without checksums, a byte that is no base code is still caught when its window is read
    flip(folder / "train.bin", 7 * SEQ + 3, 255)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = WindowDataset(folder, "train")
        with pytest.raises(DataError) as err:
            ds[7]
        assert str(err.value) == (
            f"{folder / 'train.bin'}: byte {7 * SEQ + 3:,} (window 7, position 3) is 255, not a base code "
            f"(0-5); rebuild it: `{command}`"
        )
        os.truncate(folder / "train.bin", 15 * SEQ)  # and a truncated .bin at open, against its index
        with pytest.raises(DataError) as err:
            WindowDataset(folder, "train")
        assert str(err.value).startswith(
            f"{folder / 'train.bin'}: 15,360 bytes, but train.idx needs 16,384 (truncated); rebuild it"
        )
    # genomelm data rebuilds such a folder (same fingerprint) to add the checksums
    capsys.readouterr()
    assert rerun(command) == 0
    assert "has no checksums (prepared by an older genomelm); rebuilding" in capsys.readouterr().out
    assert "checksums" in read_manifest(folder)
    assert all((WindowDataset(folder, "train")[i].ids == expected[i]).all() for i in range(16))


def test_damaged_manifest_beside_foreign_files_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    folder = prepared(tmp_path)
    (folder / "notes.txt").write_text("mine")
    (folder / "manifest.json").write_text("{")
    assert rerun_with_args(folder) == 2
    err = capsys.readouterr().err
    assert (
        f"{folder / 'manifest.json'}: not valid JSON" in err
        and "holds files a prepared dataset does not" in err
    )
    assert (folder / "notes.txt").read_text() == "mine"


def rerun_with_args(folder: Path) -> int:
    """`genomelm data` for ``folder`` without reading its (broken) manifest."""
    args = ["--fasta", str(DMEL), "--genome", "fly", "--train", f"{DMEL_RECORD}:{TRAIN}"]
    return data_main(
        [*args, "--heldout", f"{DMEL_RECORD}:200001-201024", "--seq", str(SEQ), "--out", str(folder)]
    )


def test_manifest_text_without_a_command_names_the_pattern(tmp_path: Path) -> None:
    folder = prepared(tmp_path)
    (folder / "manifest.json").write_text("[1, 2")
    with pytest.raises(DataError) as err:
        WindowDataset(folder, "train")
    assert str(err.value).endswith(
        "rebuild it: `genomelm data ... force=true` (with the settings it was prepared with)"
    )


def test_a_copied_folder_is_rebuilt_where_it_was_opened(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A prepared folder copied (or moved) elsewhere and damaged there: the rebuild command names the copy as
    its out=, not the folder it was first written to, and running it rebuilds the copy."""
    import shutil

    original = prepared(tmp_path)
    copy = tmp_path / "elsewhere" / "fly"
    shutil.copytree(original, copy)
    flip(copy / "train.bin", 5)
    with pytest.raises(DataError) as err:
        WindowDataset(copy, "train")
    command = str(err.value).split("rebuild it: `")[1].rstrip("`")
    words = shlex.split(command)
    assert [word for word in words if word.startswith("out=")] == [f"out={copy}"], command
    assert words[-1] == "force=true"
    capsys.readouterr()
    assert data_main(words[2:]) == 0 and f"wrote {copy} " in capsys.readouterr().out
    assert len(WindowDataset(copy, "train")) == 16 and len(WindowDataset(original, "train")) == 16
