"""Where the files that ship with genomelm live: `configs/` (model presets, data, run and cluster configs) and
the bundled demo genome `data/dmel_chr4.fa.gz`.

In a source checkout (and an editable install) they are the repository's own `configs/` and `data/`, the one
source of truth; a wheel installs copies of them under `<prefix>/share/genomelm/` (pyproject.toml's
`data-files`), found here through `sysconfig`. Imported by `genomelm.data` and `genomelm.model`, so it
imports nothing of genomelm.
"""

from __future__ import annotations

import site
import sys
import sysconfig
from functools import cache
from pathlib import Path

SHARE = Path("share") / "genomelm"


def _candidates() -> list[Path]:
    prefixes = [sysconfig.get_path("data"), sys.prefix, site.getuserbase()]
    return [Path(__file__).resolve().parents[1], *(Path(prefix) / SHARE for prefix in prefixes)]


@cache
def root() -> Path:
    """The folder holding `configs/` (and `data/`): the source checkout's, else the installed copy's."""
    for folder in _candidates():
        if (folder / "configs" / "model").is_dir():
            return folder
    return _candidates()[0]  # nothing found: errors name the checkout's path


def shipped(path: str | Path) -> Path:
    """`path` as given when it exists (relative to the working directory) or is absolute, else the shipped
    file of that relative path (`configs/train/demo.yaml`, `data/dmel_chr4.fa.gz`) when there is one, else
    `path` as given (its reader then reports it missing)."""
    path = Path(path)
    if path.exists() or path.is_absolute():
        return path
    candidate = root() / path
    return candidate if candidate.exists() else path


def is_shipped(path: str | Path, folder: str | Path = "configs") -> bool:
    """Whether `path`, found as `shipped` finds it, is one of genomelm's own files under `folder` (a shipped
    config, whose relative paths name shipped files too), not a user's file."""
    return shipped(path).resolve().is_relative_to((root() / folder).resolve())
