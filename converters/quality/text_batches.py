"""The quality pass's texts as token ids, and those batched as the calibration's batches are: several texts a call,
right-padded to the longest of the batch (the attention mask hides the padding). A batch scores as its texts one a
call would, to the bit: the texts attend one by one (:mod:`converters.quality.text_attention`), the input casts take
a scale from a call's amax per text (``casting_linears.lengths``), and every other computation of a layer gives a
text's rows the bits they get alone (the GEMMs too, for a text of ``ALONE_BELOW_TOKENS`` tokens or more).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from converters.quality.figures import QualityUnavailable

__all__ = ["ALONE_BELOW_TOKENS", "BATCH_POSITIONS", "TextBatch", "batched", "token_texts"]

#: padded positions (texts x the longest one's tokens) a batch of texts holds at most: every text at the default
#: max_tokens in one call a layer and stream, where one text a call paid each call's fixed work once per text
BATCH_POSITIONS = 1024
#: texts shorter than this run alone: the CPU BLAS computes a GEMM of so few rows with another kernel than the rows
#: of a bigger one, so such a text's rows in a batch would not get the bits they get alone (measured on MKL's fp32
#: GEMM: below 12 rows; docs/benchmarks/quality-batching-2026-12-03f.md)
ALONE_BELOW_TOKENS = 16


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
