"""Load an fp8forge TransformerEngine artifact back into a model with te.Linear layers and their FP8 state.

An artifact directory holds a Hugging Face ``config.json`` with an ``fp8`` block::

    "fp8": {"backend": "te", "recipe": {...recipe.to_dict()...}, "converted_modules": ["model.layers.0...", ...]}

and safetensors (``model.safetensors``, or the shards listed by ``model.safetensors.index.json``) with the
model's normal keys plus, per converted layer, the four scaling-state keys of :mod:`converters.te_layout`.
TE's own pickled ``<layer>._extra_state`` keys (opt-in artifact mode) are never unpickled here: the plain
tensors carry the same numbers.

:func:`read_te_artifact` and :func:`build_hf_model` need no TE and run anywhere; :func:`load_te` checks for
CUDA and TE before reading anything.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from converters.backends.transformer_engine import (
    apply_scaling_state,
    check_state_tensors,
    convert_to_te,
    require_te,
)
from converters.errors import ConversionError, ModelNotFoundError, RecipeError
from converters.export import INDEX_NAME, SINGLE_FILE_NAME
from converters.loading import ModelSourceOptions, load_config, model_class, model_dtype
from converters.recipes import TECurrentScalingRecipe, TEDelayedScalingRecipe, recipe_from_dict
from converters.te_layout import TE_STATE_NAMES, split_state_key

__all__ = ["TEArtifact", "read_te_artifact", "build_hf_model", "load_te"]

logger = logging.getLogger(__name__)

_EXTRA_STATE_SUFFIX = "._extra_state"


@dataclass(frozen=True, kw_only=True)
class TEArtifact:
    """What an artifact directory holds, read and checked (tensors on the CPU)."""

    directory: Path
    recipe: TEDelayedScalingRecipe | TECurrentScalingRecipe
    converted_modules: tuple[str, ...]
    #: Hugging Face keys -> tensors, scaling-state and ``_extra_state`` keys removed.
    weights: dict[str, torch.Tensor] = field(repr=False)
    #: layer path -> {te_layout name -> tensor}; empty for current scaling.
    scaling_states: dict[str, dict[str, torch.Tensor]] = field(repr=False)
    #: TE ``_extra_state`` keys found and ignored.
    ignored_keys: tuple[str, ...] = ()


def read_te_artifact(directory: str | Path) -> TEArtifact:
    """Read and check an artifact directory (no TE needed).

    Raises ModelNotFoundError when the directory, its config.json or its safetensors are missing, or the
    config has no ``fp8`` block for backend ``te`` (not an fp8forge TE artifact); RecipeError for an invalid
    recipe; ConversionError when the state keys do not match ``converted_modules`` and the recipe.
    """
    directory = Path(directory)
    fp8 = _fp8_block(directory)
    try:
        recipe = recipe_from_dict(fp8.get("recipe"))
    except RecipeError as exc:
        raise RecipeError(f"{directory}: fp8.recipe: {exc.message}", field=exc.field) from exc
    if not isinstance(recipe, (TEDelayedScalingRecipe, TECurrentScalingRecipe)):
        raise RecipeError(f"{directory}: fp8.recipe is not a TransformerEngine recipe", field="backend")
    converted = fp8.get("converted_modules")
    if not isinstance(converted, list) or not all(isinstance(p, str) and p for p in converted) \
            or len(set(converted)) != len(converted):
        raise ModelNotFoundError(f"{directory}: fp8.converted_modules must be a list of distinct module paths")
    weights, states, ignored = _split_keys(_read_safetensors(directory))
    _check_states(directory, recipe, converted, states)
    return TEArtifact(directory=directory, recipe=recipe, converted_modules=tuple(converted), weights=weights,
                      scaling_states=states, ignored_keys=tuple(ignored))


def _fp8_block(directory: Path) -> dict[str, Any]:
    from converters.loaders import read_fp8_block

    return read_fp8_block(directory, "te")


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = _shard_files(directory)
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            shard = load_file(path)
        except (OSError, SafetensorError) as exc:
            raise ModelNotFoundError(f"{path}: cannot read safetensors: {exc}") from exc
        clash = sorted(set(shard) & set(tensors))
        if clash:
            raise ModelNotFoundError(f"{path}: keys also present in another shard: {clash[:3]}")
        tensors.update(shard)
    return tensors


def _shard_files(directory: Path) -> list[Path]:
    index = directory / INDEX_NAME
    if not index.is_file():
        if not (directory / SINGLE_FILE_NAME).is_file():
            raise ModelNotFoundError(f"{directory} has neither {SINGLE_FILE_NAME} nor {INDEX_NAME}")
        return [directory / SINGLE_FILE_NAME]
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelNotFoundError(f"{index}: not a safetensors index (needs a weight_map object): {exc}") from exc
    for name in names:
        # The index names files next to it; anything else would read outside the artifact.
        if not isinstance(name, str) or Path(name).name != name or not (directory / name).is_file():
            raise ModelNotFoundError(f"{index}: shard {name!r} is not a file in {directory}")
    return [directory / name for name in names]


def _split_keys(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict, list[str]]:
    weights: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    ignored = []
    for key, tensor in tensors.items():
        split = split_state_key(key)
        if split is not None:
            states.setdefault(split[0], {})[split[1]] = tensor
        elif key.endswith(_EXTRA_STATE_SUFFIX):
            ignored.append(key)
        else:
            weights[key] = tensor
    if ignored:
        logger.info("ignoring %d TE _extra_state keys (pickles); the plain state tensors are used", len(ignored))
    return weights, states, sorted(ignored)


def _check_states(directory: Path, recipe: Any, converted: list[str], states: dict[str, dict]) -> None:
    if isinstance(recipe, TECurrentScalingRecipe):
        if states:
            raise ConversionError(f"{directory}: current-scaling artifact carries scaling state for "
                                  f"{sorted(states)[:3]}; the recipe and the tensors disagree")
        return
    extra, missing = sorted(set(states) - set(converted)), sorted(set(converted) - set(states))
    if extra or missing:
        raise ConversionError(f"{directory}: scaling state does not match fp8.converted_modules "
                              f"(state without a converted module: {extra[:3]}; converted without state: "
                              f"{missing[:3]}); each converted layer needs {list(TE_STATE_NAMES)}")
    for path in converted:
        check_state_tensors(path, states[path], recipe.amax_history_len)


def build_hf_model(artifact: TEArtifact, sources: ModelSourceOptions | None = None) -> nn.Module:
    """Build the Hugging Face model from the artifact's config on the CPU and load its weights (no TE needed).

    Strict: every key of the model's state_dict must come from the files, except a tied parameter whose
    twin was loaded; every file key must belong to the model. Raises ModelNotFoundError for a config
    transformers cannot build, ConversionError for missing or unexpected keys.
    """
    sources = sources or ModelSourceOptions()
    config = load_config(artifact.directory, sources)
    cls = model_class(config, sources)
    dtype = model_dtype(config)
    if hasattr(cls, "_from_config"):
        model = cls._from_config(config, dtype=dtype)
    else:
        model = cls.from_config(config, dtype=dtype, trust_remote_code=sources.trust_remote_code)
    result = model.load_state_dict(artifact.weights, strict=False)
    missing = [k for k in result.missing_keys if not _tied_to_loaded(model, k, artifact.weights)]
    if missing or result.unexpected_keys:
        raise ConversionError(f"{artifact.directory}: the weights do not match the model built from config.json "
                              f"(missing: {missing[:5]}, unexpected: {result.unexpected_keys[:5]})")
    model.eval()
    return model


def _tied_to_loaded(model: nn.Module, key: str, loaded: dict[str, torch.Tensor]) -> bool:
    """Whether ``key`` names a parameter shared with (tied to) a parameter that was loaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(key)
    return target is not None and any(params.get(k) is target for k in loaded if k != key)


def load_te(directory: str | Path, sources: ModelSourceOptions | None = None, *,
            device: str | torch.device = "cuda") -> nn.Module:
    """Load an fp8forge TE artifact: the HF model with ``fp8.converted_modules`` as te.Linear on ``device``
    and, for delayed scaling, the scaling state of the files in each te.Linear. Returns the model in eval mode.

    Raises BackendUnavailableError without CUDA/TE (checked before anything is read), the errors of
    :func:`read_te_artifact` and :func:`build_hf_model`, and ConversionError from the swap or the state.
    """
    require_te()
    artifact = read_te_artifact(directory)
    model = build_hf_model(artifact, sources)
    convert_to_te(model, list(artifact.converted_modules), device=device)
    if artifact.scaling_states:
        apply_scaling_state(model, artifact.scaling_states, artifact.recipe)
    model.eval()
    logger.info("loaded TE artifact %s: %d te.Linear layers", artifact.directory, len(artifact.converted_modules))
    return model
