"""The recipe of a job as typed request models: one per backend and scaling, chosen by ``backend``/``scaling``.

The conversion library (``converters.recipes``) stays the authority and checks the recipe again before a job
is queued; these models state its fields, enums and bounds in the OpenAPI schema and refuse anything that
is not exactly right. The API takes the canonical spellings only: the library's extra leniency (``TE`` in
capitals, Accelerate's ``amax_history_length``) is for recipe files given to the command line.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, GetPydanticSchema, Tag
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import core_schema

from converters.recipes import (
    MAX_AMAX_HISTORY_LEN,
    MAX_INTERVAL,
    MAX_MARGIN,
    RECIPE_VERSION,
    AmaxComputeAlgo,
    AORecipeName,
    Fp8Format,
    TEDelayedScalingRecipe,
    TorchAORecipe,
)

__all__ = [
    "STRICT", "json_int", "RecipeCreate", "TEDelayedRecipeCreate", "TECurrentRecipeCreate", "TorchAORecipeCreate",
]

# Strict: a JSON value of the wrong type is refused ("8" is not an integer, "yes" is not a boolean)
STRICT = ConfigDict(extra="forbid", strict=True)


def _integral(value: Any) -> Any:
    # JSON has one number type and JSON Schema calls 8.0 an integer; strings and booleans stay refused
    return int(value) if isinstance(value, float) and value.is_integer() else value


def json_int(low: int, high: int) -> Any:
    """An integer from ``low`` to ``high`` as JSON Schema means it: 8 or 8.0, never "8" or true."""
    return Annotated[int, Field(ge=low, le=high), BeforeValidator(_integral)]
_TE = TEDelayedScalingRecipe()
_AO = TorchAORecipe()

Version = Annotated[Literal[1], Field(description=f"Recipe format version ({RECIPE_VERSION}).")]


class TEDelayedRecipeCreate(BaseModel):
    """TransformerEngine ``DelayedScaling``: per-tensor scales from an amax history (the default recipe)."""

    model_config = STRICT
    version: Version = RECIPE_VERSION
    backend: Literal["te"]
    scaling: Literal["delayed"] = "delayed"
    # strict=False only lets pydantic take the enum's value from the parsed JSON; anything else is refused
    fp8_format: Fp8Format = Field(_TE.fp8_format, strict=False)
    amax_history_len: json_int(1, MAX_AMAX_HISTORY_LEN) = Field(
        _TE.amax_history_len,
        description=f"Steps of amax history per tensor, 1..{MAX_AMAX_HISTORY_LEN} (TE's default "
                    f"{_TE.amax_history_len}; 16..1024 in practice). Each Linear keeps this many fp32 rows.")
    amax_compute_algo: AmaxComputeAlgo = Field(_TE.amax_compute_algo, strict=False)
    margin: json_int(0, MAX_MARGIN) = Field(_TE.margin,
                        description=f"Scale by 2**-margin, 0..{MAX_MARGIN}.")
    interval: json_int(1, MAX_INTERVAL) | None = Field(None,
                                 description="Removed from TransformerEngine: recorded, with no effect.")
    override_linear_precision: list[bool] | None = Field(
        None, min_length=3, max_length=3,
        description="Removed from TransformerEngine: three booleans (fprop, dgrad, wgrad), recorded, no effect.")
    use_autocast_during_eval: bool = _TE.use_autocast_during_eval


class TECurrentRecipeCreate(BaseModel):
    """TransformerEngine ``Float8CurrentScaling``: stateless, each cast scales by its own amax."""

    model_config = STRICT
    version: Version = RECIPE_VERSION
    backend: Literal["te"]
    scaling: Literal["current"]
    fp8_format: Fp8Format = Field(_TE.fp8_format, strict=False)


class TorchAORecipeCreate(BaseModel):
    """torchao ``Float8LinearConfig.from_recipe_name(recipe_name)`` plus per-linear options.

    ``enable_fsdp_float8_all_gather`` works only with ``recipe_name`` tensorwise (refused otherwise).
    """

    model_config = STRICT
    version: Version = RECIPE_VERSION
    backend: Literal["ao"]
    recipe_name: AORecipeName = Field(_AO.recipe_name, strict=False)
    pad_inner_dim: bool = _AO.pad_inner_dim
    enable_fsdp_float8_all_gather: bool = _AO.enable_fsdp_float8_all_gather
    emulate: bool = _AO.emulate


def _refusal(field: str, choices: tuple[str, ...]) -> Any:
    """A union member that never validates: a recipe whose ``field`` is missing or unknown lands here and is
    refused as ``recipe.<field>``. A bare core schema, not a model: FastAPI would list a model among the OpenAPI
    components although the union leaves it out of the schema."""
    schema = core_schema.typed_dict_schema(
        {field: core_schema.typed_dict_field(core_schema.literal_schema(list(choices)))}, extra_behavior="allow")
    return SkipJsonSchema[Annotated[dict, GetPydanticSchema(lambda _type, _handler: schema)]]


def _variant(value: Any) -> str | None:
    """The tag of the model that validates ``value`` (tags are bracketed: they appear in error locations)."""
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if not isinstance(value, dict):
        return None
    backend = value.get("backend")
    if backend == "ao":
        return "[ao]"
    if backend != "te":
        return "[unknown backend]"
    scaling = value.get("scaling", "delayed")
    return {"delayed": "[te delayed]", "current": "[te current]"}.get(scaling, "[unknown scaling]") if isinstance(
        scaling, str) else "[unknown scaling]"


RecipeCreate = Annotated[
    Annotated[TEDelayedRecipeCreate, Tag("[te delayed]")]
    | Annotated[TECurrentRecipeCreate, Tag("[te current]")]
    | Annotated[TorchAORecipeCreate, Tag("[ao]")]
    | Annotated[_refusal("backend", ("te", "ao")), Tag("[unknown backend]")]
    | Annotated[_refusal("scaling", ("delayed", "current")), Tag("[unknown scaling]")],
    Discriminator(_variant, custom_error_type="recipe_type",
                  custom_error_message='recipe must be a JSON object like {"backend": "te"}'),
]
