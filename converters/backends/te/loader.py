"""Load an fp8forge TransformerEngine artifact back into a model with te.Linear layers and their FP8 state.

An artifact directory holds the source's weight files unchanged, a Hugging Face ``config.json`` with an
``fp8`` block::

    "fp8": {"backend": "te", "recipe": {...recipe.to_dict()...}, "converted_modules": ["model.layers.0...", ...],
            "converted_experts": ["model.layers.0.mlp.experts.gate_up_proj", ...],
            "te_recipe": {"class": "MXFP8BlockScaling", "kwargs": {...}, "qparams": {...}}}

``recipe`` is any TE recipe (delayed, current, MXFP8, FP8 block, NVFP4 scaling); the loader builds exactly that
TE recipe class with its recorded fields (``build_te_recipe``), never TE's default. Only delayed scaling has
``fp8_state.safetensors`` with the four scaling-state keys of
:mod:`converters.backends.te.layout` per converted layer and per converted experts GEMM (``te.GroupedLinear`` state,
:mod:`converters.backends.te.grouped`). TE's own pickled ``<layer>._extra_state`` keys (opt-in
artifact mode) are never unpickled here: the plain tensors carry the same numbers.

:func:`read_te_artifact` needs no TE and runs anywhere; :func:`load_te` checks for CUDA and TE before
reading anything, and hands back the artifact's recipe with the model (``model.fp8_recipe``): TE's default
recipe (MXFP8 on Blackwell, history length 1024 on Hopper) would drop or resize the seeded state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from converters.artifact.layout import FP8_BLOCK_VERSION, STATE_FILE, read_fp8_block
from converters.backends.te.grouped import (
    GroupedExperts,
    apply_grouped_state,
    check_grouped_state,
    convert_experts_to_te,
)
from converters.backends.te.layout import TE_STATE_NAMES, split_state_key
from converters.backends.te.reseed import reseed_from_calibration
from converters.backends.te.runtime import build_te_recipe, require_te, te_align_size, te_recipe_spec
from converters.backends.te.state import apply_scaling_state, check_state_tensors
from converters.backends.te.swap import convert_to_te
from converters.errors import ArtifactError, ConversionError, ModelNotFoundError, RecipeError
from converters.model.experts import EXPERT_GEMMS
from converters.model.sources import ModelSourceOptions, load_model, load_tokenizer
from converters.recipes import Backend, recipe_from_dict
from converters.recipes.requirements import hardware_unmet_here

__all__ = ["TEArtifact", "read_te_artifact", "load_te_model"]

logger = logging.getLogger(__name__)

_EXTRA_STATE_SUFFIX = "._extra_state"


@dataclass(frozen=True, kw_only=True)
class TEArtifact:
    """What an artifact directory holds besides its weights, read and checked (tensors on the CPU)."""

    directory: Path
    recipe: Any  #: a TE recipe of converters.recipes (``backend`` te)
    converted_modules: tuple[str, ...]
    #: layer path -> {te_layout name -> tensor}; empty for every recipe but delayed scaling.
    scaling_states: dict[str, dict[str, torch.Tensor]] = field(repr=False)
    #: TE ``_extra_state`` keys found and ignored.
    ignored_keys: tuple[str, ...] = ()
    #: ``<experts module>.<gate_up_proj|down_proj>`` run on te.GroupedLinear.
    converted_experts: tuple[str, ...] = ()
    #: experts GEMM -> {te_layout name -> GroupedLinear-shaped tensor}; empty but for delayed scaling.
    expert_states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)


def read_te_artifact(directory: str | Path) -> TEArtifact:
    """Read and check an artifact's fp8 block and FP8 state (no TE, no weights read).

    Raises ArtifactError when the directory or its config.json is not an fp8forge TE artifact; RecipeError
    for an invalid recipe; ModelNotFoundError for a missing or unreadable state file; ConversionError when
    the state keys do not match ``converted_modules``, ``converted_experts`` and the recipe.
    """
    directory = Path(directory)
    fp8 = read_fp8_block(directory, "te")
    if fp8.get("version") != FP8_BLOCK_VERSION:
        raise ArtifactError(f"{directory} has an fp8 block of version {fp8.get('version')!r}; this fp8forge reads "
                            f"version {FP8_BLOCK_VERSION} (state in {STATE_FILE}): convert the model again")
    try:
        recipe = recipe_from_dict(fp8.get("recipe"))
    except RecipeError as exc:
        raise RecipeError(f"{directory}: fp8.recipe: {exc.message}", field=exc.field) from exc
    if recipe.backend is not Backend.TE:
        raise RecipeError(f"{directory}: fp8.recipe is not a TransformerEngine recipe", field="backend")
    _check_te_recipe_record(directory, recipe, fp8.get("te_recipe"))
    converted = _path_list(directory, fp8, "converted_modules")
    experts = _path_list(directory, fp8, "converted_experts", default=[])
    if any(path.rpartition(".")[2] not in EXPERT_GEMMS for path in experts):
        raise ModelNotFoundError(f"{directory}: fp8.converted_experts must name <experts module>.<gemm> paths, "
                                 f"gemm one of {EXPERT_GEMMS}")
    states, ignored = _split_keys(_read_state_file(directory, fp8))
    _check_states(directory, recipe, converted + experts, states)
    expert_states = {path: states.pop(path) for path in experts if path in states}
    for path, tensors in expert_states.items():
        check_grouped_state(path, tensors, recipe.amax_history_len)
    for path, tensors in states.items():
        check_state_tensors(path, tensors, recipe.amax_history_len)
    return TEArtifact(directory=directory, recipe=recipe, converted_modules=tuple(converted),
                      scaling_states=states, ignored_keys=tuple(ignored), converted_experts=tuple(experts),
                      expert_states=expert_states)


def _path_list(directory: Path, fp8: dict[str, Any], name: str, default: list[str] | None = None) -> list[str]:
    paths = fp8.get(name, default)
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths) \
            or len(set(paths)) != len(paths):
        raise ModelNotFoundError(f"{directory}: fp8.{name} must be a list of distinct module paths")
    return paths


def _read_state_file(directory: Path, fp8: dict[str, Any]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file


    name = fp8.get("state_file")
    if name is None:
        return {}
    if name != STATE_FILE or not (directory / name).is_file():
        raise ModelNotFoundError(f"{directory}: fp8.state_file names {name!r}, which is not {STATE_FILE} in "
                                 "the artifact; re-download the artifact")
    try:
        return load_file(directory / name)
    except (OSError, SafetensorError) as exc:
        raise ModelNotFoundError(f"{directory / name}: cannot read safetensors: {exc}") from exc


def _split_keys(tensors: dict[str, torch.Tensor]) -> tuple[dict, list[str]]:
    states: dict[str, dict[str, torch.Tensor]] = {}
    ignored = []
    for key, tensor in tensors.items():
        split = split_state_key(key)
        if split is not None:
            states.setdefault(split[0], {})[split[1]] = tensor
        elif key.endswith(_EXTRA_STATE_SUFFIX):
            ignored.append(key)
        else:
            raise ConversionError(f"fp8_state.safetensors holds {key!r}, which is not scaling state")
    if ignored:
        logger.info("ignoring %d TE _extra_state keys (pickles); the plain state tensors are used", len(ignored))
    return states, sorted(ignored)


def _check_te_recipe_record(directory: Path, recipe: Any, recorded: Any) -> None:
    """``fp8.te_recipe`` (written since TE block recipes; absent before) must be what ``fp8.recipe`` builds."""
    if recorded is not None and recorded != te_recipe_spec(recipe):
        raise ArtifactError(f"{directory}: fp8.te_recipe {recorded!r} is not what fp8.recipe describes "
                            f"({te_recipe_spec(recipe)!r}); the artifact was edited: convert the model again")


def _check_states(directory: Path, recipe: Any, converted: list[str], states: dict[str, dict]) -> None:
    if not recipe.stateful:
        if states:
            kind = recipe.scaling.value.replace("_", " ")
            raise ConversionError(f"{directory}: a {kind}-scaling artifact ({recipe.te_class_name}, stateless) carries "
                                  f"scaling state for {sorted(states)[:3]}; the recipe and the tensors disagree")
        return
    extra, missing = sorted(set(states) - set(converted)), sorted(set(converted) - set(states))
    if extra or missing:
        raise ConversionError(f"{directory}: scaling state does not match fp8.converted_modules and "
                              f"fp8.converted_experts (state without a converted module: {extra[:3]}; converted "
                              f"without state: {missing[:3]}); each converted layer needs {list(TE_STATE_NAMES)}")


def load_te_model(directory: str | Path, sources: ModelSourceOptions | None = None, *,
                  device: str | torch.device = "cuda", reseed_steps: int = 0) -> nn.Module:
    """Load an fp8forge TE artifact: the HF model with ``fp8.converted_modules`` as te.Linear and the experts
    GEMMs of ``fp8.converted_experts`` as te.GroupedLinear (in :class:`~converters.backends.te.grouped.GroupedExperts`)
    on ``device`` and, for delayed scaling, the scaling state of the files in each of them. The model is returned
    in eval mode with ``model.fp8_recipe``, the TE recipe to run it under
    (``te.autocast(enabled=True, recipe=model.fp8_recipe)``).

    ``reseed_steps`` > 0 (delayed scaling): the te.Linear state is not the file's but re-seeded from that many
    calibration steps on the loaded weights (:mod:`converters.backends.te.resume`), for a run whose scales went stale.

    Raises BackendUnavailableError without CUDA/TE (checked before anything is read), the errors of
    :func:`read_te_artifact` and of loading the weights, and ConversionError from the swap or the state.
    """
    require_te()
    artifact = read_te_artifact(directory)
    te_recipe = build_te_recipe(artifact.recipe)  # before the weights: a TE without the recipe class fails here
    if (why := hardware_unmet_here(artifact.recipe)) is not None:
        logger.warning("%s; the model loads, but FP8 steps under model.fp8_recipe need %s", why,
                       artifact.recipe.hardware().needs)
    directory = Path(directory).resolve()
    sources = sources or ModelSourceOptions(allowed_roots=(directory,))
    model = load_model(directory, sources)
    states = artifact.scaling_states
    if reseed_steps:  # on the weights as loaded, before the swap: the recorder reads nn.Linear inputs and outputs
        states = reseed_from_calibration(model.to(device), artifact.converted_modules, artifact.recipe,
                                         tokenizer=load_tokenizer(directory, sources), steps=reseed_steps)
    if artifact.converted_experts:  # first: convert_to_te moves the whole model, experts built on device already
        convert_experts_to_te(model, list(artifact.converted_experts), device=device)
        for module in model.modules():  # te_grouped pads splits for FP8 per-tensor (16); MXFP8 and NVFP4 need more
            if isinstance(module, GroupedExperts):
                module.align = te_align_size(artifact.recipe)
    convert_to_te(model, list(artifact.converted_modules), device=device)
    if states:
        apply_scaling_state(model, states, artifact.recipe)
    if artifact.expert_states:
        apply_grouped_state(model, artifact.expert_states, artifact.recipe)
    model.fp8_recipe = te_recipe
    model.eval()
    logger.info("loaded TE artifact %s: %d te.Linear layers, %d experts GEMMs on te.GroupedLinear",
                artifact.directory, len(artifact.converted_modules), len(artifact.converted_experts))
    return model
