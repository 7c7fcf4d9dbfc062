"""torchao training artifacts: the source's weights plus the conversion to replay.

torchao scales dynamically (no amax history), so the artifact carries no FP8 state: config.json's ``fp8``
block holds the ``Float8LinearConfig`` and the converted layers, and :meth:`load` swaps exactly those. MoE
experts GEMMs (``converted_experts``) get torchao's FP8 grouped GEMM (``Float8TrainingOpConfig``, rowwise;
``fp8.experts_config``) where it runs: CUDA with triton (see :mod:`converters.backends.torchao_experts`);
elsewhere the loaded experts stay in high precision and ``model.fp8_experts`` says so.
In layer-sequential mode the swaps run on the meta-device model, which checks that every eligible layer
converts without holding any weight.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from converters.pipeline import _Run

__all__ = ["TorchAOTraining", "TORCHAO"]


class TorchAOTraining:
    name = "ao"

    def layer_check(self, run: _Run) -> None:
        return None

    def convert(self, run: _Run, eligible: list[str]) -> None:
        from converters.analysis import converted_expert_gemms
        from converters.backends.torchao import convert_to_torchao
        from converters.backends.torchao_experts import convert_experts_to_torchao, experts_config_from_dict

        model = run.model if run.model is not None else run.meta_model
        run.converted = convert_to_torchao(model, eligible, run.recipe.to_float8_linear_config())
        gemms = converted_expert_gemms(run.report)
        if gemms:  # a check that the recorded experts config applies to exactly these weights
            convert_experts_to_torchao(model, gemms, experts_config_from_dict(_experts_fields(model, gemms)))

    def state_tensors(self, run: _Run) -> dict[str, Any]:
        return {}

    def block_fields(self, run: _Run) -> dict[str, Any]:
        from converters.analysis import converted_expert_gemms

        fields: dict[str, Any] = {"float8_linear_config": run.recipe.float8_config_dict()}
        gemms = converted_expert_gemms(run.report)
        if gemms:
            fields["experts_config"] = _experts_fields(run.model if run.model is not None else run.meta_model, gemms)
        return fields

    def library_versions(self) -> dict[str, str]:
        from converters.backends.torchao import torchao_version

        return {"torchao": torchao_version()}

    def load(self, directory: Path, *, device: str) -> Any:
        from converters.artifact_loaders import read_fp8_block
        from converters.backends.torchao import convert_to_torchao
        from converters.backends.torchao_experts import load_experts
        from converters.float8_config import float8_linear_config_from_dict
        from converters.model_sources import ModelSourceOptions, load_model

        block = read_fp8_block(directory, self.name)
        float8_config = float8_linear_config_from_dict(block["float8_linear_config"])
        model = load_model(directory, ModelSourceOptions(allowed_roots=(directory,)))
        convert_to_torchao(model, block["converted_modules"], float8_config)
        model.to(device)
        model.fp8_experts = load_experts(model, block.get("converted_experts", []), block.get("experts_config"),
                                         device=device, linear_emulate=float8_config.emulate)
        model.train()
        return model


def _experts_fields(model: nn.Module, gemms: list[str]) -> dict[str, Any]:
    from converters.backends.torchao_experts import experts_config_fields

    param = model.get_parameter(gemms[0])
    return experts_config_fields(getattr(param, "dtype", None))


TORCHAO = TorchAOTraining()
