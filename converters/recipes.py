"""FP8 recipes: frozen dataclasses, and parsing from JSON objects and Accelerate ``config.yaml`` files.

A recipe says *how* a model is converted. TransformerEngine (``"backend": "te"``), one class per TE recipe,
chosen by ``scaling``: ``delayed`` (``DelayedScaling``, the default), ``current`` (``Float8CurrentScaling``),
``mxfp8_block`` (``MXFP8BlockScaling``), ``float8_block`` (``Float8BlockScaling``), ``nvfp4_block``
(``NVFP4BlockScaling``; see :mod:`converters.te_block_recipes`). torchao (``"backend": "ao"``): a
``Float8LinearConfig`` recipe (``recipe_name``; no ``scaling``), or a ``quantize_`` training config chosen by
``scaling``: ``float8_training_op`` / ``mxfp8_training_op`` (:mod:`converters.ao_training_recipes`).

Omitted fields take the library's own default, not Accelerate's, because the artifact is loaded by those
libraries. Accelerate's spellings are accepted so that an existing ``fp8_config:`` block works, including
``use_mxfp8_block_scaling: true`` (``MXFP8BlockScaling``, as Accelerate builds it).

Every recipe class answers ``backend``, ``scaling``, ``stateful`` (only delayed scaling has an amax history to
seed), ``library_class``, ``state_note()``, ``warnings()``, ``shape_rule()``, ``hardware()``
(:mod:`converters.recipe_requirements`), ``cast_formats()`` (its forward casts, by spec name) and
``to_dict()`` / ``from_dict()``. torchao is imported only inside the methods that need it; this module itself
imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from converters.ao_training_recipes import AO_LINEAR_CAST_FORMATS, AOFloat8TrainingOpRecipe, AOMXFP8TrainingOpRecipe
from converters.errors import RecipeError
from converters.recipe_base import (
    MAX_AMAX_HISTORY_LEN,
    MAX_INTERVAL,
    MAX_MARGIN,
    RECIPE_VERSION,
    AmaxComputeAlgo,
    AORecipeName,
    AOTrainingOp,
    Backend,
    Fp8Format,
    MXKernelPreference,
    MXScaleCalculationMode,
    NVFP4ErrMode,
    NVFP4Scope,
    TEScaling,
    allowed,
    brief,
    check_bool,
    check_fp8_format,
    check_int,
    coerce_enum,
)
from converters.recipe_requirements import (
    ANY_DEVICE,
    FP8_GPU,
    FP8_RULE,
    TORCH_FP8_GPU,
    Hardware,
    ShapeRule,
    stateless_note,
)
from converters.safe_yaml import YamlRefused, load_yaml
from converters.te_block_recipes import (
    TEFloat8BlockScalingRecipe,
    TEMXFP8BlockScalingRecipe,
    TENVFP4BlockScalingRecipe,
)

__all__ = [
    "RECIPE_VERSION",
    "MAX_AMAX_HISTORY_LEN",
    "MAX_MARGIN",
    "MAX_INTERVAL",
    "Backend",
    "Fp8Format",
    "AmaxComputeAlgo",
    "TEScaling",
    "AORecipeName",
    "AOTrainingOp",
    "NVFP4Scope",
    "NVFP4ErrMode",
    "MXKernelPreference",
    "MXScaleCalculationMode",
    "TEDelayedScalingRecipe",
    "TECurrentScalingRecipe",
    "TEMXFP8BlockScalingRecipe",
    "TEFloat8BlockScalingRecipe",
    "TENVFP4BlockScalingRecipe",
    "TorchAORecipe",
    "AOFloat8TrainingOpRecipe",
    "AOMXFP8TrainingOpRecipe",
    "TE_RECIPES",
    "AO_RECIPES",
    "Recipe",
    "check_bool",
    "recipe_from_dict",
    "recipe_from_accelerate_yaml",
    "load_recipe_file",
    "check_canonical_spelling",
    "default_recipe",
    "typed_from_dict",
]

logger = logging.getLogger(__name__)


_PER_TENSOR_CASTS = {"input": "e4m3_tensor", "weight": "e4m3_tensor"}


class _PerTensorFP8:
    """What TE's per-tensor FP8 recipes (delayed and current scaling) share: dims % 16, FP8 GPUs, E4M3 casts."""

    def shape_rule(self) -> ShapeRule:
        return FP8_RULE

    def hardware(self) -> Hardware:
        return FP8_GPU

    def cast_formats(self) -> dict[str, str]:
        """Forward casts: E4M3 per tensor (HYBRID changes only the gradients, to E5M2 per tensor)."""
        return dict(_PER_TENSOR_CASTS)


