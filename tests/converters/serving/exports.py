"""What the serving-export tests share: a tiny bf16 Llama, converted with some serving formats, and a cosine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from converters.model.demo import build_tiny_llama
from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest

__all__ = ["CALIBRATION", "tiny_llama", "export", "cosine"]

CALIBRATION = CalibrationSettings(steps=3, seq_len=32)


def tiny_llama(tmp_path_factory: Any, name: str) -> Path:
    """A tiny bf16 Llama (config, safetensors, tokenizer) in a fresh directory of its own."""
    return build_tiny_llama(tmp_path_factory.mktemp(name) / "llama")


def export(model_dir: Path, formats: tuple[str, ...], *, calibration: CalibrationSettings = CALIBRATION,
           **request: Any) -> Path:
    """Convert ``model_dir`` (TE recipe unless ``request`` says otherwise) writing ``formats``; the output dir."""
    out = model_dir.parent / "out"
    request.setdefault("recipe", {"backend": "te"})
    run_conversion(ConversionRequest(model=str(model_dir), calibration=calibration, serving_formats=formats,
                                     **request), out, ModelSourceOptions(allowed_roots=(model_dir.parent,)))
    return out


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))
