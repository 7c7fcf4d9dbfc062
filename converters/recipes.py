"""FP8 recipes: frozen dataclasses, and parsing from JSON objects and Accelerate ``config.yaml`` files.

A recipe says *how* a model is converted: TransformerEngine delayed or current scaling, or a torchao
``Float8LinearConfig`` recipe. Omitted fields take the library's own default (TransformerEngine's
``DelayedScaling`` / torchao's ``Float8LinearConfig``), not Accelerate's, because the artifact is loaded
by those libraries. Accelerate's spellings are accepted so that an existing ``fp8_config:`` block works.

torchao is imported only inside the methods that need it; this module itself imports no torch.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from converters.errors import RecipeError

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
    "TEDelayedScalingRecipe",
    "TECurrentScalingRecipe",
    "TorchAORecipe",
    "Recipe",
    "recipe_from_dict",
    "recipe_from_accelerate_yaml",
    "load_recipe_file",
    "default_recipe",
]

logger = logging.getLogger(__name__)

RECIPE_VERSION = 1

# Upper bounds: a number a client sends must never let one job outgrow a worker's memory.
#: Rows of the fp32 amax history TE keeps per Linear (3 forward, 2 backward columns), in the worker, the
#: artifact and every process that loads it. Users pick 16..1024 (TE's default is 1024); 4096 leaves room and
#: keeps one Linear's history at 80 KiB. Unbounded, 2**40 made the worker try to allocate 13 TB.
MAX_AMAX_HISTORY_LEN = 4096
#: ``scale = fp8_max * 2**-margin / amax``: at 32 E4M3's range (448) has shrunk below 1e-7 already; beyond,
#: the fp32 scale only heads for underflow (2**-149 is 0). Working recipes use 0..a few.
MAX_MARGIN = 32
#: ``interval`` has no effect any more (TE removed it); bounded to the int32 step count TE kept it in.
MAX_INTERVAL = 2**31 - 1


class Backend(str, enum.Enum):
    """Conversion backend."""

    TE = "te"  #: TransformerEngine (te.Linear); runs only on a CUDA worker.
    AO = "ao"  #: torchao Float8Linear (dynamic scaling).


class Fp8Format(str, enum.Enum):
    """TransformerEngine ``Format``; pure E5M2 is absent because ``DelayedScaling`` rejects it."""

    HYBRID = "HYBRID"  #: E4M3 forward, E5M2 backward (TE's default).
    E4M3 = "E4M3"  #: E4M3 both ways.


class AmaxComputeAlgo(str, enum.Enum):
    """How TE picks the amax from the history window."""

    MAX = "max"  #: largest amax in the window (TE's default).
    MOST_RECENT = "most_recent"  #: the current step's amax (Accelerate's default).


class TEScaling(str, enum.Enum):
    """TransformerEngine per-tensor scaling strategy."""

    DELAYED = "delayed"  #: ``DelayedScaling``: scale from the amax history of earlier steps.
    CURRENT = "current"  #: ``Float8CurrentScaling``: stateless, scale from the tensor being cast.


class AORecipeName(str, enum.Enum):
    """torchao ``Float8LinearRecipeName`` values."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"


def _allowed(enum_cls: type[enum.Enum]) -> str:
    return ", ".join(str(m.value) for m in enum_cls)


def _coerce_enum(value: Any, enum_cls: type[enum.Enum], field: str, *, upper: bool) -> enum.Enum:
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str):
        key = value.strip().upper() if upper else value.strip().lower()
        for member in enum_cls:
            if member.value == key:
                return member
    raise RecipeError(
        f"{field} must be one of {_allowed(enum_cls)} (case-insensitive), got {value!r}.", field=field
    )


