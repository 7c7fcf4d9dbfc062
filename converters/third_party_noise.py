"""Known start-up and deprecation messages of the libraries fp8forge builds on, silenced at their source.

Each entry names the one logger that emits a known message and a regular expression for that message;
nothing else is filtered, so any other warning of the same library (or a changed wording of this one)
still shows. Call :func:`silence_third_party_noise` before torch, torchao or transformers is imported.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["silence_third_party_noise", "KNOWN_NOISE", "transformers_progress_off"]

#: (logger name, message pattern): what each library logs on every run that says nothing to a user.
KNOWN_NOISE = (
    # torchao's kernels are CUDA builds for another Python; fp8forge never calls them (see below).
    ("torchao", r"^Skipping import of cpp extensions due to TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1$"),
    # Only torchao's int8 matmul kernels need Triton; fp8forge uses none of them.
    ("torchao.kernel.intmm", r"^Warning: Detected no triton, on systems without Triton certain kernels"),
    # torchao 0.18 registers its enums as pytree constants, which torch 2.13 deprecates.
    ("torch.utils._pytree", r"is an Enum subclass and is now natively supported by torch\.compile"),
)


class _DropMessage(logging.Filter):
    """Drops the records of one logger whose message matches ``pattern``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def silence_third_party_noise() -> None:
    """Filter the messages in :data:`KNOWN_NOISE` and keep torchao from loading its compiled kernels.

    torchao loads its ``_C*.so`` kernels on import unless ``TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1``;
    the wheel's kernels are CUDA builds for one Python version, they fail to load (one warning each)
    elsewhere, and Float8Linear does not use them. An explicit value in the environment is kept.
    Calling this twice adds nothing.
    """
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    for name, pattern in KNOWN_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropMessage(pattern))


@contextmanager
def transformers_progress_off() -> Iterator[None]:
    """No transformers progress bars ("Loading weights", "Writing model shards") inside the block: the
    pipeline reports its own progress, and a CLI user sees only fp8forge's lines."""
    from transformers.utils import logging as hf_logging  # transformers: imported only where a model loads

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
