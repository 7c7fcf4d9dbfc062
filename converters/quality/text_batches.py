"""The quality pass's texts as token ids, and those batched as the calibration's batches are: several texts a call,
right-padded to the longest of the batch (the attention mask hides the padding). A batch scores as its texts one a
call would, to the bit: the texts attend one by one (:mod:`converters.quality.text_attention`), the input casts take
a scale from a call's amax per text (``casting_linears.lengths``), and every other computation of a layer gives a
text's rows the bits they get alone (the GEMMs too, for a text of ``ALONE_BELOW_TOKENS`` tokens or more).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from converters.quality.figures import QualityUnavailable

__all__ = ["ALONE_BELOW_TOKENS", "BATCH_POSITIONS", "TextBatch", "batched", "rows_keep_their_bits", "token_texts"]

#: padded positions (texts x the longest one's tokens) a batch of texts holds at most: every text at the default
#: max_tokens in one call a layer and stream, where one text a call paid each call's fixed work once per text
BATCH_POSITIONS = 1024
#: texts shorter than this run alone: the CPU BLAS computes a GEMM of so few rows with another kernel than the rows
#: of a bigger one, so such a text's rows in a batch would not get the bits they get alone (measured on MKL's fp32
#: GEMM: below 12 rows; docs/benchmarks/quality-batching-2026-12-03f.md)
ALONE_BELOW_TOKENS = 16
#: text lengths whose rows :func:`rows_keep_their_bits` compares alone and inside a call of ``_PROBE_CALL_ROWS``,
#: at two offsets: around the short-text rule's bound, and longer texts
_PROBE_ROWS = (ALONE_BELOW_TOKENS, ALONE_BELOW_TOKENS + 1, 23, 40, 64)
_PROBE_CALL_ROWS = 96


@dataclass
class TextBatch:
    """Texts scored in one call: the model's inputs, right-padded to the longest text, and each text's tokens."""

    inputs: dict[str, Any]
    lengths: list[int] = field(default_factory=list)


def token_texts(tokenizer: Any, texts: list[str], max_tokens: int, seq_len: int) -> list[list[int]]:
    """Each text's token ids, cut to ``seq_len`` tokens, until ``max_tokens`` positions are scored."""
    tokens, scored = [], 0
    for text in texts:
        if not isinstance(text, str):
            raise QualityUnavailable(f"quality texts must be strings, got {type(text).__name__}", field="quality_texts")
        room = min(seq_len, max_tokens - scored + 1)
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])[:room]
        if len(ids) < 2:
            continue
        tokens.append(ids)
        scored += len(ids) - 1
        if scored >= max_tokens:
            break
    if not tokens:
        raise QualityUnavailable("the quality texts give no text of two tokens or more: nothing to score",
                                 field="quality_texts")
    return tokens


def batched(tokens: list[list[int]], tokenizer: Any, model: nn.Module, *, one_a_call: bool = False
            ) -> list[TextBatch]:
    """The texts in order, as many a batch as keep it within ``BATCH_POSITIONS`` padded positions (at least one),
    each right-padded to its batch's longest (the padding's id is any valid one: the mask hides it); a text of fewer
    than ``ALONE_BELOW_TOKENS`` tokens in a batch of its own. ``one_a_call``: every text in a batch of its own."""
    accepted = inspect.signature(model.forward).parameters
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    batches = []
    for group in [[ids] for ids in tokens] if one_a_call else _groups(tokens):
        width = max(map(len, group))
        inputs = {"input_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids in group]),
                  "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in group])}
        if "use_cache" in accepted:
            inputs["use_cache"] = False
        batches.append(TextBatch(inputs=inputs, lengths=[len(ids) for ids in group]))
    return batches


def rows_keep_their_bits(shapes: set[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this machine's GEMM gives a text's rows (``ALONE_BELOW_TOKENS`` or more) the bits they get alone when
    they sit inside a bigger call, for Linears of ``shapes`` (in, out features) computing in ``dtype``: the
    precondition of batching to the bit. Measured on MKL's fp32 GEMM on one CPU kind; another BLAS, CPU kind or
    native half-precision kernel may group a row's sums by the call's size, and the pass then scores one text a
    call rather than report figures that depend on a text's neighbours."""
    return all(_rows_keep_their_bits(shape, dtype, str(device)) for shape in sorted(shapes))


@functools.cache
def _rows_keep_their_bits(shape: tuple[int, int], dtype: torch.dtype, device: str) -> bool:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(_PROBE_CALL_ROWS, shape[0], generator=generator).to(device=device, dtype=dtype)
    weight = torch.randn(shape[1], shape[0], generator=generator).to(device=device, dtype=dtype)
    with torch.no_grad():
        whole = torch.nn.functional.linear(inputs, weight)
        return all(torch.equal(torch.nn.functional.linear(inputs[start:start + rows], weight),
                               whole[start:start + rows])
                   for rows in _PROBE_ROWS for start in (0, _PROBE_CALL_ROWS - rows))


def _groups(tokens: list[list[int]]) -> list[list[list[int]]]:
    groups: list[list[list[int]]] = []
    for ids in tokens:
        group = groups[-1] if groups else None
        if (group is None or len(ids) < ALONE_BELOW_TOKENS or len(group[0]) < ALONE_BELOW_TOKENS
                or (len(group) + 1) * max(len(ids), *map(len, group)) > BATCH_POSITIONS):
            groups.append([ids])
        else:
            group.append(ids)
    return groups
