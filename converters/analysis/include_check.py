"""``include`` patterns checked against a local checkpoint's tensor names, before a job is queued.

The analysis refuses an include pattern that selects no Linear layer (``analysis.check_include_patterns``), but
it needs the model built, which the service leaves to its workers and analysis processes: a typo would be
accepted and fail a worker's job seconds later. A Linear's weight is stored as ``<module path>.weight``, so a
pattern that matches the module path of no tensor in the checkpoint's headers matches no Linear either. Reading
the headers costs milliseconds and no torch. The check stands aside where the files are not on this host (hub
models), for MoE models (transformers 5 holds their experts as units the files do not name) and for a tied
output head (``lm_head`` is not stored); the worker's analysis checks those.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from converters.analysis.patterns import PatternError, matches
from converters.errors import ModelNotFoundError
from converters.model.demo import DEMO_MODEL_REF
from converters.model.files import pinned_model_path, read_model_text
from converters.model.sources import parse_model_reference

__all__ = ["check_include_on_disk", "local_checkpoint_dir", "stored_module_paths"]

#: config.json keys that declare experts (Mixtral, Qwen-MoE, DeepSeek, gpt-oss, ...)
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
#: what transformers calls the output head of the models it ties to the input embedding
_TIED_HEADS = ("lm_head", "embed_out", "cls.predictions.decoder", "output")


def local_checkpoint_dir(ref: str, sources: Any) -> Path | None:
    """The directory ``ref`` names on this host without a download or a build: a local model's, or the demo
    model's once built; None for a hub model or a demo not built yet. ``ref`` must have passed
    ``model_sources.validate_model_reference``."""
    reference = parse_model_reference(ref, sources)
    if reference.kind == "local":
        return reference.path
    if reference.kind == "demo" and reference.path is not None:
        built = reference.path / DEMO_MODEL_REF.split("/")[1]
        return built if (built / "config.json").is_file() else None
    return None


def check_include_on_disk(directory: Path | None, include: Iterable[str]) -> None:
    """Refuse an include pattern that matches no module path stored in the checkpoint in ``directory``.

    Does nothing when ``directory`` is None or not a readable safetensors checkpoint, or for an MoE model.

    Raises:
        PatternError: naming ``include[i]`` and the pattern, with one of the checkpoint's paths as an example.
    """
    include = list(include)
    if not include or directory is None:
        return
    try:
        config = json.loads(read_model_text(directory / "config.json"))
        paths = stored_module_paths(directory)
    except (OSError, ValueError, ModelNotFoundError):
        return  # the worker reports what is wrong with the files
    if not isinstance(config, dict) or _has_experts(config) or not paths:
        return
    for index, pattern in enumerate(include):
        if _matches_tied_head(pattern, config) or any(matches(pattern, path) for path in paths):
            continue
        layers = sorted(path for path in paths if ".layers." in f".{path}.") or sorted(paths)
        raise PatternError(
            f"include[{index}]: pattern {pattern!r} matches no Linear layer of this model (its layers have paths "
            f"like {layers[len(layers) // 2]!r}); patterns match whole dotted path segments",
            field=f"include[{index}]",
        )


def _matches_tied_head(pattern: str, config: dict[str, Any]) -> bool:
    """A tied output head is not stored under its own name; a pattern may still name it."""
    tied = config.get("tie_word_embeddings", True)
    text = config.get("text_config")
    if isinstance(text, dict):
        tied = text.get("tie_word_embeddings", tied)
    return bool(tied) and any(matches(pattern, head) for head in _TIED_HEADS)


def stored_module_paths(directory: Path) -> set[str]:
    """The module paths (tensor names less their last segment) of the checkpoint's safetensors files.

    Raises:
        ModelNotFoundError: an index or file that is not a safetensors checkpoint.
        OSError: a file cannot be read.
    """
    from safetensors import SafetensorError, safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(read_model_text(index)).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelNotFoundError(f"{index.name} has no weight_map object")
        names: Iterable[Any] = weight_map
    else:
        single = directory / "model.safetensors"
        if not single.is_file():
            return set()
        try:  # the header only: the library reads and checks it, and maps no tensor
            with pinned_model_path(single) as pinned, safe_open(pinned, framework="numpy") as handle:
                names = list(handle.keys())
        except SafetensorError as exc:
            raise ModelNotFoundError(f"{single.name} is not a safetensors file: {exc}") from exc
    return {name.rsplit(".", 1)[0] for name in names if isinstance(name, str) and "." in name}


def _has_experts(config: dict[str, Any]) -> bool:
    sections = [config, *(value for value in config.values() if isinstance(value, dict))]
    return any(isinstance(section.get(key), int) and section.get(key, 0) > 0
               for section in sections for key in _EXPERT_KEYS)
