"""Server paths out of client messages.

A library error names the files it could not read (``cannot read config.json in /srv/fp8forge/hf-cache/...``);
a client must learn what was wrong, not the server's directory layout. Each server directory (the data
directory, the hub cache) is replaced by a placeholder wherever it appears in a message that leaves the
server. Paths below the allowed model roots stay: the client wrote them in its own request.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["server_directories", "without_server_paths"]


def server_directories(*, data_dir: Path, cache_dir: Path | None,
                       key_file: Path | None = None) -> list[tuple[str, str]]:
    """``(path, placeholder)`` pairs for :func:`without_server_paths`: the data directory, the hub cache (the
    configured one, else huggingface_hub's default) and the key file, each as given and as resolved."""
    if cache_dir is None:
        from huggingface_hub import constants

        cache_dir = Path(constants.HF_HUB_CACHE)
    named = [(data_dir, "<data dir>"), (cache_dir, "<hub cache>")] + ([(key_file, "<key file>")] if key_file else [])
    pairs = set()
    for path, placeholder in named:
        for form in (os.path.expanduser(path), os.path.realpath(os.path.expanduser(path))):
            if len(form) > 1:  # never replace "/" itself
                pairs.add((form.rstrip("/"), placeholder))
    return sorted(pairs, key=lambda pair: -len(pair[0]))  # longest first: a cache inside the data dir stays named


def without_server_paths(message: str, directories: Iterable[tuple[str, str]]) -> str:
    """``message`` with every server directory replaced by its placeholder."""
    for path, placeholder in directories:
        message = message.replace(path, placeholder)
    return message
