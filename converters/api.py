"""The library's front door: analyze a model, convert it, with a recipe given as data or as an object.

``import converters`` gives these two plus the loaders and recipe parsing (see ``converters/__init__.py``); a
script needs no module path below ``converters``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from converters.analysis.eligibility import analyze_model_reference
from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import ConversionResult, ProgressSink, run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.recipes import Recipe, default_recipe, recipe_from_dict

__all__ = ["analyze", "convert", "local_sources"]


def local_sources(*roots: str | Path, offline: bool = False) -> ModelSourceOptions:
    """Model sources for a script: local models below ``roots`` (default: the current directory) and the hub."""
    return ModelSourceOptions(allowed_roots=tuple(Path(root) for root in roots) or (Path.cwd(),), offline=offline)


def _recipe(recipe: Recipe | Mapping[str, Any] | None) -> Recipe:
    if recipe is None:
        return default_recipe("te")
    return recipe_from_dict(recipe) if isinstance(recipe, Mapping) else recipe


def analyze(model: str, *, recipe: Recipe | Mapping[str, Any] | None = None, sources: ModelSourceOptions | None = None,
            include: Iterable[str] = (), exclude: Iterable[str] = (), skip_first_last: bool = True,
            convert_router_gates: bool = False) -> dict[str, Any]:
    """The eligibility report of ``model`` (a hub id or a local directory) under ``recipe``; no weight is read.

    Raises Fp8ForgeError subclasses (bad reference, missing model, bad recipe or patterns).
    """
    parsed = _recipe(recipe)
    return analyze_model_reference(model, sources or local_sources(), backend=parsed.backend.value, include=include,
                                   exclude=exclude, skip_first_last=skip_first_last,
                                   convert_router_gates=convert_router_gates, recipe=parsed)


def convert(model: str, out_dir: str | Path, *, recipe: Recipe | Mapping[str, Any] | None = None,
            calibration: CalibrationSettings | None = None, serving_formats: Iterable[str] = (),
            sources: ModelSourceOptions | None = None, sink: ProgressSink | None = None,
            **request: Any) -> ConversionResult:
    """Convert ``model`` into an artifact at ``out_dir`` (which must not exist); ``request`` takes the other fields
    of :class:`~converters.pipeline.request.ConversionRequest` (``include``, ``exclude``, ``min_sqnr_db``, ...).

    Raises Fp8ForgeError subclasses; a failed run leaves nothing at ``out_dir``.
    """
    conversion = ConversionRequest(model=model, recipe=_recipe(recipe).to_dict(),
                                   calibration=calibration or CalibrationSettings(),
                                   serving_formats=tuple(serving_formats), **request)
    return run_conversion(conversion, Path(out_dir), sources or local_sources(), sink)
