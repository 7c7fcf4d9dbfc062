"""The old name of :mod:`converters.serving.selection` (``ServingPlan`` is now ``ServingSelection``, ``plan_serving``
``select_serving``) and :mod:`converters.serving.writer`, kept only because two test modules owned elsewhere still
import it (tests/converters/quality/smollm.py: ``plan_serving``; tests/converters/backends/test_registries.py:
``ServingFormat``). Remove this module once they import the new names; nothing in converters/ imports it.
"""

from __future__ import annotations

from converters.serving.selection import ServingFormat
from converters.serving.selection import select_serving as plan_serving

__all__ = ["ServingFormat", "plan_serving"]