def _check_int(value: Any, field: str, *, minimum: int, maximum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    # bool is an int subclass; `margin: true` in a YAML file is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        kind = f"an integer >= {minimum} and <= {maximum}" + (" or null" if optional else "")
        raise RecipeError(f"{field} must be {kind}, got {value!r}.", field=field)


def check_bool(value: Any, field: str) -> None:
    """Raise RecipeError naming ``field`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise RecipeError(f"{field} must be true or false, got {value!r}.", field=field)


@dataclass(frozen=True, kw_only=True)
class TEDelayedScalingRecipe:
    """TransformerEngine ``DelayedScaling``: per-tensor scales from an amax history.

    ``interval`` and ``override_linear_precision`` are Accelerate keys that TransformerEngine no longer
    has (its pydantic dataclass drops them silently); they are kept here so that nothing the user wrote
    disappears, and :meth:`warnings` says they have no effect.
    """

    fp8_format: Fp8Format = Fp8Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = AmaxComputeAlgo.MAX
    margin: int = 0
    interval: int | None = None
    override_linear_precision: tuple[bool, bool, bool] | None = None
    use_autocast_during_eval: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "fp8_format", _coerce_enum(self.fp8_format, Fp8Format, "fp8_format", upper=True)
        )
        object.__setattr__(
            self,
            "amax_compute_algo",
            _coerce_enum(self.amax_compute_algo, AmaxComputeAlgo, "amax_compute_algo", upper=False),
        )
        _check_int(self.amax_history_len, "amax_history_len", minimum=1, maximum=MAX_AMAX_HISTORY_LEN)
        _check_int(self.margin, "margin", minimum=0, maximum=MAX_MARGIN)
        _check_int(self.interval, "interval", minimum=1, maximum=MAX_INTERVAL, optional=True)
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
                    f"got {olp!r}.",
                    field="override_linear_precision",
                )
            object.__setattr__(self, "override_linear_precision", tuple(olp))

    @property
    def backend(self) -> Backend:
        return Backend.TE

    @property
    def scaling(self) -> TEScaling:
        return TEScaling.DELAYED

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
        return _typed_from_dict(cls, data)


@dataclass(frozen=True, kw_only=True)
class TECurrentScalingRecipe:
    """TransformerEngine ``Float8CurrentScaling``: stateless, each cast scales by its own amax."""

    fp8_format: Fp8Format = Fp8Format.HYBRID

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "fp8_format", _coerce_enum(self.fp8_format, Fp8Format, "fp8_format", upper=True)
        )

    @property
    def backend(self) -> Backend:
        return Backend.TE

    @property
    def scaling(self) -> TEScaling:
        return TEScaling.CURRENT

    def warnings(self) -> list[str]:
        return []

    def te_recipe_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Float8CurrentScaling`` (``fp8_format`` as a ``Format`` name)."""
        return {"fp8_format": self.fp8_format.value}

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": RECIPE_VERSION,
            "backend": self.backend.value,
            "scaling": self.scaling.value,
            "fp8_format": self.fp8_format.value,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TECurrentScalingRecipe:
        return _typed_from_dict(cls, data)


@dataclass(frozen=True, kw_only=True)
class TorchAORecipe:
    """torchao ``Float8LinearConfig.from_recipe_name(recipe_name)`` plus per-linear options."""

    recipe_name: AORecipeName = AORecipeName.TENSORWISE
    pad_inner_dim: bool = False
    enable_fsdp_float8_all_gather: bool = False
    emulate: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "recipe_name", _coerce_enum(self.recipe_name, AORecipeName, "recipe_name", upper=False)
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
        return _typed_from_dict(cls, data)


Recipe = TEDelayedScalingRecipe | TECurrentScalingRecipe | TorchAORecipe


def _typed_from_dict(cls: type, data: Mapping[str, Any]) -> Any:
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
_TE_CURRENT_KEYS = tuple(f.name for f in dataclasses.fields(TECurrentScalingRecipe))
_AO_KEYS = tuple(f.name for f in dataclasses.fields(TorchAORecipe))
# `accelerate config` writes these spellings into fp8_config (TERecipeKwargs itself uses ours).
_TE_ALIASES = {"amax_history_length": "amax_history_len", "amax_compute_algorithm": "amax_compute_algo"}
_TRUE = {"y", "yes", "t", "true", "on", "1"}
_FALSE = {"n", "no", "f", "false", "off", "0"}


def _parse_bool_triple(value: Any) -> Any:
    """Accept Accelerate's string form ``"(false, false, false)"`` / ``"false,false,false"``."""
    if not isinstance(value, str):
        return value
    parts = [p.strip().lower() for p in value.strip().strip("()[]").split(",")]
    if len(parts) != 3 or not all(p in _TRUE | _FALSE for p in parts):
        raise RecipeError(
            f"override_linear_precision must be three booleans like (false, false, false), got {value!r}.",
            field="override_linear_precision",
        )
    return tuple(p in _TRUE for p in parts)


def _reject_unknown(data: Mapping[str, Any], allowed: tuple[str, ...], what: str) -> None:
    for key in data:
        if key not in allowed:
            raise RecipeError(
                f"Unknown {what} recipe key {key!r}; allowed keys: {', '.join(allowed)}.", field=str(key)
            )


def recipe_from_dict(data: Mapping[str, Any]) -> Recipe:
    """Build a recipe from a JSON object (or an Accelerate ``fp8_config`` mapping).

    ``{"backend": "te"|"ao", "scaling": "delayed"|"current" (TE only, default delayed), ...fields}``.
    ``backend`` is case-insensitive (Accelerate writes ``TE``/``AO``). Omitted fields take
    TransformerEngine's / torchao's defaults. Raises RecipeError naming the field for an unknown key, a
    wrong type or a value out of range.
    """
    if not isinstance(data, Mapping):
        raise RecipeError(f"A recipe must be a JSON object, got {type(data).__name__}.", field="recipe")
    data = dict(data)
    version = data.pop("version", RECIPE_VERSION)
    if isinstance(version, bool) or version != RECIPE_VERSION:
        raise RecipeError(
            f"Unsupported recipe version {version!r}; this fp8forge reads version {RECIPE_VERSION}.",
            field="version",
        )
    if "backend" not in data:
        raise RecipeError("The recipe needs a backend: te or ao.", field="backend")
    raw_backend = data.pop("backend")
    if isinstance(raw_backend, str) and raw_backend.strip().lower() == "msamp":
        raise RecipeError("The MS-AMP backend is not supported; use te or ao.", field="backend")
    backend = _coerce_enum(raw_backend, Backend, "backend", upper=False)

    if backend is Backend.AO:
        _reject_unknown(data, _COMMON_KEYS + _AO_KEYS, "ao")
        return TorchAORecipe(**data)

    scaling = _coerce_enum(data.pop("scaling", TEScaling.DELAYED), TEScaling, "scaling", upper=False)
    if scaling is TEScaling.CURRENT:
        _reject_unknown(data, _COMMON_KEYS + ("scaling",) + _TE_CURRENT_KEYS, "te current-scaling")
        return TECurrentScalingRecipe(**data)

    for alias, name in _TE_ALIASES.items():
        if alias in data:
            if name in data:
                raise RecipeError(f"Give either {name} or {alias}, not both.", field=alias)
            data[name] = data.pop(alias)
    mxfp8 = data.pop("use_mxfp8_block_scaling", False)
    check_bool(mxfp8, "use_mxfp8_block_scaling")
    if mxfp8:
        raise RecipeError(
            "use_mxfp8_block_scaling selects TransformerEngine's MXFP8BlockScaling recipe, which "
            "fp8forge does not produce; remove it or set it to false.",
            field="use_mxfp8_block_scaling",
        )
    allowed = _COMMON_KEYS + ("scaling", "use_mxfp8_block_scaling") + _TE_DELAYED_KEYS + tuple(_TE_ALIASES)
    _reject_unknown(data, allowed, "te delayed-scaling")
    if isinstance(data.get("fp8_format"), str) and data["fp8_format"].strip().upper() == "E5M2":
        raise RecipeError(
            "fp8_format E5M2 is rejected by TransformerEngine (pure E5M2 training is not supported); "
            f"use one of {_allowed(Fp8Format)}.",
            field="fp8_format",
        )
    if "override_linear_precision" in data:
        data["override_linear_precision"] = _parse_bool_triple(data["override_linear_precision"])
    return TEDelayedScalingRecipe(**data)


def recipe_from_accelerate_yaml(text: str) -> Recipe:
    """Read the ``fp8_config:`` block of an Accelerate ``config.yaml``.

    Requires ``mixed_precision: fp8`` and an explicit ``fp8_config.backend`` (Accelerate would otherwise
    pick a backend by what happens to be installed). Other top-level keys are Accelerate's business and
    are ignored. Raises RecipeError; a field error names ``fp8_config.<field>``.
    """
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"Not valid YAML: {exc}", field="recipe_file") from exc
    if not isinstance(doc, Mapping):
        raise RecipeError("An Accelerate config must be a YAML mapping.", field="recipe_file")
    mixed = doc.get("mixed_precision")
    if not isinstance(mixed, str) or mixed.strip().lower() != "fp8":
        raise RecipeError(
            f"The Accelerate config has mixed_precision: {mixed!r}; an FP8 recipe needs "
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
        field = f"fp8_config.{exc.field}" if exc.field else "fp8_config"
        raise RecipeError(f"fp8_config: {exc.message}", field=field) from exc


def load_recipe_file(path: str | Path) -> Recipe:
    """Load a recipe: ``.json`` -> :func:`recipe_from_dict`; ``.yaml``/``.yml`` -> Accelerate config.

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
            except json.JSONDecodeError as exc:
                raise RecipeError(f"Not valid JSON: {exc}", field="recipe_file") from exc
            return recipe_from_dict(data)
        return recipe_from_accelerate_yaml(text)
    except RecipeError as exc:
        raise RecipeError(f"{path}: {exc.message}", field=exc.field) from exc


def default_recipe(backend: str | Backend) -> Recipe:
    """The default recipe of a backend: TE delayed scaling, or torchao tensorwise."""
    if _coerce_enum(backend, Backend, "backend", upper=False) is Backend.TE:
        return TEDelayedScalingRecipe()
    return TorchAORecipe()
