"""Attention over a batch of right-padded texts, run text by text, so that each text's rows are the bits of a call
of that text alone.

Why the batched quality pass needs it: in a padded batch every other computation of a layer gives a text's rows
the bits they get alone (the Linears' GEMMs compute each row on its own on the CPU BLAS measured, norms and
activations work per position, the input casts scale each text on its own), but attention does not. SDPA's
reductions over the keys (the softmax's sums, the probabilities x values product) group their terms by the key
length, so a text padded to the batch's longest text gets other last bits, although the padding's terms are exact
zeros; and given a padding mask, transformers' SDPA call repeats the KV heads instead of running the kernel's
grouped-query path. Last-bit differences flip the bf16 roundings of an emulated bf16 model and, through a cast, whole
FP8 codes: the batched pass's figures moved while no cast had changed
(docs/benchmarks/quality-batching-2026-12-03f.md).

How: like :mod:`converters.quality.kv_cache`, :class:`attending_per_text` gives each attention module a view of its
config whose ``_attn_implementation`` names :data:`PER_TEXT_ATTENTION`, a kernel registered once that calls the
module's own kernel once per text on that text's positions, with the mask a call of the text alone gets (none for
SDPA, which then runs causal; the batch's mask cut to the text for the others).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from converters.quality.attention_views import kernel_named, register_attention, unwrap_configs, wrap_configs

__all__ = ["PER_TEXT_ATTENTION", "attending_per_text"]

#: the attention implementation name the per-text kernel is registered under
PER_TEXT_ATTENTION = "fp8forge_per_text"


def _own_mask(mask: torch.Tensor | None, row: int, length: int, implementation: str | None) -> torch.Tensor | None:
    """The mask text ``row`` of ``length`` positions gets called alone: the batch's cut to its positions, or none
    where that is plain causal attention and the kernel is SDPA (transformers hands SDPA no mask then)."""
    if mask is None:
        return None
    own = mask[row: row + 1, ..., :length, :length]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if implementation == "sdpa" and own.dtype == torch.bool and bool((own == causal).all()):
        return None
    return own


def _per_text_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    config = module.config
    texts, real = getattr(config, "per_text", None), getattr(config, "per_text_implementation", None)
    if texts is None:
        raise RuntimeError(f"{type(module).__name__} asked for {PER_TEXT_ATTENTION} outside attending_per_text")
    kernel = kernel_named(module, real)
    lengths = texts.lengths if texts.lengths is not None else [query.shape[2]] * query.shape[0]
    if len(lengths) != query.shape[0] or max(lengths) > query.shape[2]:
        raise ValueError(f"attending_per_text has lengths {lengths} for a batch of {query.shape[0]} texts of "
                         f"{query.shape[2]} positions")
    output = None
    for row, length in enumerate(lengths):
        own = (tensor[row: row + 1, :, :length] for tensor in (query, key, value))
        text_output, _ = kernel(module, *own, _own_mask(attention_mask, row, length, real), *args, **kwargs)
        if output is None:  # [texts, positions, heads, head_dim], the padding's rows zeros (no text reads them)
            output = text_output.new_zeros(query.shape[0], query.shape[2], *text_output.shape[2:])
        output[row, :length] = text_output[0]
    return output, None


class attending_per_text:  # noqa: N801 - a context manager read as a phrase: ``with attending_per_text(...)``
    """Inside the block, the attention modules at ``paths`` of ``model`` attend text by text: ``lengths`` (set
    between calls) is the positions of each right-padded text of the calls to come; None: every row of a call is a
    whole text. Enter it before :class:`~converters.quality.kv_cache.quantizing_kv_cache` (whose kernel then calls
    this one). Raises ValueError for a path that is not a module with a transformers config."""

    def __init__(self, model: nn.Module, paths: Iterable[str]) -> None:
        self.model, self.paths = model, list(paths)
        self.lengths: list[int] | None = None
        self._entered: list[nn.Module] = []

    def __enter__(self) -> attending_per_text:
        if self.paths:
            register_attention(PER_TEXT_ATTENTION, _per_text_attention)
        self._entered = wrap_configs(self.model, {path: {"per_text": self} for path in self.paths}, PER_TEXT_ATTENTION,
                                     "per_text_implementation",
                                     "batched texts attend text by text through ALL_ATTENTION_FUNCTIONS")
        return self

    def __exit__(self, *exc: Any) -> None:
        unwrap_configs(self._entered)
        self._entered = []
