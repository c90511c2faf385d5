"""Checks of a prepared folder against its manifest: is it whole, and are its bytes the ones written?

``genomelm data`` records in ``manifest.json`` (key ``checksums``) each ``.bin`` / ``.idx`` file's size and
the xxh3-128 digest of every 64 MiB block of it (the last block shorter), hashed as the bytes are written.
xxh3 (the ``xxhash`` package) hashes ~20 GB/s on one core here, ~20x hashlib's BLAKE2b, so checking a folder
costs about what reading it does: ~0.1 s per GB from the page cache, the disk's speed when cold
(``benchmarks/data_verify.py``).

Readers (:class:`~genomelm.data.dataset.WindowDataset`) check through :class:`FolderCheck`: at open, every
file of the split is present with its recorded size, the small ``.idx`` files are hashed and agree with the
manifest and the ``.bin`` sizes; the ``.bin`` blocks are hashed at open too (``verify="open"``, the default)
or each block once before its first window is read (``verify="lazy"``). A folder prepared before checksums
were recorded is read with a warning naming the command that rebuilds it. Every failure is a
:class:`DamagedFolder` (a ``DataError``) naming the file, what is wrong and the command that rebuilds it.
"""

from __future__ import annotations

import json
import re
import shlex
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

import numpy as np
import xxhash

from genomelm.data.errors import DataError
from genomelm.data.indexed import index_lengths
from genomelm.data.vocab import CODE_NAMES

FORMAT_VERSION = 1  # part of the data fingerprint: changing it changes every folder's identity
SPLITS = ("train", "heldout")
MANIFEST = "manifest.json"
HASH = "xxh3_128"
HASH_BLOCK_BYTES = 64 << 20  # a 1 GB file has 16 blocks; one is read and hashed in ~7 ms from the page cache
UNKNOWN_COMMAND = "genomelm data ... force=true"
_READ_BYTES = 8 << 20  # read buffer: verifying maps no file pages into the process (RSS stays flat)


class DamagedFolder(DataError):
    """A prepared folder whose files do not match its manifest; ``path``: the file, ``problem``: what is
    wrong with it (the message adds the fix)."""

    def __init__(self, path: Path, problem: str, fix: str) -> None:
        super().__init__(f"{path}: {problem}; {fix}")
        self.path, self.problem, self.fix = path, problem, fix

    def __reduce__(self) -> tuple:  # rebuilt from its parts where a rank's error reaches its launcher
        return (type(self), (self.path, self.problem, self.fix))


class BlockHasher:
    """The xxh3-128 digest of every ``block_bytes`` block of a stream of bytes, fed in pieces of any size."""

    def __init__(self, block_bytes: int = HASH_BLOCK_BYTES) -> None:
        self.block_bytes = block_bytes
        self.size = 0
        self.blocks: list[str] = []
        self._hash = xxhash.xxh3_128()
        self._filled = 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.block_bytes - self._filled)
            self._hash.update(view[:take])
            self._filled += take
            self.size += take
            view = view[take:]
            if self._filled == self.block_bytes:
                self.blocks.append(self._hash.hexdigest())
                self._hash, self._filled = xxhash.xxh3_128(), 0

    def entry(self) -> dict:
        """The manifest entry of the bytes fed so far: ``{"bytes": size, "blocks": [hex digest, ...]}``."""
        blocks = self.blocks + ([self._hash.hexdigest()] if self._filled else [])
        return {"bytes": self.size, "blocks": blocks}


def block_digests(
    path: Path, size: int, block_bytes: int, blocks: Iterable[int]
) -> Iterable[tuple[int, str]]:
    """(block, xxh3-128 hex digest) of the given blocks of the file, ``size`` bytes long, read in 8 MiB
    pieces. A block the file ends in is hashed as far as it goes (so its digest differs)."""
    buffer = memoryview(bytearray(min(_READ_BYTES, max(size, 1))))
    with open(path, "rb", buffering=0) as handle:
        for block in blocks:
            start = block * block_bytes
            left = min(block_bytes, size - start)
            handle.seek(start)
            digest = xxhash.xxh3_128()
            while left > 0:
                got = handle.readinto(buffer[: min(left, len(buffer))])
                if not got:
                    break
                digest.update(buffer[:got])
                left -= got
            yield block, digest.hexdigest()