@dataclass(frozen=True, kw_only=True)
class TEDelayedScalingRecipe(_PerTensorFP8):
    """TransformerEngine ``DelayedScaling``: per-tensor scales from an amax history.

    ``interval`` and ``override_linear_precision`` are Accelerate keys that TransformerEngine no longer
    has (its pydantic dataclass drops them silently); they are kept here so that nothing the user wrote
    disappears, and :meth:`warnings` says they have no effect.
    """

    te_class_name: ClassVar[str] = "DelayedScaling"
    stateful: ClassVar[bool] = True  #: TE keeps an amax history and scale per tensor: seeded from calibration

    fp8_format: Fp8Format = Fp8Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = AmaxComputeAlgo.MAX
    margin: int = 0
    interval: int | None = None
    override_linear_precision: tuple[bool, bool, bool] | None = None
    use_autocast_during_eval: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", check_fp8_format(self.fp8_format))
        object.__setattr__(
            self,
            "amax_compute_algo",
            coerce_enum(self.amax_compute_algo, AmaxComputeAlgo, "amax_compute_algo", upper=False),
        )
        check_int(self.amax_history_len, "amax_history_len", minimum=1, maximum=MAX_AMAX_HISTORY_LEN)
        check_int(self.margin, "margin", minimum=0, maximum=MAX_MARGIN)
        check_int(self.interval, "interval", minimum=1, maximum=MAX_INTERVAL, optional=True)
        check_bool(self.use_autocast_during_eval, "use_autocast_during_eval")
        olp = self.override_linear_precision
        if olp is not None:
            if (
                not isinstance(olp, (tuple, list))
                or len(olp) != 3
                or not all(isinstance(v, bool) for v in olp)
            ):
                raise RecipeError(
                    "override_linear_precision must be three booleans (fprop, dgrad, wgrad) or null, "
                    f"got {brief(olp)}.",
                    field="override_linear_precision",
                )
            object.__setattr__(self, "override_linear_precision", tuple(olp))

    @property
    def backend(self) -> Backend:
        return Backend.TE

    @property
    def scaling(self) -> TEScaling:
        return TEScaling.DELAYED

    @property
    def library_class(self) -> str:
        return "TransformerEngine DelayedScaling"

    def state_note(self) -> str:
        return (f"amax history ({self.amax_history_len} rows) and scale per tensor, seeded from the calibration as "
                "TE's own update would compute them (fp8_state.safetensors)")


    def warnings(self) -> list[str]:
        """Human-readable notes about fields that are recorded but change nothing."""
        notes = []
        for name in ("interval", "override_linear_precision"):
            if getattr(self, name) is not None:
                notes.append(f"{name} was removed from TransformerEngine; it is recorded but has no effect.")
        return notes

    def te_recipe_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``transformer_engine.common.recipe.DelayedScaling``.

        ``fp8_format`` is the ``Format`` member name; the caller resolves it with
        ``getattr(Format, name)`` so that this module never imports TransformerEngine.
        """
        return {
            "fp8_format": self.fp8_format.value,
            "amax_history_len": self.amax_history_len,
            "amax_compute_algo": self.amax_compute_algo.value,
            "margin": self.margin,
        }

    def te_qparams(self) -> dict[str, dict[str, Any]]:
        return {}

    def to_dict(self) -> dict[str, Any]:
        olp = self.override_linear_precision
        return {
            "version": RECIPE_VERSION,
            "backend": self.backend.value,
            "scaling": self.scaling.value,
            "fp8_format": self.fp8_format.value,
            "amax_history_len": self.amax_history_len,
            "amax_compute_algo": self.amax_compute_algo.value,
            "margin": self.margin,
            "interval": self.interval,
            "override_linear_precision": list(olp) if olp is not None else None,
            "use_autocast_during_eval": self.use_autocast_during_eval,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TEDelayedScalingRecipe:
        return typed_from_dict(cls, data)


@dataclass(frozen=True, kw_only=True)
class TECurrentScalingRecipe(_PerTensorFP8):
    """TransformerEngine ``Float8CurrentScaling``: stateless, each cast scales by its own amax."""

    te_class_name: ClassVar[str] = "Float8CurrentScaling"
    stateful: ClassVar[bool] = False

    fp8_format: Fp8Format = Fp8Format.HYBRID

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", check_fp8_format(self.fp8_format))

    @property
    def backend(self) -> Backend:
        return Backend.TE

    @property
    def scaling(self) -> TEScaling:
        return TEScaling.CURRENT

    @property
    def library_class(self) -> str:
        return "TransformerEngine Float8CurrentScaling"

    def state_note(self) -> str:
        return stateless_note(self.library_class)


    def warnings(self) -> list[str]:
        return []

    def te_recipe_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Float8CurrentScaling`` (``fp8_format`` as a ``Format`` name)."""
        return {"fp8_format": self.fp8_format.value}

    def te_qparams(self) -> dict[str, dict[str, Any]]:
        return {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": RECIPE_VERSION,
            "backend": self.backend.value,
            "scaling": self.scaling.value,
            "fp8_format": self.fp8_format.value,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TECurrentScalingRecipe:
        return typed_from_dict(cls, data)


@dataclass(frozen=True, kw_only=True)
class TorchAORecipe:
    """torchao ``Float8LinearConfig.from_recipe_name(recipe_name)`` plus per-linear options."""

    stateful: ClassVar[bool] = False

    recipe_name: AORecipeName = AORecipeName.TENSORWISE
    pad_inner_dim: bool = False
    enable_fsdp_float8_all_gather: bool = False
    emulate: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "recipe_name", coerce_enum(self.recipe_name, AORecipeName, "recipe_name", upper=False)
        )
        for name in ("pad_inner_dim", "enable_fsdp_float8_all_gather", "emulate"):
            check_bool(getattr(self, name), name)
        # torchao asserts this in Float8LinearConfig.__post_init__; say it here, before any work starts.
        if self.enable_fsdp_float8_all_gather and self.recipe_name is not AORecipeName.TENSORWISE:
            raise RecipeError(
                "enable_fsdp_float8_all_gather works only with recipe_name tensorwise "
                f"(torchao gathers tensorwise-scaled weights), got recipe_name {self.recipe_name.value}.",
                field="enable_fsdp_float8_all_gather",
            )

    @property
    def backend(self) -> Backend:
        return Backend.AO

    @property
    def scaling(self) -> AORecipeName:
        return self.recipe_name

    @property
    def library_class(self) -> str:
        return f"torchao Float8Linear ({self.recipe_name.value})"

    def state_note(self) -> str:
        return stateless_note(self.library_class)

    def shape_rule(self) -> ShapeRule:
        return FP8_RULE

    def hardware(self) -> Hardware:
        return ANY_DEVICE if self.emulate else TORCH_FP8_GPU

    def cast_formats(self) -> dict[str, str]:
        return dict(AO_LINEAR_CAST_FORMATS[self.recipe_name])

    def warnings(self) -> list[str]:
        return []

    def to_float8_linear_config(self) -> Any:
        """The torchao ``Float8LinearConfig`` this recipe stands for (imports torchao)."""
        from torchao.float8 import Float8LinearConfig

        base = Float8LinearConfig.from_recipe_name(self.recipe_name.value)
        return dataclasses.replace(
            base,
            pad_inner_dim=self.pad_inner_dim,
            enable_fsdp_float8_all_gather=self.enable_fsdp_float8_all_gather,
            emulate=self.emulate,
        )

    def float8_config_dict(self) -> dict[str, Any]:
        """The fully resolved ``Float8LinearConfig`` as JSON-able data, for replaying a conversion.

        Rebuild it with :func:`float8_linear_config_from_dict`.
        """
        from converters.float8_config import float8_config_to_dict

        return float8_config_to_dict(self.to_float8_linear_config())

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": RECIPE_VERSION,
            "backend": self.backend.value,
            "recipe_name": self.recipe_name.value,
            "pad_inner_dim": self.pad_inner_dim,
            "enable_fsdp_float8_all_gather": self.enable_fsdp_float8_all_gather,
            "emulate": self.emulate,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TorchAORecipe:
        return typed_from_dict(cls, data)


