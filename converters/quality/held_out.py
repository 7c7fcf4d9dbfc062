"""The held-out part of the built-in corpus: the texts quality is measured on when a request gives none.

Calibration reads the rest (:func:`calibration_part`), so the two never share a paragraph: quality measured on
the texts the scales were fitted to would flatter them.
"""

from __future__ import annotations

from converters.calibration.batches import load_corpus

__all__ = ["HELD_OUT_EVERY", "held_out_part", "calibration_part", "BUILT_IN_HELD_OUT", "REQUEST_TEXTS"]

#: every HELD_OUT_EVERY-th paragraph of the corpus (counting from 0, the last of each run) is held out
HELD_OUT_EVERY = 4
BUILT_IN_HELD_OUT = "built-in held-out part"
REQUEST_TEXTS = "request"


def _held_out(index: int) -> bool:
    return index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


def held_out_part() -> list[str]:
    """The corpus paragraphs quality is measured on (a quarter, spread over the corpus' kinds of text)."""
    return [text for index, text in enumerate(load_corpus()) if _held_out(index)]


def calibration_part() -> list[str]:
    """The corpus paragraphs calibration reads when a request gives no texts: all but :func:`held_out_part`."""
    return [text for index, text in enumerate(load_corpus()) if not _held_out(index)]