def split_files(info: dict) -> list[str]:
    """The four files of one split's manifest entry: codes .bin and .idx, soft-mask .bin and .idx."""
    return [
        f"{prefix}{ext}" for prefix in (info["prefix"], info["softmask_prefix"]) for ext in (".bin", ".idx")
    ]


def folder_files(manifest: dict) -> list[str]:
    """Every data file of a prepared folder, as its manifest lists them."""
    return [name for split in SPLITS for name in split_files(manifest["splits"][split])]


OUR_NAMES = {MANIFEST} | {
    f"{split}{kind}{ext}" for split in SPLITS for kind in ("", ".softmask") for ext in (".bin", ".idx")
}


def holds_only_prepared_files(folder: Path) -> bool:
    """Whether every entry of ``folder`` is a file a prepared folder has (so rebuilding it loses nothing)."""
    return all(entry.name in OUR_NAMES and entry.is_file() for entry in folder.iterdir())


def rebuild_command(manifest: dict | None, folder: Path | None = None) -> str:
    """The command that rebuilds the folder: the manifest's own ``genomelm data`` command with ``force=true``,
    writing to `folder` (the folder that was opened: a copied or moved one is rebuilt where it now is), or a
    pattern when it is unknown (a damaged manifest, or one written through the Python API). A command of the
    old `--flag` style keeps it."""
    command = manifest.get("command") if isinstance(manifest, dict) else None
    try:
        words = shlex.split(command) if isinstance(command, str) else []
    except ValueError:
        words = []
    if words[:2] != ["genomelm", "data"]:
        return UNKNOWN_COMMAND
    flags = any(word.startswith("--") for word in words)
    if folder is not None and _out_of(words) != Path(folder).resolve():
        words = _without_out(words) + (["--out", str(folder)] if flags else [f"out={folder}"])
        command = shlex.join(words)
    if any(word in ("--force", "force=true") for word in words):
        return command
    return f"{command} {'--force' if flags else 'force=true'}"


def _out_of(words: list[str]) -> Path | None:
    """The resolved output folder (`out=` or `--out`) of a ``genomelm data`` command's words; None when it
    has none."""
    for i, word in enumerate(words):
        if word == "--out" and i + 1 < len(words):
            return Path(words[i + 1]).resolve()
        for prefix in ("--out=", "out="):
            if word.startswith(prefix):
                return Path(word.removeprefix(prefix)).resolve()
    return None


def _without_out(words: list[str]) -> list[str]:
    kept: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word == "--out":
            skip = True
        elif not word.startswith(("--out=", "out=")):
            kept.append(word)
    return kept


def fix_for(manifest: dict | None, folder: Path | None = None) -> str:
    """How to repair a damaged folder (`folder`, as it was opened), as error messages end."""
    command = rebuild_command(manifest, folder)
    note = " (with the settings it was prepared with)" if command == UNKNOWN_COMMAND else ""
    return f"rebuild it: `{command}`{note}"


def _salvage_command(text: str) -> dict | None:
    """``{"command": ...}`` from the text of a manifest that is no longer valid JSON, if that line
    survived."""
    found = re.search(r'"command":\s*("(?:[^"\\\n]|\\.)*")', text)
    if found is None:
        return None
    try:
        return {"command": json.loads(found.group(1))}
    except json.JSONDecodeError:
        return None


