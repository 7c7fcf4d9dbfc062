"""Messages of the conversion library in the command line's words: flags instead of request fields.

The library names the request field at fault (``calibration.steps``, ``include[0]``), which is what an API
caller sent; a CLI user typed a flag, so the CLI rewrites each field name it has a flag for.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["FIELD_FLAGS", "in_cli_words", "error_in_cli_words", "local_directory_hint"]

#: Request field (as the library's messages write it) -> the flag that sets it.
FIELD_FLAGS = {
    "calibration.steps": "--calib-steps",
    "calibration.batch_size": "--calib-batch-size",
    "calibration.seq_len": "--calib-seq-len",
    "calibration.texts": "--calib-texts",
    "calibration.backward": "--calib-backward",
    "include/exclude": "--include/--exclude",
    "include": "--include",
    "exclude": "--exclude",
    "serving_formats": "--serving",
    "kv_cache": "--kv-cache",
    "skip_first_last": "--no-skip-first-last",
    "convert_router_gates": "--convert-router-gates",
    "trust_remote_code": "--trust-remote-code",
}

# A field is a whole token: not part of a longer name, a path or a flag; an index ("include[0]") goes too.
_FIELD = re.compile(
    r"(?<![\w.\-/`'])(" + "|".join(re.escape(name) for name in FIELD_FLAGS) + r")(?:\[\d+\])?(?![\w\-/])"
)


def in_cli_words(message: str) -> str:
    """``message`` with every request field that has a flag replaced by the flag."""
    return _FIELD.sub(lambda match: FIELD_FLAGS[match.group(1)], message)


def error_in_cli_words(message: str, field: str | None) -> str:
    """An error message in CLI words, led by the flag of the field at fault when the text does not name it."""
    text = in_cli_words(message)
    flag = FIELD_FLAGS.get(re.sub(r"\[\d+\]$", "", field or ""))
    return text if flag is None or flag in text else f"{flag}: {text}"


def local_directory_hint(reference: str | None) -> str | None:
    """How to write ``reference`` when the library read it as a hub id (or refused it) but it names a directory
    below the current one: ``models/llama`` is a hub id to the library, ``./models/llama`` a local path.

    None when the reference is already written as a local path or names no directory here.
    """
    if not isinstance(reference, str) or not reference.strip() or reference.startswith(("/", "./", "~")):
        return None
    for candidate in dict.fromkeys((reference, reference.partition("@")[0])):  # "@" may be part of the name
        if candidate and Path(candidate).is_dir():
            return (f"./{candidate} is a directory here: write ./{candidate} to use it (a reference that is not "
                    "absolute and does not start with ./ is read as a hub id)")
    return None