TE_RECIPES = {
    TEScaling.DELAYED: TEDelayedScalingRecipe,
    TEScaling.CURRENT: TECurrentScalingRecipe,
    TEScaling.MXFP8_BLOCK: TEMXFP8BlockScalingRecipe,
    TEScaling.FLOAT8_BLOCK: TEFloat8BlockScalingRecipe,
    TEScaling.NVFP4_BLOCK: TENVFP4BlockScalingRecipe,
}
AO_RECIPES = {AOTrainingOp.FLOAT8: AOFloat8TrainingOpRecipe, AOTrainingOp.MXFP8: AOMXFP8TrainingOpRecipe}

Recipe = (TEDelayedScalingRecipe | TECurrentScalingRecipe | TEMXFP8BlockScalingRecipe | TEFloat8BlockScalingRecipe
          | TENVFP4BlockScalingRecipe | TorchAORecipe | AOFloat8TrainingOpRecipe | AOMXFP8TrainingOpRecipe)


def typed_from_dict(cls: type, data: Mapping[str, Any]) -> Any:
    """:func:`recipe_from_dict`, checked to give a ``cls``; RecipeError (field ``backend``) otherwise."""
    recipe = recipe_from_dict(data)
    if not isinstance(recipe, cls):
        raise RecipeError(
            f"Expected a {cls.__name__} recipe, but the data describes {type(recipe).__name__}.",
            field="backend",
        )
    return recipe


