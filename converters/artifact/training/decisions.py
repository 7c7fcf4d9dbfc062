"""What a training artifact decided, read back from its files: the recipe, and for every Linear whether it trains in
FP8 and, if not, why. Every framework config beside the artifact is written from this one record.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converters.artifact.layout import REPORT_FILE, read_fp8_block
from converters.errors import ArtifactError
from converters.recipes import Recipe, recipe_from_dict

__all__ = ["LinearDecision", "TrainingDecisions", "read_training_decisions", "block_index"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, kw_only=True)
class LinearDecision:
    """One Linear of the model, in module order."""

    path: str  #: the module path in the loaded Hugging Face model
    in_features: int
    out_features: int
    fp8: bool  #: the artifact converts it (``fp8.converted_modules``)
    reasons: tuple[str, ...]  #: why the analysis kept it in high precision (empty when eligible)


@dataclass(frozen=True, kw_only=True)
class TrainingDecisions:
    directory: Path
    recipe: Recipe
    model_type: str  #: config.json's ``model_type``
    architectures: tuple[str, ...]
    num_blocks: int | None  #: the decoder blocks (``num_hidden_layers``), when the config says
    linears: tuple[LinearDecision, ...]

    @property
    def kept_high_precision(self) -> list[LinearDecision]:
        return [linear for linear in self.linears if not linear.fp8]

    def block_all_high_precision(self, index: int) -> bool:
        """Whether every Linear of decoder block ``index`` stays in high precision (False for a block with none)."""
        members = [linear for linear in self.linears if block_index(linear.path) == index]
        return bool(members) and not any(linear.fp8 for linear in members)


def block_index(path: str) -> int | None:
    """The decoder block a module path lies in (``model.layers.3.mlp.up_proj`` -> 3), or None."""
    match = _LAYER.search(path)
    return int(match.group(1)) if match else None


def read_training_decisions(directory: str | Path) -> TrainingDecisions:
    """The decisions of the artifact in ``directory`` (config.json's ``fp8`` block and the report's analysis).

    Raises ArtifactError when config.json or fp8_report.json is missing, unreadable, or does not list the Linears.
    """
    directory = Path(directory)
    config = _read_json(directory / "config.json")
    block = read_fp8_block(directory, str((config.get("fp8") or {}).get("backend")))
    recipe = recipe_from_dict(block.get("recipe"))
    converted = set(block.get("converted_modules") or [])
    layers = (_read_json(directory / REPORT_FILE).get("analysis") or {}).get("layers")
    if not isinstance(layers, list):
        raise ArtifactError(f"{directory / REPORT_FILE} has no analysis.layers; convert the model again")
    linears = tuple(
        LinearDecision(path=layer["path"], in_features=int(layer["in_features"]),
                       out_features=int(layer["out_features"]), fp8=layer["path"] in converted,
                       reasons=tuple(layer.get("reasons") or (() if layer["path"] in converted else ("excluded",))))
        for layer in layers if isinstance(layer, dict) and "in_features" in layer)
    blocks = config.get("num_hidden_layers", config.get("n_layer"))
    return TrainingDecisions(directory=directory, recipe=recipe, model_type=str(config.get("model_type", "")),
                        architectures=tuple(config.get("architectures") or ()),
                        num_blocks=blocks if isinstance(blocks, int) else None, linears=linears)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ArtifactError(f"{path}: cannot read it as JSON ({exc}); point at an fp8forge artifact directory") from exc
    if not isinstance(data, dict):
        raise ArtifactError(f"{path} is not a JSON object; point at an fp8forge artifact directory")
    return data
