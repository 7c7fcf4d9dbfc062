"""torchao ``Float8Linear`` training artifacts: the source's weights plus the conversion to replay.

torchao scales dynamically (no amax history), so the artifact carries no FP8 state: config.json's ``fp8``
block holds the ``Float8LinearConfig`` and the converted layers, and :meth:`load` swaps exactly those.
In layer-sequential mode the swap runs on the meta-device model, which checks that every eligible layer
converts without holding any weight.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from converters.pipeline import _Run

__all__ = ["TorchAOTraining", "TORCHAO"]


class TorchAOTraining:
    name = "ao"

    def layer_check(self, run: _Run) -> None:
        return None

    def convert(self, run: _Run, eligible: list[str]) -> None:
        from converters.backends.torchao import convert_to_torchao

        model = run.model if run.model is not None else run.meta_model
        run.converted = convert_to_torchao(model, eligible, run.recipe.to_float8_linear_config())

    def state_tensors(self, run: _Run) -> dict[str, Any]:
        return {}

    def block_fields(self, run: _Run) -> dict[str, Any]:
        return {"float8_linear_config": run.recipe.float8_config_dict()}

    def library_versions(self) -> dict[str, str]:
        from converters.backends.torchao import torchao_version

        return {"torchao": torchao_version()}

    def load(self, directory: Path, *, device: str) -> Any:
        from converters.artifact_loaders import read_fp8_block
        from converters.backends.torchao import convert_to_torchao
        from converters.float8_config import float8_linear_config_from_dict
        from converters.model_sources import ModelSourceOptions, load_model

        block = read_fp8_block(directory, self.name)
        float8_config = float8_linear_config_from_dict(block["float8_linear_config"])
        model = load_model(directory, ModelSourceOptions(allowed_roots=(directory,)))
        convert_to_torchao(model, block["converted_modules"], float8_config)
        model.to(device)
        model.train()
        return model


TORCHAO = TorchAOTraining()
