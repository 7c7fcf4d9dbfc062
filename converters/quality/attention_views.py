"""Attention kernels the quality pass puts around transformers' own: each attention module gets a view of its config
whose ``_attn_implementation`` names a kernel registered in ``ALL_ATTENTION_FUNCTIONS``, and that kernel finds what
it needs (a KV cast, the texts' lengths) and the module's real kernel on the view. Views nest: the FP8-KV view
(:mod:`converters.quality.kv_cache`) wraps the per-text one (:mod:`converters.quality.text_attention`), each
attribute a view lacks falls through to the one it wraps, so each kernel keeps its fields under names of its own.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

__all__ = ["AttentionConfigView", "eager_attention_of", "kernel_named", "register_attention", "unwrap_configs",
           "wrap_configs"]

_REGISTER_LOCK = threading.Lock()


class AttentionConfigView:
    """An attention module's config as the module sees it while a wrapping kernel is on: every attribute is the real
    config's, but ``_attn_implementation`` names ``implementation``; ``fields`` are what that kernel reads."""

    def __init__(self, config: Any, implementation: str, **fields: Any) -> None:
        self.__dict__.update(fields, _real=config, _implementation=implementation)

    @property
    def _attn_implementation(self) -> str:
        return self.__dict__["_implementation"]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_real"], name)


def register_attention(name: str, kernel: Callable) -> None:
    """``kernel`` in transformers' ``ALL_ATTENTION_FUNCTIONS`` under ``name``, once."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # deferred: only a pass that wraps needs it

    with _REGISTER_LOCK:
        if ALL_ATTENTION_FUNCTIONS.get(name) is not kernel:
            ALL_ATTENTION_FUNCTIONS[name] = kernel


def wrap_configs(model: nn.Module, fields_by_path: Mapping[str, dict[str, Any]], implementation: str,
                 real_field: str, why: str) -> list[nn.Module]:
    """Each module at a path of ``fields_by_path`` gets a view of its config naming ``implementation`` with those
    fields, and the implementation it named before under ``real_field``; the modules, for :func:`unwrap_configs`.
    Raises ValueError (``why`` says what needs the config) for a path that is not a module with a transformers
    config."""
    wrapped = []
    for path, fields in fields_by_path.items():
        module = model.get_submodule(path)
        config = module.__dict__.get("config")
        if config is None or not hasattr(config, "_attn_implementation"):
            unwrap_configs(wrapped)
            raise ValueError(f"{path} is a {type(module).__name__} without a transformers config: {why}")
        module.__dict__["config"] = AttentionConfigView(config, implementation, **fields,
                                                        **{real_field: config._attn_implementation})
        wrapped.append(module)
    return wrapped


def unwrap_configs(modules: list[nn.Module]) -> None:
    """The configs :func:`wrap_configs` gave ``modules`` replaced by the ones they wrapped."""
    for module in modules:
        module.__dict__["config"] = module.__dict__["config"].__dict__["_real"]


def kernel_named(module: nn.Module, implementation: str | None) -> Callable:
    """The attention kernel ``implementation`` names for ``module`` (eager: its modeling file's)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # deferred: only a pass that wraps needs it

    return eager_attention_of(module) if implementation in (None, "eager") else ALL_ATTENTION_FUNCTIONS[implementation]


def eager_attention_of(module: nn.Module) -> Callable:
    """The ``eager_attention_forward`` of ``module``'s modeling file (transformers' fallback kernel, which
    ``ALL_ATTENTION_FUNCTIONS`` does not hold); ValueError when the file defines none."""
    function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if function is None:
        raise ValueError(f"{type(module).__name__} runs eager attention but its module defines no "
                         "eager_attention_forward: the quality pass cannot wrap its attention (FP8 KV cache, "
                         "texts one by one)")
    return function
