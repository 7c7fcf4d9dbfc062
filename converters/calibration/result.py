"""What calibration produces, for the convert and export stages."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from converters.calibration.amax import LayerAmax
    from converters.calibration.kv_cache import KvAmax

__all__ = ["CalibrationResult", "NO_TE_CHECK", "AMAX_SWING_THRESHOLD", "amax_swing", "amax_swing_line"]


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
    #: rounding family (a format's ``rounding_family``) -> on-disk weight key -> its file of GPTQ-rounded NVFP4 tensors
    #: in the staging's rounded-weights directory (converters.calibration.gptq_rounding), and the rounding's record
    #: for the report (empty: round to nearest)
    rounded_weights: dict[str, dict[str, str]] = field(default_factory=dict)
    rounding: dict[str, Any] = field(default_factory=dict)
    #: the recipe's nvfp4_smoothing, run before this calibration on the source it then read
    #: (converters.pipeline.source_smoothing): the report's block (empty: not asked)
    smoothing: dict[str, Any] = field(default_factory=dict)


#: A layer's input amax swings enough to matter when its largest step is at least this many times its median step:
#: a delayed scale taken from the history's largest amax then sits a power of two or more above the median step's own
#: (current) scale, a larger gap than the power-of-two rounding that block recipes accept for every block; below it,
#: delayed and current scaling cast that layer's typical step alike.
AMAX_SWING_THRESHOLD = 2.0
AMAX_SWING_REASON = (f"max/median >= {AMAX_SWING_THRESHOLD:g}: a scale fixed from the largest step (delayed scaling's "
                     "history max) is then a power of two or more too small for the median step, more than the "
                     "power-of-two rounding block recipes accept; current scaling re-scales each step and is not "
                     "affected")


def amax_swing(amax: Mapping[str, LayerAmax], *, stateless: bool,
               threshold: float = AMAX_SWING_THRESHOLD) -> dict[str, Any]:
    """How much each layer's input amax varies across calibration steps (the report's ``amax_swing`` block).

    Read from the amax the calibration recorded (input slot, steps where the layer ran): per layer
    ``max_over_median`` (None with no step), ``steps`` and ``matters`` (``max_over_median >= threshold``). Nothing
    is recomputed and the recorder is untouched. ``stateless`` says whether the job's recipe scales each step
    from the tensor itself (then the swing is why current scaling suits the layer better than delayed scaling would).
    """
    import torch

    layers: dict[str, dict[str, Any]] = {}
    for path, layer in amax.items():
        inputs = layer.forward[:, 0]
        ran = inputs[inputs > 0]
        if ran.numel() == 0:
            layers[path] = {"max_over_median": None, "steps": 0, "matters": False}
            continue
        # the lower median, as torch.median gives it: a value some step really had
        ratio = float(ran.max() / torch.median(ran))
        layers[path] = {"max_over_median": round(ratio, 4), "steps": int(ran.numel()), "matters": ratio >= threshold}
    return {"recipe_stateless": stateless, "threshold": threshold, "reason": AMAX_SWING_REASON, "slot": "input",
            "matters": [path for path, entry in layers.items() if entry["matters"]], "layers": layers}


def amax_swing_line(block: Mapping[str, Any] | None) -> str | None:
    """One summary line for the CLI: the layers whose amax swings enough to matter, the largest first."""
    if not block or not block.get("layers"):
        return None
    swinging = sorted(((entry["max_over_median"], path) for path, entry in block["layers"].items()
                       if entry["matters"]), reverse=True)
    scaling = "stateless recipe: each step is scaled by itself" if block["recipe_stateless"] else \
        "delayed scaling: these layers' typical steps lose range to the history's largest amax"
    if not swinging:
        return (f"amax swing: no layer's input amax varies by {block['threshold']:g}x or more across calibration "
                f"steps ({len(block['layers'])} layers)")
    shown = ", ".join(f"{path} {ratio:.2f}x" for ratio, path in swinging[:3])
    more = f" and {len(swinging) - 3} more" if len(swinging) > 3 else ""
    return (f"amax swing: {len(swinging)} of {len(block['layers'])} layers' input amax max/median >= "
            f"{block['threshold']:g} ({shown}{more}); {scaling}")