# --- parsing -------------------------------------------------------------------------------------

_COMMON_KEYS = ("version", "backend")
_TE_DELAYED_KEYS = tuple(f.name for f in dataclasses.fields(TEDelayedScalingRecipe))
_AO_KEYS = tuple(f.name for f in dataclasses.fields(TorchAORecipe))
# `accelerate config` writes these spellings into fp8_config (TERecipeKwargs itself uses ours).
_TE_ALIASES = {"amax_history_length": "amax_history_len", "amax_compute_algorithm": "amax_compute_algo"}
# What `accelerate config` writes for any TE recipe and Accelerate drops when it builds MXFP8BlockScaling
# (apply_fp8_autowrap passes only margin and fp8_format on; the rest reaches it as environment defaults).
_ACCELERATE_DELAYED_ONLY = ("amax_history_len", "amax_history_length", "amax_compute_algo", "amax_compute_algorithm",
                            "interval", "override_linear_precision", "use_autocast_during_eval")
_TRUE = {"y", "yes", "t", "true", "on", "1"}
_FALSE = {"n", "no", "f", "false", "off", "0"}


def _parse_bool_triple(value: Any) -> Any:
    """Accept Accelerate's string form ``"(false, false, false)"`` / ``"false,false,false"``."""
    if not isinstance(value, str):
        return value
    parts = [p.strip().lower() for p in value.strip().strip("()[]").split(",")]
    if len(parts) != 3 or not all(p in _TRUE | _FALSE for p in parts):
        raise RecipeError(
            f"override_linear_precision must be three booleans like (false, false, false), got {brief(value)}.",
            field="override_linear_precision",
        )
    return tuple(p in _TRUE for p in parts)


