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

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from converters.analysis.patterns import PatternError, matches
from converters.errors import ModelNotFoundError
from converters.model.config_checks import read_config_file
from converters.model.demo import DEMO_MODEL_REF
from converters.model.files import INDEX_NAME, SINGLE_FILE_NAME, model_file_reader
from converters.model.limits import read_index_file, read_safetensors_header
from converters.model.presence import check_local_model_present
from converters.model.sources import confinement_for, parse_model_reference, validate_model_reference

__all__ = ["check_include_on_disk", "check_local_model", "local_checkpoint_dir", "stored_module_paths"]

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


def check_local_model(ref: str, sources: Any, include: Iterable[str] = ()) -> None:
    """What the service checks of a local model's files before it queues a job or builds an analysis: config.json
    within ``sources.config_limits`` (``converters.model.config_checks.read_config_file``), then the include patterns
    (:func:`check_include_on_disk`). Every read is bounded; the API runs this in its analysis processes, never in
    its own. ``ref`` must have passed ``model_sources.validate_model_reference``.

    Raises:
        ModelNotFoundError (422): a local path that is not a readable directory with a config.json.
        ModelConfigError (422): config.json, the index or a header out of bounds, naming the file and the limit.
        PatternError (422): an include pattern that matches no stored module path.
    """
    validate_model_reference(ref, sources)  # in this process too: its reads keep to the confinement checked here
    reference = parse_model_reference(ref, sources)
    if reference.kind == "local" and reference.path is not None:  # a typo is a 422 now, not a failed job later
        check_local_model_present(reference.path, reference.text, confinement_for(sources))
    config = None
    if reference.kind == "local" and reference.path is not None and (reference.path / "config.json").is_file():
        config = read_config_file(reference.path / "config.json", sources.config_limits)
    directory = local_checkpoint_dir(ref, sources) if include else None
    if directory is not None and config is None and (directory / "config.json").is_file():
        config = read_config_file(directory / "config.json", sources.config_limits)  # the demo model's
    check_include_on_disk(directory, include, config)


def check_include_on_disk(directory: Path | None, include: Iterable[str], config: dict[str, Any] | None) -> None:
    """Refuse an include pattern that matches no module path stored in the checkpoint in ``directory``.

    Does nothing when ``directory`` or ``config`` is None, when ``directory`` is not a readable safetensors
    checkpoint, or for an MoE model.

    Args:
        config: the checkpoint's config.json as ``converters.model.config_checks.read_config_file`` read it.

    Raises:
        PatternError: naming ``include[i]`` and the pattern, with one of the checkpoint's paths as an example.
        ModelConfigError: the index or a header is larger than ``converters.model.limits`` allows.
    """
    include = list(include)
    if not include or directory is None or config is None:
        return
    try:
        paths = stored_module_paths(directory)
    except (OSError, ModelNotFoundError):
        return  # the worker reports what is wrong with the files
    if _has_experts(config) or not paths:
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
    """The module paths (tensor names less their last segment) of the checkpoint's safetensors files: the index's
    names, else the single file's header's, each read within ``converters.model.limits``' bounds.

    Raises:
        ModelNotFoundError: an index or file that is not a safetensors checkpoint.
        ModelConfigError: an index or header larger than the limits.
        OSError: a file cannot be read.
    """
    index = directory / INDEX_NAME
    if index.is_file():
        names: Iterable[Any] = read_index_file(index)["weight_map"]
    else:
        single = directory / SINGLE_FILE_NAME
        if not single.is_file():
            return set()
        with model_file_reader(single) as handle:  # the header only
            names = [name for name in read_safetensors_header(handle, name=single.name)[0] if name != "__metadata__"]
    return {name.rsplit(".", 1)[0] for name in names if isinstance(name, str) and "." in name}


def _has_experts(config: dict[str, Any]) -> bool:
    sections = [config, *(value for value in config.values() if isinstance(value, dict))]
    return any(isinstance(section.get(key), int) and section.get(key, 0) > 0
               for section in sections for key in _EXPERT_KEYS)
