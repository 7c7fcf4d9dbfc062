"""What calibration produces, for the convert and export stages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from converters.calibration.amax import LayerAmax
    from converters.calibration.kv_cache import KvAmax

__all__ = ["CalibrationResult", "NO_TE_CHECK"]


#: the TE check block of a job where no TE check ran during calibration
NO_TE_CHECK: dict[str, Any] = {"ran": False, "reason": "TransformerEngine not used here"}


@dataclass(frozen=True)
class CalibrationResult:
    """What the calibrate stage produced, for the convert and export stages (made once, by that stage)."""

    data_source: str = ""
    amax: dict[str, LayerAmax] = field(default_factory=dict)  #: layer path -> amax per step
    states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  #: layer path -> scaling state
    check_batch: dict[str, Any] | None = None  #: the first calibration batch, for the whole-model TE check
    #: the per-layer TE check of layer-sequential calibration; the conversion's own check replaces it (Converted)
    te_check: dict[str, Any] = field(default_factory=lambda: dict(NO_TE_CHECK))
    #: attention module path -> its keys' and values' amax, recorded in the same pass when the request asks kv_cache
    kv_amax: dict[str, KvAmax] = field(default_factory=dict)
    #: serving format -> layer path -> its weight/input/output SQNR under the format's casts (measured with the
    #: job's recipe, in the same pass)
    serving_sqnr: dict[str, dict[str, dict[str, float | None]]] = field(default_factory=dict)
    #: layer-sequential mode: the dtype the forwards ran in and why, prefetch, seconds (SequentialStats.to_dict)
    forward: dict[str, Any] = field(default_factory=dict)
