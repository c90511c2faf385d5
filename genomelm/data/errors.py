"""The one error type of the data stage: a message that names the file and the fix."""

from __future__ import annotations


class DataError(Exception):
    """Bad input or settings for ``genomelm data``; the message says which file and how to fix it."""
