"""Cached, checksummed, resumable downloads of UCSC chromosome files (e.g. hg38 chr1.fa.gz)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from genomelm.data.errors import DataError

UCSC_HG38 = "https://hgdownload.soe.ucsc.edu/goldenPath/hg38/chromosomes/"
CHECKSUMS = "md5sum.txt"
_CHUNK = 1 << 20
_TIMEOUT_S = 60


def md5_of(path: Path) -> str:
    """Hex MD5 of a file, read in 1 MiB blocks."""
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _offline_error(url: str, err: Exception, cache: Path, names: list[str]) -> DataError:
    files = ", ".join([CHECKSUMS, *names])
    return DataError(
        f"cannot download {url} ({err}). Without network, download these files by hand from "
        f"{url.rsplit('/', 1)[0]}/ and put them in {cache}/: {files}; then re-run the same command"
    )


def _download(url: str, dest: Path, cache: Path, names: list[str], progress: bool) -> None:
    """Download ``url`` into ``dest + '.part'``, resuming it with an HTTP Range request if present."""
    import urllib.error  # imported here: ~30 ms that a run on cached or local files never needs
    import urllib.request

    from tqdm import tqdm

    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=_TIMEOUT_S)
    except urllib.error.HTTPError as err:
        if err.code == 416 and have:  # the partial file is already whole
            part.replace(dest)
            return
        raise _offline_error(url, err, cache, names) from err
    except (urllib.error.URLError, OSError) as err:
        raise _offline_error(url, err, cache, names) from err
    with response:
        resumed = response.status == 206
        if not resumed:
            have = 0
        length = response.headers.get("Content-Length")
        total = have + int(length) if length is not None else None
        with (
            open(part, "ab" if resumed else "wb") as out,
            tqdm(
                total=total, initial=have, unit="B", unit_scale=True, desc=dest.name, disable=not progress
            ) as bar,
        ):
            try:
                while block := response.read(_CHUNK):
                    out.write(block)
                    bar.update(len(block))
            except OSError as err:
                raise _offline_error(url, err, cache, names) from err
    part.replace(dest)


def _read_checksums(path: Path) -> dict[str, str]:
    sums: dict[str, str] = {}
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) == 2:
            sums[fields[1].lstrip("*")] = fields[0].lower()
    return sums


def expected_md5(cache: str | Path, name: str) -> str:
    """The md5 that ``cache``/md5sum.txt (as fetched by :func:`fetch`) gives for ``name``."""
    return _read_checksums(Path(cache) / CHECKSUMS)[name]


def check_md5(path: Path, actual: str, expected: str) -> None:
    """Raise DataError (after renaming ``path`` to ``.bad``) unless ``actual`` == ``expected``."""
    if actual != expected:
        bad = path.with_name(path.name + ".bad")
        os.replace(path, bad)
        raise DataError(
            f"{path}: checksum mismatch (md5 {actual}, {path.parent / CHECKSUMS} says {expected}); it was "
            f"moved to {bad.name}; re-run to download it again (or put a good copy at {path})"
        )


def fetch(
    base_url: str, names: list[str], cache: str | Path, progress: bool = True, verify_cached: bool = True
) -> list[Path]:
    """Paths of ``names`` in ``cache``, downloaded from ``base_url`` if missing and checked against its
    md5sum.txt.

    A file only gets its final name once it is complete; a ``.part`` file is resumed on the next call.
    Raises DataError on a checksum mismatch (the bad file is renamed to ``.bad``) or when offline (says where
    to put the files by hand). With ``verify_cached=False`` a file that was already in the cache is not read
    here: the caller checks it with :func:`check_md5` against :func:`expected_md5` (``genomelm data`` does so
    with the md5 it computes while streaming the file, which saves a whole pass over it).
    """
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    base = base_url if base_url.endswith("/") else base_url + "/"
    sums_path = cache / CHECKSUMS
    if not sums_path.exists():
        _download(base + CHECKSUMS, sums_path, cache, names, progress)
    sums = _read_checksums(sums_path)
    paths = []
    for name in names:
        if name not in sums:
            raise DataError(f"{sums_path}: no checksum for {name}; delete {sums_path} to fetch it again")
        dest = cache / name
        downloaded = not dest.exists()
        if downloaded:
            _download(base + name, dest, cache, names, progress)
        if downloaded or verify_cached:
            check_md5(dest, md5_of(dest), sums[name])
        paths.append(dest)
    return paths
