"""Module-path patterns that match whole dotted segments.

A pattern is a dotted glob. Each pattern segment is matched with ``fnmatch`` against one path segment,
and the pattern must match a contiguous run of the path's segments. ``**`` stands for any number of
segments (including none). So ``layers.2`` matches ``model.layers.2.mlp.up_proj`` but never
``model.layers.20.mlp.up_proj``; ``q_proj`` matches every ``...q_proj``; ``layers.1*.mlp`` matches
layers 1 and 10-19.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase

from converters.errors import Fp8ForgeError

__all__ = ["PatternError", "validate_pattern", "matches"]

_ALLOWED = re.compile(r"^[A-Za-z0-9_*?\[\]!.-]+$")


class PatternError(Fp8ForgeError):
    """An include/exclude pattern is malformed."""

    code = "invalid_pattern"


def validate_pattern(pattern: str, *, field: str) -> str:
    """Return the pattern if it is usable, else raise :class:`PatternError` naming ``field``."""
    if not isinstance(pattern, str) or not pattern.strip():
        raise PatternError(f"{field}: a pattern must be a non-empty string like 'layers.0' or '*.mlp.*'", field=field)
    if not _ALLOWED.match(pattern) or "" in pattern.split("."):
        raise PatternError(
            f"{field}: pattern {pattern!r} is not a dotted module path glob (letters, digits, _, -, *, ?, [], "
            "segments separated by single dots)",
            field=field,
        )
    return pattern


def matches(pattern: str, path: str) -> bool:
    """True when ``pattern`` matches a contiguous run of whole segments of ``path``."""
    return _match_anywhere(pattern.split("."), path.split("."))


def _match_anywhere(pattern: list[str], path: list[str]) -> bool:
    return any(_match_prefix(pattern, path[start:]) for start in range(len(path) + 1))


def _match_prefix(pattern: list[str], path: list[str]) -> bool:
    if not pattern:
        return True
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match_prefix(rest, path[skip:]) for skip in range(len(path) + 1))
    return bool(path) and fnmatchcase(path[0], head) and _match_prefix(rest, path[1:])
