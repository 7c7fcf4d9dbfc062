"""A conversion request: what the CLI and the service hand to the pipeline, validated up front.

Everything that can be checked without loading the model is checked here, so a bad job is refused
before it is queued; each error names the field as a dotted path (``recipe.margin``, ``calibration.steps``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from converters.errors import CalibrationDataError, Fp8ForgeError, RecipeError
from converters.patterns import validate_pattern

__all__ = ["CalibrationSettings", "ConversionRequest", "LIMITS"]

LIMITS = {"steps": (1, 4096), "batch_size": (1, 256), "seq_len": (1, 32768), "texts": (1, 100_000)}
_REQUEST_KEYS = (
    "model", "recipe", "calibration", "include", "exclude", "skip_first_last", "convert_router_gates",
    "max_shard_bytes", "te_extra_state", "serving_formats",
)


@dataclass(frozen=True, kw_only=True)
class CalibrationSettings:
    """Calibration: ``steps`` batches of ``batch_size`` x ``seq_len`` tokens; ``texts`` replaces the corpus."""

    steps: int = 16
    batch_size: int = 2
    seq_len: int = 128
    texts: tuple[str, ...] | None = None
    backward: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len"):
            value = getattr(self, name)
            low, high = LIMITS[name]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise CalibrationDataError(
                    f"calibration.{name} must be an integer from {low} to {high}, got {value!r}",
                    field=f"calibration.{name}",
                )
        if not isinstance(self.backward, bool):
            raise CalibrationDataError("calibration.backward must be true or false", field="calibration.backward")
        if self.texts is not None:
            texts = self.texts
            if not isinstance(texts, (list, tuple)) or not all(isinstance(text, str) for text in texts):
                raise CalibrationDataError("calibration.texts must be a list of strings", field="calibration.texts")
            if not texts or not any(text.strip() for text in texts) or len(texts) > LIMITS["texts"][1]:
                raise CalibrationDataError(
                    f"calibration.texts must hold 1 to {LIMITS['texts'][1]} non-empty strings; omit it to use "
                    "the built-in corpus",
                    field="calibration.texts",
                )
            object.__setattr__(self, "texts", tuple(texts))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> CalibrationSettings:
        data = dict(data or {})
        allowed = ("steps", "batch_size", "seq_len", "texts", "backward")
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise CalibrationDataError(
                f"unknown calibration field {unknown[0]!r}; allowed: {', '.join(allowed)}",
                field=f"calibration.{unknown[0]}",
            )
        if data.get("texts") is not None:
            data["texts"] = tuple(data["texts"]) if isinstance(data["texts"], list) else data["texts"]
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "texts": None if self.texts is None else f"{len(self.texts)} user text(s)",
            "backward": self.backward,
        }


@dataclass(frozen=True, kw_only=True)
class ConversionRequest:
    """One conversion: model reference, recipe JSON, calibration and layer selection."""

    model: str
    recipe: Mapping[str, Any] = field(default_factory=lambda: {"backend": "te"})
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    skip_first_last: bool = True
    convert_router_gates: bool = False
    max_shard_bytes: int = 5 * 1024**3
    te_extra_state: bool = False
    serving_formats: tuple[str, ...] = ()  #: names in converters.formats.SERVING_FORMATS, each its own subdirectory

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise Fp8ForgeError("model must be a non-empty string like 'org/name[@revision]'", field="model")
        for name in ("include", "exclude"):
            patterns = getattr(self, name)
            if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)):
                raise Fp8ForgeError(f"{name} must be a list of patterns", field=name)
            for index, pattern in enumerate(patterns):
                validate_pattern(pattern, field=f"{name}[{index}]")
            object.__setattr__(self, name, tuple(patterns))
        for name in ("skip_first_last", "convert_router_gates", "te_extra_state"):
            if not isinstance(getattr(self, name), bool):
                raise Fp8ForgeError(f"{name} must be true or false", field=name)
        if isinstance(self.max_shard_bytes, bool) or not isinstance(self.max_shard_bytes, int) or (
            self.max_shard_bytes < 65536
        ):
            raise Fp8ForgeError("max_shard_bytes must be an integer of at least 65536", field="max_shard_bytes")
        self._check_serving_formats()
        self.parsed_recipe()  # raises RecipeError naming the field

    def _check_serving_formats(self) -> None:
        from converters.formats import serving_format

        names = self.serving_formats
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise Fp8ForgeError("serving_formats must be a list of format names", field="serving_formats")
        for index, name in enumerate(names):
            serving_format(name, field=f"serving_formats[{index}]")
        if len(set(names)) != len(names):
            raise Fp8ForgeError("serving_formats lists a format twice", field="serving_formats")
        object.__setattr__(self, "serving_formats", tuple(names))

    def parsed_recipe(self):
        """The recipe dataclass (``TEDelayedScalingRecipe``, ``TECurrentScalingRecipe`` or ``TorchAORecipe``)."""
        from converters.recipes import recipe_from_dict

        if not isinstance(self.recipe, Mapping):
            raise RecipeError('recipe must be a JSON object like {"backend": "te"}', field="recipe")
        try:
            return recipe_from_dict(self.recipe)
        except RecipeError as exc:
            dotted = f"recipe.{exc.field}" if exc.field and not exc.field.startswith("recipe") else exc.field
            raise RecipeError(exc.message, field=dotted or "recipe") from exc

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> ConversionRequest:
        """Build from a JSON body; raises Fp8ForgeError subclasses with ``field`` set to a dotted path."""
        if not isinstance(body, Mapping):
            raise Fp8ForgeError("the request body must be a JSON object", field="body")
        unknown = sorted(set(body) - set(_REQUEST_KEYS))
        if unknown:
            raise Fp8ForgeError(f"unknown field {unknown[0]!r}; allowed: {', '.join(_REQUEST_KEYS)}", field=unknown[0])
        data = dict(body)
        if "model" not in data:
            raise Fp8ForgeError("model is required, e.g. 'org/name[@revision]'", field="model")
        calibration = data.get("calibration")
        if calibration is not None and not isinstance(calibration, Mapping):
            raise CalibrationDataError("calibration must be a JSON object", field="calibration")
        data["calibration"] = CalibrationSettings.from_dict(calibration)
        for name in ("include", "exclude", "serving_formats"):
            if data.get(name) is None:
                data.pop(name, None)
        if data.get("recipe") is None:
            data.pop("recipe", None)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "recipe": dict(self.recipe),
            "calibration": self.calibration.to_dict(),
            "include": list(self.include),
            "exclude": list(self.exclude),
            "skip_first_last": self.skip_first_last,
            "convert_router_gates": self.convert_router_gates,
            "max_shard_bytes": self.max_shard_bytes,
            "te_extra_state": self.te_extra_state,
            "serving_formats": list(self.serving_formats),
        }
