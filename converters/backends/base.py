"""The Backend protocol: the library a recipe runs on (TE, torchao) and the training artifact it is loaded from.

A backend checks first that this worker's GPU can run the recipe (``preflight``, once per job; a CPU worker writes
the artifact with a warning), then converts the report's eligible layers (and checks them where it can), says
which FP8 state it stores in ``fp8_state.safetensors`` (only TE delayed scaling has any), what it adds to
config.json's ``fp8`` block and to the report's library versions, and how the artifact loads back. Its inputs are
the records below, never the pipeline's run state. The pipeline asks :func:`converters.backends.backend_for` for
the recipe's backend and never tests the backend's name itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from converters.calibration.result import CalibrationResult
    from converters.calibration.sequential import LayerPass
    from converters.recipes import Recipe

__all__ = ["Backend", "ConversionTargets", "Converted", "LayerCheck"]


@dataclass(frozen=True, kw_only=True)
class ConversionTargets:
    """What to convert: the recipe, the model, the report's eligible layers."""

    recipe: Recipe
    model: nn.Module  #: the loaded model (whole-model mode) or the meta-device model (layer-sequential mode)
    whole_model: bool  #: the model holds its weights (whole-model mode)
    eligible: tuple[str, ...]  #: module paths of the Linears the report calls eligible
    report: dict[str, Any]  #: the analysis report
    te_extra_state: bool = False  #: also write TE's own ``_extra_state`` (the request's option)


@dataclass(frozen=True, kw_only=True)
class Converted:
    """What a backend's conversion did."""

    modules: list[str]  #: the converted module paths
    te_modules_built: bool = False  #: TE modules were built and checked here (TE only)
    te_check: dict[str, Any] | None = None  #: the TE check's summary, where the conversion ran or skipped it
    warnings: list[str] = field(default_factory=list)


class LayerCheck(NamedTuple):
    """How a backend checks each layer right after its layer-sequential calibration."""

    after_layer: Callable[[LayerPass], None] | None  #: called per layer; ``summary()`` gives the te_check block
    te_check: dict[str, Any] | None = None  #: why nothing is checked, where the backend knows it now


class Backend(Protocol):
    name: str  #: the recipe backend it serves: ``te`` or ``ao``
    recipe_types: tuple[type, ...]  #: the recipe classes it runs

    def preflight(self, recipe: Recipe) -> list[str]:
        """Raise BackendUnavailableError when this CUDA GPU cannot run ``recipe`` (before any work); warnings."""

    def layer_check(self, recipe: Recipe) -> LayerCheck:
        """The per-layer check of the layer-sequential calibration, if any."""

    def convert(self, targets: ConversionTargets, calibration: CalibrationResult) -> Converted:
        """Convert (or record) the eligible layers."""

    def state_tensors(self, targets: ConversionTargets, converted: Converted,
                      calibration: CalibrationResult) -> dict[str, torch.Tensor]:
        """The FP8 state stored in ``fp8_state.safetensors`` (empty: no state file)."""

    def block_fields(self, targets: ConversionTargets, converted: Converted) -> dict[str, Any]:
        """What this backend adds to config.json's ``fp8`` block."""

    def library_versions(self) -> dict[str, str]:
        """Versions of the libraries this backend's artifact was written for (for the report)."""

    def load(self, directory: Path, *, device: str) -> Any:
        """The model of a verified artifact directory, converted as recorded (see converters.backends.loaders)."""