def load_manifest(folder: str | Path) -> dict | None:
    """The manifest of a complete prepared folder, or None if it has none; DamagedFolder when it is not valid
    JSON or lacks what the readers need."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    text = path.read_bytes().decode("utf-8", errors="replace")
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as err:
        problem = f"not valid JSON ({err.msg}: line {err.lineno} column {err.colno})"
        raise DamagedFolder(path, problem, fix_for(_salvage_command(text), Path(folder))) from None
    problem = manifest_problem(manifest)
    if problem is not None:
        raise DamagedFolder(
            path, problem, fix_for(manifest if isinstance(manifest, dict) else None, Path(folder))
        )
    return manifest


def _missing(entry: dict, keys: dict[str, type], where: str) -> str | None:
    """What is wrong with ``entry`` (at dotted path ``where``): a key of ``keys`` missing, or of another
    type; None if nothing."""
    for key, kind in keys.items():
        if key not in entry:
            return f"no '{where}{key}' entry"
        value = entry[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            return f"'{where}{key}' is {type(value).__name__}, not {kind.__name__}"
    return None


def manifest_problem(manifest: object) -> str | None:
    """What makes ``manifest`` (parsed JSON) unusable to the readers, or None."""
    if not isinstance(manifest, dict):
        return f"holds a JSON {type(manifest).__name__}, not an object"
    top = {"format_version": int, "fingerprint": str, "seq_len": int, "vocab": dict, "splits": dict}
    problem = _missing(manifest, top, "")
    if problem is not None:
        return problem
    if manifest["format_version"] != FORMAT_VERSION:
        return f"format_version {manifest['format_version']}, but this genomelm reads {FORMAT_VERSION}"
    problem = _missing(manifest["vocab"], {"code_to_id": list, "vocab_size": int}, "vocab.")
    if problem is not None:
        return problem
    ids = manifest["vocab"]["code_to_id"]
    if len(ids) != len(CODE_NAMES) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return f"'vocab.code_to_id' is {ids!r}, not {len(CODE_NAMES)} token ids ({', '.join(CODE_NAMES)})"
    for split in SPLITS:
        if split not in manifest["splits"]:
            return f"no 'splits.{split}' entry"
        info = manifest["splits"][split]
        if not isinstance(info, dict):
            return f"'splits.{split}' is {type(info).__name__}, not dict"
        keys = {"prefix": str, "softmask_prefix": str, "windows": dict}
        problem = _missing(info, keys, f"splits.{split}.")
        if problem is not None:
            return problem
        columns = {"records": list, "record": list, "start": list, "end": list}
        problem = _missing(info["windows"], columns, f"splits.{split}.windows.")
        if problem is not None:
            return problem
        if len({len(info["windows"][key]) for key in ("record", "start", "end")}) != 1:
            return f"'splits.{split}.windows' columns record, start, end differ in length"
    if "checksums" in manifest:
        return _checksums_problem(manifest)
    return None


def _checksums_problem(manifest: dict) -> str | None:
    sums = manifest["checksums"]
    if not isinstance(sums, dict):
        return f"'checksums' is {type(sums).__name__}, not dict"
    problem = _missing(sums, {"hash": str, "block_bytes": int, "files": dict}, "checksums.")
    if problem is not None:
        return problem
    if sums["hash"] != HASH:
        return f"checksums by {sums['hash']!r}, which this genomelm does not know (it writes {HASH!r})"
    if sums["block_bytes"] <= 0:
        return f"'checksums.block_bytes' is {sums['block_bytes']}, not a positive size"
    for name in folder_files(manifest):
        entry = sums["files"].get(name)
        if not isinstance(entry, dict):
            return f"no 'checksums.files.{name}' entry"
        problem = _missing(entry, {"bytes": int, "blocks": list}, f"checksums.files.{name}.")
        if problem is not None:
            return problem
        if len(entry["blocks"]) != -(-entry["bytes"] // sums["block_bytes"]):
            count = len(entry["blocks"])
            return f"'checksums.files.{name}' has {count} block digests for {entry['bytes']:,} bytes"
    return None


class FolderCheck:
    """The files of one prepared folder checked against its (valid) manifest: presence and sizes, index
    agreement, and the checksum of each block, each block at most once per instance."""

    def __init__(self, folder: str | Path, manifest: dict) -> None:
        self.folder = Path(folder)
        self.manifest = manifest
        sums = manifest.get("checksums")
        self.files: dict[str, dict] | None = sums["files"] if sums else None
        self.block_bytes: int = sums["block_bytes"] if sums else HASH_BLOCK_BYTES
        self.fix = fix_for(manifest, self.folder)
        self._verified: dict[str, np.ndarray] = {}
        self.hashed_bytes = 0  # bytes read and hashed so far (for the benchmark)

    @property
    def has_checksums(self) -> bool:
        return self.files is not None

    def legacy_note(self) -> str:
        return (
            f"{self.folder / MANIFEST} has no checksums (prepared by an older genomelm), so changed bytes in "
            f"its .bin files go unnoticed; {self.fix.replace('rebuild it', 'rebuild it to add them')}"
        )

    def warn_if_legacy(self) -> None:
        if not self.has_checksums:
            warnings.warn(self.legacy_note(), stacklevel=3)

    def fail(self, name: str, problem: str) -> NoReturn:
        raise DamagedFolder(self.folder / name, problem, self.fix)

    def check_sizes(self, names: Iterable[str]) -> dict[str, int]:
        """Size of each file; DamagedFolder when one is missing or not the size the manifest records."""
        sizes = {}
        for name in names:
            try:
                size = (self.folder / name).stat().st_size
            except FileNotFoundError:
                self.fail(name, f"missing ({MANIFEST} lists it)")
            if self.files is not None:
                expected = self.files[name]["bytes"]
                if size != expected:
                    how = "truncated" if size < expected else "grown"
                    self.fail(name, f"{size:,} bytes, but {MANIFEST} records {expected:,} ({how})")
            sizes[name] = size
        return sizes

    def check_index(self, info: dict, seq_len: int, sizes: dict[str, int]) -> None:
        """Each .idx of the split holds the manifest's windows, all of SEQ tokens, and its .bin the bytes
        they need (a check that folders without checksums get too)."""
        windows = len(info["windows"]["start"])
        for prefix in (info["prefix"], info["softmask_prefix"]):
            idx, data = f"{prefix}.idx", f"{prefix}.bin"
            try:
                lengths = index_lengths(self.folder / idx)
            except ValueError as err:
                self.fail(idx, f"not a readable index ({err})")
            if len(lengths) != windows:
                self.fail(idx, f"indexes {len(lengths):,} windows, but {MANIFEST} lists {windows:,}")
            if len(lengths) and (lengths != seq_len).any():
                odd = int(np.flatnonzero(lengths != seq_len)[0])
                self.fail(idx, f"window {odd} has {int(lengths[odd]):,} tokens, not SEQ={seq_len:,}")
            needed = int(lengths.sum(dtype=np.int64))
            if sizes[data] != needed:
                how = "truncated" if sizes[data] < needed else "longer than its index"
                self.fail(data, f"{sizes[data]:,} bytes, but {idx} needs {needed:,} ({how})")

    def verify(self, name: str, start: int = 0, end: int | None = None) -> None:
        """Hash the blocks of ``name`` that bytes [start, end) touch and were not verified yet (all of the
        file by default); DamagedFolder naming the first block whose digest differs. No-op without
        checksums."""
        if self.files is None:
            return
        entry = self.files[name]
        size = entry["bytes"]
        end = size if end is None else min(end, size)
        if end <= start:
            return
        done = self._verified.get(name)
        if done is None:
            done = self._verified[name] = np.zeros(len(entry["blocks"]), dtype=bool)
        first, last = start // self.block_bytes, (end - 1) // self.block_bytes + 1
        todo = [block for block in range(first, last) if not done[block]]
        if not todo:
            return
        for block, digest in block_digests(self.folder / name, size, self.block_bytes, todo):
            lo = block * self.block_bytes
            hi = min(size, lo + self.block_bytes)
            self.hashed_bytes += hi - lo
            if digest != entry["blocks"][block]:
                self.fail(
                    name,
                    f"bytes {lo:,}-{hi:,} (block {block + 1} of {len(done)}) changed since `genomelm data` "
                    f"wrote them ({HASH} differs from {MANIFEST})",
                )
            done[block] = True

    def verify_folder(self) -> None:
        """Every file of every split: present, the recorded size, each block's checksum, the indexes agreeing
        with the manifest. What ``genomelm data`` checks before calling a folder up to date."""
        for split in SPLITS:
            info = self.manifest["splits"][split]
            names = split_files(info)
            sizes = self.check_sizes(names)
            for name in names:
                self.verify(name)
            self.check_index(info, int(self.manifest["seq_len"]), sizes)