def _reject_unknown(data: Mapping[str, Any], allowed_keys: tuple[str, ...], what: str) -> None:
    for key in data:
        if key not in allowed_keys:
            raise RecipeError(
                f"Unknown {what} recipe key {brief(key)}; allowed keys: {', '.join(allowed_keys)}.", field=str(key)
            )


def _fields_of(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("recipe_key", True))


def recipe_from_dict(data: Mapping[str, Any]) -> Recipe:
    """Build a recipe from a JSON object (or an Accelerate ``fp8_config`` mapping).

    ``{"backend": "te", "scaling": "delayed"|"current"|"mxfp8_block"|"float8_block"|"nvfp4_block" (default
    delayed), ...fields}`` or ``{"backend": "ao", ["scaling": "float8_training_op"|"mxfp8_training_op"], ...}``
    (no ``scaling``: a ``Float8Linear`` recipe). ``backend`` and enum values are case-insensitive (Accelerate
    writes ``TE``/``AO``). Omitted fields take TransformerEngine's / torchao's defaults. Raises RecipeError
    naming the field for an unknown key, a wrong type or a value out of range.
    """
    if not isinstance(data, Mapping):
        raise RecipeError(f"A recipe must be a JSON object, got {type(data).__name__}.", field="recipe")
    data = dict(data)
    version = data.pop("version", RECIPE_VERSION)
    if isinstance(version, bool) or version != RECIPE_VERSION:
        raise RecipeError(
            f"Unsupported recipe version {brief(version)}; this fp8forge reads version {RECIPE_VERSION}.",
            field="version",
        )
    if "backend" not in data:
        raise RecipeError("The recipe needs a backend: te or ao.", field="backend")
    raw_backend = data.pop("backend")
    if isinstance(raw_backend, str) and raw_backend.strip().lower() == "msamp":
        raise RecipeError("The MS-AMP backend is not supported; use te or ao.", field="backend")
    backend = coerce_enum(raw_backend, Backend, "backend", upper=False)
    return _ao_recipe(data) if backend is Backend.AO else _te_recipe(data)


def _ao_recipe(data: dict[str, Any]) -> Recipe:
    if "scaling" not in data:
        _reject_unknown(data, _COMMON_KEYS + _AO_KEYS, "ao")
        return TorchAORecipe(**data)
    raw = data.pop("scaling")
    if not isinstance(raw, (str, AOTrainingOp)) or str(getattr(raw, "value", raw)).strip().lower() not in {
            m.value for m in AOTrainingOp}:
        raise RecipeError(f"scaling must be one of {allowed(AOTrainingOp)} for a torchao quantize_ training config "
                          f"(leave it out for a Float8Linear recipe_name), got {brief(raw)}.", field="scaling")
    cls = AO_RECIPES[coerce_enum(raw, AOTrainingOp, "scaling", upper=False)]
    _reject_unknown(data, _COMMON_KEYS + ("scaling",) + _fields_of(cls), f"ao {cls.scaling_value.value}")
    return cls(**data)


