"""What calibration produces, for the convert and export stages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from converters.calibration.amax import LayerAmax

__all__ = ["CalibrationResult"]


@dataclass
class CalibrationResult:
    """What the calibrate stage produced (and the TE check added), for the convert and export stages."""

    data_source: str = ""
    amax: dict[str, LayerAmax] = field(default_factory=dict)  #: layer path -> amax per step
    states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  #: layer path -> scaling state
    check_batch: dict[str, Any] | None = None  #: the first calibration batch, for the whole-model TE check
    te_check: dict[str, Any] = field(
        default_factory=lambda: {"ran": False, "reason": "TransformerEngine not used here"})
