"""Write the ready-to-run training configs into ``training/`` beside an artifact's weights."""

from __future__ import annotations

import os
from pathlib import Path

from converters.artifact.training.accelerate import accelerate_config, accelerate_unsupported
from converters.artifact.training.decisions import TrainingDecisions, read_training_decisions
from converters.artifact.training.megatron import (
    dump_with_comments,
    megatron_mixed_precision,
    megatron_precision_file,
    megatron_unsupported,
)
from converters.artifact.training.snippet import train_one_step_script
from converters.artifact.training.torchtitan import torchtitan_converters, torchtitan_note

__all__ = ["TRAINING_DIR", "training_files", "write_training_configs"]

TRAINING_DIR = "training"
ACCELERATE_FILE = "accelerate_config.yaml"
MEGATRON_FILE = "megatron_bridge.yaml"
MEGATRON_PRECISION_FILE = "te_precision_config.yaml"
TORCHTITAN_FILE = "torchtitan_converters.py"
SNIPPET_FILE = "train_one_step.py"


def training_files(decisions: TrainingDecisions) -> tuple[dict[str, str], list[str]]:
    """File name -> text of every config that expresses these decisions, and notes on what is not written and why."""
    files = {SNIPPET_FILE: train_one_step_script(decisions)}
    notes: list[str] = []
    if (text := accelerate_config(decisions)) is not None:
        files[ACCELERATE_FILE] = text
    else:
        notes.append(f"{ACCELERATE_FILE}: not written: {accelerate_unsupported(decisions)}")
    if (why := megatron_unsupported(decisions)) is None:
        fields, mp_notes = megatron_mixed_precision(decisions)
        precision, file_notes = megatron_precision_file(decisions)
        comments = [f"Megatron-Bridge ConfigContainer override for {decisions.recipe.library_class}, written by "
                    "fp8forge.",
                    "Merge into your recipe's YAML overrides; the fields are MixedPrecisionConfig's.", *mp_notes,
                    *file_notes]
        if precision is not None:
            comments.append(f"Per-module BF16 overrides: {MEGATRON_PRECISION_FILE} (pass it as "
                            "--te-precision-config-file, or model.quant_recipe = load_quantization_recipe(path)).")
            files[MEGATRON_PRECISION_FILE] = dump_with_comments(precision, [
                "Megatron-Core per-module TE precision config: these modules train in BF16, the rest in the recipe.",
                "Module paths assume pipeline-parallel size 1 (global block index = local index)."])
        files[MEGATRON_FILE] = dump_with_comments({"mixed_precision": fields}, comments)
    else:
        notes.append(f"{MEGATRON_FILE}: not written: {why}")
    if (text := torchtitan_converters(decisions)) is not None:
        files[TORCHTITAN_FILE] = text
    else:
        notes.append(f"{TORCHTITAN_FILE}: not written: {torchtitan_note(decisions)}")
    files["README.md"] = _readme(decisions, files, notes)
    return files, notes


def write_training_configs(directory: str | Path) -> list[str]:
    """Write ``training/*`` for the artifact in ``directory`` (its config.json and fp8_report.json written already);
    return the names written, relative to ``directory``. Each file goes through a temporary name.

    Raises ArtifactError when the artifact's config or report cannot be read.
    """
    directory = Path(directory)
    files, _ = training_files(read_training_decisions(directory))
    target = directory / TRAINING_DIR
    target.mkdir(exist_ok=True)
    for name, text in files.items():
        temporary = target / f".{name}.tmp"
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, target / name)
    return [f"{TRAINING_DIR}/{name}" for name in sorted(files)]


def _readme(decisions: TrainingDecisions, files: dict[str, str], notes: list[str]) -> str:
    kept = decisions.kept_high_precision
    lines = [f"# Training this artifact ({decisions.recipe.library_class})", "",
             "Written by fp8forge from the artifact's recipe and per-layer decisions.", "",
             *(f"- `{name}`" for name in sorted(files) if name != "README.md"), "",
             f"{len(decisions.linears) - len(kept)} Linears train in FP8, {len(kept)} in high precision:", "",
             *(f"- `{linear.path}`: {', '.join(linear.reasons)}" for linear in kept), ""]
    if notes:
        lines += ["Not written:", "", *(f"- {note}" for note in notes), ""]
    lines += ["`fp8forge check <artifact>` runs one step and reports, per Linear, whether its GEMMs ran in FP8.", ""]
    return "\n".join(lines)
