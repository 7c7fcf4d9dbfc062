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
from typing import Any

from converters.errors import Fp8ForgeError, RequestError

__all__ = ["PatternError", "PATTERN_REGEX", "MAX_PATTERN_CHARS", "MAX_PATTERNS", "validate_pattern", "matches",
           "check_patterns"]

#: One segment: letters, digits and ``_ - * ? [ ] !``; segments joined by single dots. Written so that
#: Python's ``re``, the Rust regex of pydantic and ECMAScript (the OpenAPI schema's readers) agree on it.
PATTERN_REGEX = r"^[A-Za-z0-9_*?\[\]!-]+(\.[A-Za-z0-9_*?\[\]!-]+)*$"
#: Longer than any real module path glob; it bounds the work of matching against every Linear of a model.
MAX_PATTERN_CHARS = 128
#: Patterns in ``include`` and in ``exclude`` each (every one is matched against every Linear of the model).
MAX_PATTERNS = 64

_PATTERN = re.compile(PATTERN_REGEX)


class PatternError(Fp8ForgeError):
    """An include/exclude pattern is malformed."""

    code = "invalid_pattern"


def validate_pattern(pattern: str, *, field: str) -> str:
    """Return the pattern if it is usable, else raise :class:`PatternError` naming ``field``."""
    if not isinstance(pattern, str) or not pattern:
        raise PatternError(f"{field}: a pattern must be a non-empty string like 'layers.0' or '*.mlp.*'", field=field)
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(f"{field}: a pattern may have at most {MAX_PATTERN_CHARS} characters", field=field)
    # fullmatch: `$` alone would let a trailing newline through
    if not _PATTERN.fullmatch(pattern):
        raise PatternError(
            f"{field}: pattern {pattern!r} is not a dotted module path glob (letters, digits, _, -, *, ?, [], "
            "segments separated by single dots)",
            field=field,
        )
    return pattern


def matches(pattern: str, path: str) -> bool:
    """True when ``pattern`` matches a contiguous run of whole segments of ``path``."""
    segments = _collapse(pattern.split("."))
    parts = path.split(".")
    if sum(segment != "**" for segment in segments) > len(parts):
        return False  # each other segment consumes one path segment
    return _match_anywhere(segments, parts)


def _collapse(segments: list[str]) -> list[str]:
    # `**.**` means what `**` means; collapsing keeps the table below small
    return [s for i, s in enumerate(segments) if not (s == "**" and i and segments[i - 1] == "**")]


def _match_anywhere(pattern: list[str], path: list[str]) -> bool:
    # ok[j]: pattern[i:] matches a run of segments starting at path[j], filled from the last pattern segment
    # back. A table instead of recursion: `**` segments would otherwise try every split of the path.
    n = len(path)
    ok = [True] * (n + 1)
    for segment in reversed(pattern):
        if segment == "**":
            nxt = [False] * (n + 1)
            seen = False
            for j in range(n, -1, -1):
                seen = seen or ok[j]
                nxt[j] = seen
        else:
            nxt = [j < n and ok[j + 1] and fnmatchcase(path[j], segment) for j in range(n + 1)]
        ok = nxt
    return any(ok)


def check_patterns(patterns: Any, name: str) -> tuple[str, ...]:
    """``include`` or ``exclude`` as a tuple of valid patterns; RequestError / PatternError naming the culprit."""
    if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)):
        raise RequestError(f"{name} must be a list of patterns", field=name)
    if len(patterns) > MAX_PATTERNS:
        raise RequestError(f"{name} may hold at most {MAX_PATTERNS} patterns, got {len(patterns)}", field=name)
    for index, pattern in enumerate(patterns):
        validate_pattern(pattern, field=f"{name}[{index}]")
    return tuple(patterns)
