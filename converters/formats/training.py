"""The protocol of a training output format: the artifact a recipe's backend (TE, torchao) is loaded from.

A format decides how the report's eligible layers are converted (and checked), which FP8 state it stores
in ``fp8_state.safetensors``, what it adds to config.json's ``fp8`` block and to the report's library
versions, and how the artifact loads back. The pipeline asks :func:`converters.formats.training_format`
for the recipe's backend and never tests the backend's name itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from converters.pipeline import _Run
    from converters.sequential import LayerPass

__all__ = ["TrainingFormat"]


class TrainingFormat(Protocol):
    name: str  #: the recipe backend it serves: ``te`` or ``ao``

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
        """The model of a verified artifact directory, converted as recorded (see converters.artifact_loaders)."""