def _te_recipe(data: dict[str, Any]) -> Recipe:
    scaling, accelerate_mxfp8 = _te_scaling(data)
    cls = TE_RECIPES[scaling]
    if accelerate_mxfp8:
        ignored = tuple(key for key in _ACCELERATE_DELAYED_ONLY if key in data)
        for key in ignored:
            data.pop(key)
        _reject_unknown(data, _COMMON_KEYS + ("scaling", "use_mxfp8_block_scaling") + _fields_of(cls),
                        "te mxfp8_block (Accelerate use_mxfp8_block_scaling)")
        return TEMXFP8BlockScalingRecipe(**data, accelerate_ignored=ignored)
    if cls is not TEDelayedScalingRecipe:
        _reject_unknown(data, _COMMON_KEYS + ("scaling",) + _fields_of(cls), f"te {scaling.value}")
        return cls(**data)
    for alias, name in _TE_ALIASES.items():
        if alias in data:
            if name in data:
                raise RecipeError(f"Give either {name} or {alias}, not both.", field=alias)
            data[name] = data.pop(alias)
    allowed_keys = _COMMON_KEYS + ("scaling", "use_mxfp8_block_scaling") + _TE_DELAYED_KEYS + tuple(_TE_ALIASES)
    _reject_unknown(data, allowed_keys, "te delayed-scaling")
    if "override_linear_precision" in data:
        data["override_linear_precision"] = _parse_bool_triple(data["override_linear_precision"])
    return TEDelayedScalingRecipe(**data)


def _te_scaling(data: dict[str, Any]) -> tuple[TEScaling, bool]:
    """The TE recipe ``data`` asks for (popping ``scaling`` and ``use_mxfp8_block_scaling``), and whether it asks
    in Accelerate's way (``use_mxfp8_block_scaling: true``).

    Accelerate's ``apply_fp8_autowrap`` builds ``MXFP8BlockScaling(**kwargs)`` for ``use_mxfp8_block_scaling``
    and ``DelayedScaling`` otherwise; the key may accompany the matching ``scaling`` only.
    """
    raw = data.pop("scaling", None)
    scaling = TEScaling.DELAYED if raw is None else coerce_enum(raw, TEScaling, "scaling", upper=False)
    if "use_mxfp8_block_scaling" not in data:
        return scaling, False
    mxfp8 = data.pop("use_mxfp8_block_scaling")
    check_bool(mxfp8, "use_mxfp8_block_scaling")
    if raw is None and mxfp8:
        scaling = TEScaling.MXFP8_BLOCK
    expected = TEScaling.MXFP8_BLOCK if mxfp8 else TEScaling.DELAYED
    if scaling is not expected:
        raise RecipeError(f"use_mxfp8_block_scaling {str(mxfp8).lower()} selects scaling {expected.value} "
                          f"(Accelerate's MXFP8BlockScaling or DelayedScaling); it contradicts scaling "
                          f"{scaling.value}: give one of the two", field="use_mxfp8_block_scaling")
    return scaling, mxfp8


def recipe_from_accelerate_yaml(text: str) -> Recipe:
    """Read the ``fp8_config:`` block of an Accelerate ``config.yaml``.

    Requires ``mixed_precision: fp8`` and an explicit ``fp8_config.backend`` (Accelerate would otherwise
    pick a backend by what happens to be installed). Other top-level keys are Accelerate's business and
    are ignored. ``use_mxfp8_block_scaling: true`` gives TE's ``MXFP8BlockScaling`` with the block's
    ``fp8_format`` and ``margin``; the delayed-scaling keys ``accelerate config`` writes as well are dropped,
    as Accelerate drops them, and the recipe's warnings name them. The other recipes have no Accelerate
    spelling; write their canonical ``scaling`` in the block. Raises RecipeError; a field error names
    ``fp8_config.<field>``.
    """
    try:
        doc = load_yaml(text)
    except YamlRefused as exc:
        raise RecipeError(str(exc), field="recipe_file") from exc
    if not isinstance(doc, Mapping):
        raise RecipeError("An Accelerate config must be a YAML mapping.", field="recipe_file")
    mixed = doc.get("mixed_precision")
    if not isinstance(mixed, str) or mixed.strip().lower() != "fp8":
        raise RecipeError(
            f"The Accelerate config has mixed_precision: {brief(mixed)}; an FP8 recipe needs "
            "mixed_precision: fp8.",
            field="mixed_precision",
        )
    fp8_config = doc.get("fp8_config")
    if not isinstance(fp8_config, Mapping) or "backend" not in fp8_config:
        raise RecipeError(
            "The Accelerate config needs an fp8_config block with backend: TE or AO.",
            field="fp8_config.backend",
        )
    try:
        return recipe_from_dict(fp8_config)
    except RecipeError as exc:
        field_path = f"fp8_config.{exc.field}" if exc.field else "fp8_config"
        raise RecipeError(f"fp8_config: {exc.message}", field=field_path) from exc


