"""The checks every settings group of the run configuration (`genomelm.run.config`) runs on its values."""

from __future__ import annotations

from typing import Any


def require(ok: bool, message: str) -> None:
    """A setting's check: ValueError(message), which names the setting and what to give, unless `ok`."""
    if not ok:
        raise ValueError(message)


def check_choice(name: str, value: Any, choices: tuple) -> None:
    require(value in choices, f"{name} must be one of {', '.join(map(str, choices))}, not {value!r}")
