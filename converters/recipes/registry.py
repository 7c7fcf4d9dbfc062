"""FP8 recipes: frozen dataclasses, and parsing from JSON objects and Accelerate ``config.yaml`` files.

A recipe says *how* a model is converted. TransformerEngine (``"backend": "te"``), one class per TE recipe,
chosen by ``scaling``: ``delayed`` (``DelayedScaling``, the default), ``current`` (``Float8CurrentScaling``),
``mxfp8_block`` (``MXFP8BlockScaling``), ``float8_block`` (``Float8BlockScaling``), ``nvfp4_block``
(``NVFP4BlockScaling``; see :mod:`converters.recipes.te_block`). torchao (``"backend": "ao"``): a
``Float8LinearConfig`` recipe (``recipe_name``; no ``scaling``), or a ``quantize_`` training config chosen by
``scaling``: ``float8_training_op`` / ``mxfp8_training_op`` (:mod:`converters.recipes.torchao_training`).

Omitted fields take the library's own default, not Accelerate's, because the artifact is loaded by those
libraries. Accelerate's spellings are accepted so that an existing ``fp8_config:`` block works, including
``use_mxfp8_block_scaling: true`` (``MXFP8BlockScaling``, as Accelerate builds it).

Every recipe class answers ``backend``, ``scaling``, ``stateful`` (only delayed scaling has an amax history to
seed), ``library_class``, ``state_note()``, ``warnings()``, ``shape_rule()``, ``hardware()``
(:mod:`converters.recipes.requirements`), ``cast_formats()`` (its forward casts, by spec name) and
``to_dict()`` / ``from_dict()``. torchao is imported only inside the methods that need it; this module itself
imports no torch.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from converters.errors import RecipeError
from converters.recipes.base import (
    RECIPE_VERSION,
    AOTrainingOp,
    Backend,
    TEScaling,
    allowed,
    brief,
    check_bool,
    coerce_enum,
)

if TYPE_CHECKING:
    from converters.recipes.requirements import Hardware, ShapeRule

__all__ = ["RECIPES", "Recipe", "register_recipe", "is_recipe", "recipes_of", "recipe_from_dict", "typed_from_dict",
           "default_recipe"]

_R = TypeVar("_R", bound=type)


class Recipe(Protocol):
    """What every recipe class answers (TE's ``Recipe.delayed()``-style predicates, on our frozen dataclasses)."""

    stateful: ClassVar[bool]  #: an amax history and scale to seed from calibration (TE delayed scaling only)
    training_op: ClassVar[bool]  #: applied with torchao ``quantize_`` (a training-op config), not a module swap
    per_tensor_te: ClassVar[bool]  #: a TE per-tensor recipe (delayed, current): TE can check it layer by layer

    @property
    def backend(self) -> Backend: ...

    @property
    def scaling(self) -> enum.Enum: ...

    @property
    def library_class(self) -> str: ...

    def state_note(self) -> str: ...

    def warnings(self) -> list[str]: ...

    def shape_rule(self) -> ShapeRule: ...

    def hardware(self) -> Hardware: ...

    def cast_formats(self) -> dict[str, str]: ...

    def block_scaled(self) -> bool: ...

    def to_dict(self) -> dict[str, Any]: ...


#: (backend, scaling) -> recipe class; torchao's Float8Linear recipe has no scaling (None). Filled by
#: :func:`register_recipe` as each recipe module is imported (``converters.recipes`` imports them all).
RECIPES: dict[tuple[Backend, enum.Enum | None], type] = {}


def register_recipe(backend: Backend, scaling: TEScaling | AOTrainingOp | None) -> Callable[[_R], _R]:
    """Class decorator: the recipe class ``recipe_from_dict`` builds for ``backend`` and ``scaling``."""
    def register(cls: _R) -> _R:
        if (backend, scaling) in RECIPES:
            raise ValueError(f"a recipe for {backend.value}/{scaling} is already registered")
        RECIPES[backend, scaling] = cls
        return cls
    return register


def is_recipe(value: Any) -> bool:
    """Whether ``value`` is an instance of a registered recipe class (already parsed and validated)."""
    return type(value) in RECIPES.values()


def recipes_of(backend: Backend) -> tuple[type, ...]:
    """The recipe classes registered for ``backend`` (what that backend runs)."""
    return tuple(cls for (owner, _), cls in RECIPES.items() if owner is backend)


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
#: `accelerate config` writes these spellings into fp8_config (TERecipeKwargs itself uses ours).
TE_ALIASES = {"amax_history_length": "amax_history_len", "amax_compute_algorithm": "amax_compute_algo"}
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


def _all_fields_of(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


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
        cls = RECIPES[Backend.AO, None]
        _reject_unknown(data, _COMMON_KEYS + _all_fields_of(cls), "ao")
        return cls(**data)
    raw = data.pop("scaling")
    if not isinstance(raw, (str, AOTrainingOp)) or str(getattr(raw, "value", raw)).strip().lower() not in {
            m.value for m in AOTrainingOp}:
        raise RecipeError(f"scaling must be one of {allowed(AOTrainingOp)} for a torchao quantize_ training config "
                          f"(leave it out for a Float8Linear recipe_name), got {brief(raw)}.", field="scaling")
    cls = RECIPES[Backend.AO, coerce_enum(raw, AOTrainingOp, "scaling", upper=False)]
    _reject_unknown(data, _COMMON_KEYS + ("scaling",) + _fields_of(cls), f"ao {cls.scaling_value.value}")
    return cls(**data)


def _te_recipe(data: dict[str, Any]) -> Recipe:
    scaling, accelerate_mxfp8 = _te_scaling(data)
    cls = RECIPES[Backend.TE, scaling]
    if accelerate_mxfp8:
        ignored = tuple(key for key in _ACCELERATE_DELAYED_ONLY if key in data)
        for key in ignored:
            data.pop(key)
        _reject_unknown(data, _COMMON_KEYS + ("scaling", "use_mxfp8_block_scaling") + _fields_of(cls),
                        "te mxfp8_block (Accelerate use_mxfp8_block_scaling)")
        return cls(**data, accelerate_ignored=ignored)
    if scaling is not TEScaling.DELAYED:
        _reject_unknown(data, _COMMON_KEYS + ("scaling",) + _fields_of(cls), f"te {scaling.value}")
        return cls(**data)
    for alias, name in TE_ALIASES.items():
        if alias in data:
            if name in data:
                raise RecipeError(f"Give either {name} or {alias}, not both.", field=alias)
            data[name] = data.pop(alias)
    allowed_keys = (_COMMON_KEYS + ("scaling", "use_mxfp8_block_scaling") + _all_fields_of(cls)
                    + tuple(TE_ALIASES))
    _reject_unknown(data, allowed_keys, "te delayed-scaling")
    if "override_linear_precision" in data:
        data["override_linear_precision"] = _parse_bool_triple(data["override_linear_precision"])
    return cls(**data)


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



def default_recipe(backend: str | Backend) -> Recipe:
    """The default recipe of a backend: TE delayed scaling, or torchao tensorwise."""
    if coerce_enum(backend, Backend, "backend", upper=False) is Backend.TE:
        return RECIPES[Backend.TE, TEScaling.DELAYED]()
    return RECIPES[Backend.AO, None]()
