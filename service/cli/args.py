"""The flags the ``fp8forge`` commands share, and what they build: model sources, calibration settings."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from converters.errors import CalibrationDataError, RecipeError
from converters.model.sources import ModelSourceOptions
from converters.pipeline.request import MIN_SQNR_DB_RANGE, CalibrationSettings
from converters.recipes import load_recipe_file, recipe_from_dict
from converters.recipes.presets import RECIPE_NAMES
from service.config import load_settings

__all__ = ["add_source_arguments", "add_selection_arguments", "add_calibration_arguments", "add_min_sqnr_argument",
           "calibration_from_args", "source_options_from_args", "recipe_file", "recipe_file_warned"]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model sources")
    group.add_argument(
        "--allow-root",
        action="append",
        default=None,
        metavar="DIR",
        help="directory below which local models are accepted (repeatable; default: "
        "$FP8FORGE_ALLOWED_MODEL_ROOTS, else the current directory)",
    )
    group.add_argument("--cache-dir", default=None, help="Hugging Face cache (default: $FP8FORGE_HF_CACHE or HF's)")
    group.add_argument("--offline", action="store_true", help="use only the HF cache, never the network")
    group.add_argument("--trust-remote-code", action="store_true", help="allow model code shipped with checkpoints")


def add_selection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default=None, type=str.lower, choices=("te", "ao"), help="FP8 backend")
    parser.add_argument("--include", action="append", default=[], metavar="PAT", help="only convert matching layers")
    parser.add_argument("--exclude", action="append", default=[], metavar="PAT", help="never convert matching layers")
    parser.add_argument(
        "--no-skip-first-last", action="store_true", help="also convert the first and last nn.Linear"
    )
    parser.add_argument("--convert-router-gates", action="store_true", help="also convert MoE router gates")


def source_options_from_args(args: argparse.Namespace) -> ModelSourceOptions:
    """``ModelSourceOptions`` from the CLI flags over the server's settings (``FP8FORGE_*``, read by ``Settings``).

    The CLI differs from the server where a local user wants it to: local roots default to the current directory,
    errors may name them, and the demo model is built in the user's cache. Raises SettingsError for a malformed
    ``FP8FORGE_*`` variable.
    """
    settings = load_settings()
    roots = args.allow_root if args.allow_root is not None else settings.allowed_model_roots or [os.getcwd()]
    cache_dir = args.cache_dir or settings.hf_cache
    offline = args.offline or settings.hf_offline or _env_flag("HF_HUB_OFFLINE")
    # The built-in demo model works in the CLI as in the service, built once into the user's cache.
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return ModelSourceOptions(
        allowed_roots=tuple(Path(root) for root in roots),
        cache_dir=Path(cache_dir) if cache_dir else None,
        offline=offline,
        trust_remote_code=args.trust_remote_code,
        demo_dir=cache_home / "fp8forge" / "demo-models",
        config_limits=settings.config_limits(),
    )


def add_calibration_arguments(parser: argparse.ArgumentParser, *, backward: bool = True) -> None:
    parser.add_argument("--calib-steps", type=int, default=None, help="calibration steps (default: 16)")
    parser.add_argument("--calib-batch-size", type=int, default=None, help="sequences per step (default: 2)")
    parser.add_argument("--calib-seq-len", type=int, default=None, help="tokens per sequence (default: 128)")
    parser.add_argument("--calib-texts", type=Path, help="text file, one calibration sample per paragraph")
    if backward:
        parser.add_argument("--calib-backward", action="store_true", help="also record gradient amax")


def _sqnr_threshold(text: str) -> float:
    low, high = MIN_SQNR_DB_RANGE
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of dB: {text!r}") from None
    if not low <= value <= high:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be from {low:g} to {high:g} dB, got {text}")
    return value


def add_min_sqnr_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--min-sqnr-db", type=_sqnr_threshold, default=None, metavar="DB",
                        help=f"{what} every layer whose output SQNR under the recipe is below DB (reason low_sqnr)")


def _read_texts(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationDataError(f"cannot read --calib-texts {path}: {exc}", field="calib_texts") from exc
    return [paragraph.strip() for paragraph in text.split("\n\n") if paragraph.strip()]


def calibration_from_args(args: argparse.Namespace):
    """``CalibrationSettings`` from the ``--calib-*`` flags (library defaults for those not given)."""
    defaults = CalibrationSettings()
    return CalibrationSettings(
        steps=args.calib_steps if args.calib_steps is not None else defaults.steps,
        batch_size=args.calib_batch_size if args.calib_batch_size is not None else defaults.batch_size,
        seq_len=args.calib_seq_len if args.calib_seq_len is not None else defaults.seq_len,
        texts=tuple(_read_texts(args.calib_texts)) if args.calib_texts else None,
        backward=getattr(args, "calib_backward", False),
    )


def recipe_file(path: Path) -> tuple[dict[str, Any], list[str]]:
    """A recipe file (or a recipe's short name, :data:`RECIPE_NAMES`) as the request's recipe object, and the
    warnings only the file can give.

    An Accelerate config's keys that do not apply (the delayed-scaling keys beside ``use_mxfp8_block_scaling``)
    are dropped from the recorded recipe, so the pipeline, which sees only that object, cannot name them.
    """
    if str(path) in RECIPE_NAMES and not path.exists():  # a short name, as `fp8forge compare` prints them
        return recipe_from_dict(RECIPE_NAMES[str(path)]).to_dict(), []
    if not path.exists() and path.suffix not in (".json", ".yaml", ".yml"):
        raise RecipeError(f"--recipe {path}: no such recipe file, nor a recipe name; give a JSON or Accelerate YAML "
                          f"file, or one of {', '.join(RECIPE_NAMES)}", field="recipe")
    parsed = load_recipe_file(path)
    recipe = parsed.to_dict()
    recorded = set(recipe_from_dict(recipe).warnings())
    dropped = getattr(parsed, "accelerate_ignored", ())
    if dropped:  # one line for the lot, rather than one per key
        return recipe, [f"{path}: use_mxfp8_block_scaling drops {', '.join(dropped)}: delayed-scaling keys that "
                        f"{parsed.library_class} has no use for (Accelerate drops them too); they are not recorded"]
    return recipe, [f"{path}: {note}" for note in parsed.warnings() if note not in recorded]


def recipe_file_warned(path: Path) -> dict[str, Any]:
    """:func:`recipe_file` for the commands that write no report: its warnings go to stderr now."""
    recipe, notes = recipe_file(path)
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    return recipe
