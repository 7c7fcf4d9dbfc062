"""Training artifact -> serving export, bit-identical to the training casts: ``sync_serving`` and the twin table.

Public surface: ``sync_serving``, ``SYNC_REPORT_NAME``, ``TrainingTwin``, ``training_twin``, ``twin_report``.
"""

from __future__ import annotations

from converters.sync.driver import SYNC_REPORT_NAME, sync_serving
from converters.sync.twins import TrainingTwin, training_twin, twin_report

__all__ = ["SYNC_REPORT_NAME", "TrainingTwin", "sync_serving", "training_twin", "twin_report"]
