"""The Backend protocol: the library a recipe runs on (TE, torchao) and the training artifact it is loaded from.

A backend checks first that this worker's GPU can run the recipe (``preflight``; a CPU worker writes the artifact
with a warning), then decides how the report's eligible layers are converted (and checked), which FP8 state it
stores in ``fp8_state.safetensors`` (only TE delayed scaling has any), what it adds to config.json's ``fp8``
block and to the report's library versions, and how the artifact loads back. The pipeline asks
:func:`converters.backends.backend_for` for the recipe's backend and never tests the backend's name itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from converters.calibration.sequential import LayerPass
    from converters.pipeline.driver import _Run

__all__ = ["Backend", "check_shape_rule"]


class Backend(Protocol):
    name: str  #: the recipe backend it serves: ``te`` or ``ao``
    recipe_types: tuple[type, ...]  #: the recipe classes it runs

    def preflight(self, run: _Run) -> None:
        """Raise BackendUnavailableError when this CUDA GPU cannot run ``run.recipe`` (before any work)."""

    def layer_check(self, run: _Run) -> Callable[[LayerPass], None] | None:
        """A callback that checks each layer right after its layer-sequential calibration, or None."""

    def convert(self, run: _Run, eligible: list[str]) -> None:
        """Convert (or record) the eligible layers: sets ``run.converted``, ``run.te_modules``, warnings."""

    def state_tensors(self, run: _Run) -> dict[str, torch.Tensor]:
        """The FP8 state stored in ``fp8_state.safetensors`` (empty: no state file)."""

    def block_fields(self, run: _Run) -> dict[str, Any]:
        """What this format adds to config.json's ``fp8`` block."""

    def library_versions(self) -> dict[str, str]:
        """Versions of the libraries this format's artifact was written for (for the report)."""

    def load(self, directory: Path, *, device: str) -> Any:
        """The model of a verified artifact directory, converted as recorded (see converters.backends.loaders)."""


def check_shape_rule(run: _Run) -> None:
    """Refuse a report whose eligible layers break the recipe's shape rule (an analysis run without the recipe).

    Conversion follows the report and never filters again; this only makes sure the report was built for this
    recipe. Raises ConversionError naming a layer, the rule and the fix.
    """
    from converters.errors import ConversionError

    if run.report is None:
        return
    rule = run.recipe.shape_rule()
    bad = [layer["path"] for layer in run.report["layers"]
           if layer["eligible"] and rule.fails(layer["in_features"], layer["out_features"])]
    if bad:
        raise ConversionError(f"{len(bad)} layers the analysis called eligible break {run.recipe.library_class}'s "
                              f"shape rule ({rule.describe()}), e.g. {bad[0]}: the analysis ran without the recipe; "
                              "analyze with AnalysisOptions(recipe=...)")