def check_canonical_spelling(data: Mapping[str, Any], recipe: Recipe) -> None:
    """Refuse what only Accelerate writes in a recipe meant as JSON (a JSON recipe file, the API's ``recipe``).

    :func:`recipe_from_dict` reads Accelerate's spellings too (``TE``, ``amax_history_length``,
    ``use_mxfp8_block_scaling``, ``"(false, false, false)"``, enum values in any case), for the ``fp8_config`` of
    an Accelerate ``config.yaml``. A JSON recipe takes exactly what ``POST /v1/jobs`` takes, so a file that
    works with ``fp8forge convert --recipe`` works as the API's ``recipe`` too, and the other way round.

    Raises:
        RecipeError: naming the key, and what to write instead.
    """
    canonical = recipe.to_dict()
    keys = sorted(data, key=lambda key: key != "use_mxfp8_block_scaling")  # the key that explains the others
    for key in keys:
        value = data[key]
        if key == "use_mxfp8_block_scaling":
            instead = '"scaling": "mxfp8_block"' if value is True else "nothing (delayed scaling is the default)"
        elif key in _TE_ALIASES:
            instead = f'"{_TE_ALIASES[key]}": {json.dumps(canonical.get(_TE_ALIASES[key]))}'
        elif key not in canonical:
            instead = f"one of {', '.join(canonical)}"
        elif value != canonical[key] or isinstance(value, str) is not isinstance(canonical[key], str):
            instead = f'"{key}": {json.dumps(canonical[key])}'
        else:
            continue
        raise RecipeError(f"{key} {brief(value)} is Accelerate's spelling, for an Accelerate config.yaml; a JSON "
                          f"recipe takes what the API's recipe object takes: write {instead}", field=str(key))


def load_recipe_file(path: str | Path) -> Recipe:
    """Load a recipe: ``.json`` -> :func:`recipe_from_dict` in the API's spelling (:func:`check_canonical_spelling`);
    ``.yaml``/``.yml`` -> Accelerate config, in Accelerate's.

    Raises RecipeError (with the path in the message) for a missing file, bad JSON/YAML or a bad recipe.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise RecipeError(f"{path}: a recipe file must end in .json, .yaml or .yml.", field="recipe_file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read recipe file: {exc}", field="recipe_file") from exc
    try:
        if suffix == ".json":
            try:
                data = json.loads(text)
            except (ValueError, RecursionError) as exc:  # ValueError: also an integer too long to convert
                raise RecipeError(f"Not valid JSON: {str(exc)[:200]}", field="recipe_file") from exc
            recipe = recipe_from_dict(data)
            check_canonical_spelling(data, recipe)
            return recipe
        return recipe_from_accelerate_yaml(text)
    except RecipeError as exc:
        raise RecipeError(f"{path}: {exc.message}", field=exc.field) from exc


def default_recipe(backend: str | Backend) -> Recipe:
    """The default recipe of a backend: TE delayed scaling, or torchao tensorwise."""
    if coerce_enum(backend, Backend, "backend", upper=False) is Backend.TE:
        return TEDelayedScalingRecipe()
    return TorchAORecipe()
