"""Calibration data: the built-in corpus and the token batches every calibration, quality pass and KV search
runs over.

Texts are tokenized with the model's own tokenizer into one stream (documents separated by EOS, as packed training
data is) and fixed-length windows are drawn from it at offsets chosen by a seed, so the same request gives the same
batches on every worker and rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from converters.errors import CalibrationDataError

__all__ = ["CORPUS_PATH", "load_corpus", "calibration_batches"]

CORPUS_PATH = Path(__file__).parent / "data" / "calibration_corpus.txt"


def load_corpus() -> list[str]:
    """The built-in calibration corpus as a list of paragraphs."""
    text = CORPUS_PATH.read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def _check_positive(value: Any, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CalibrationDataError(f"{field} must be an integer >= 1, got {value!r}.", field=field)


def _clean_texts(texts: Any) -> list[str]:
    if not isinstance(texts, (list, tuple)):
        raise CalibrationDataError(f"texts must be a list of strings, got {type(texts).__name__}.", field="texts")
    if not texts:
        raise CalibrationDataError("texts is empty; give at least one non-empty text or omit it.", field="texts")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise CalibrationDataError(f"texts[{i}] must be a string, got {type(text).__name__}.", field="texts")
    kept = [t for t in texts if t.strip()]
    if not kept:
        raise CalibrationDataError("Every text in texts is empty or whitespace.", field="texts")
    return kept


def _pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _token_stream(tokenizer: Any, texts: list[str], vocab_size: int) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    for text in texts:
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        stream.extend(ids)
        # A document separator, so that a window spanning two texts looks like real packed data.
        if isinstance(eos, int):
            stream.append(eos)
    if not stream:
        raise CalibrationDataError("The tokenizer produced no tokens for the calibration texts.", field="texts")
    top = max(stream)
    if top >= vocab_size:
        raise CalibrationDataError(
            f"The tokenizer produced token id {top}, but the model's vocabulary has {vocab_size} entries; "
            "use the tokenizer that belongs to this model.",
            field="tokenizer",
        )
    return stream


def calibration_batches(
    tokenizer: Any | None,
    *,
    vocab_size: int,
    texts: list[str] | None = None,
    steps: int,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
) -> tuple[list[dict[str, torch.Tensor]], str]:
    """Build ``steps`` batches of ``{"input_ids", "attention_mask"}`` (``[batch_size, seq_len]``, int64).

    Texts (the built-in corpus unless ``texts`` is given) are tokenized with the model's tokenizer into
    one stream (documents separated by EOS) and windows of ``seq_len`` tokens are drawn from it at
    offsets chosen by ``seed``. A stream shorter than ``seq_len`` is padded (pad token, else EOS) with
    ``attention_mask`` 0 on the padding. With ``tokenizer=None`` the ids are uniform random in
    ``[0, vocab_size)``, which gives activations unlike real text; the returned ``data_source`` says so.

    Returns ``(batches, data_source)``. Raises CalibrationDataError (naming the field) for an empty
    ``texts`` list, texts that are all empty, non-positive sizes or token ids outside the vocabulary.
    """
    for name, value in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len)):
        _check_positive(value, name)
    _check_positive(vocab_size, "vocab_size")
    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, seq_len)

    if tokenizer is None:
        batches = [
            {
                "input_ids": torch.randint(0, vocab_size, shape, generator=generator, dtype=torch.long),
                "attention_mask": torch.ones(shape, dtype=torch.long),
            }
            for _ in range(steps)
        ]
        return batches, f"random token ids (uniform over {vocab_size}; no tokenizer), seed {seed}"

    if texts is None:
        chosen, origin = load_corpus(), f"built-in corpus ({CORPUS_PATH.name})"
    else:
        chosen, origin = _clean_texts(texts), f"{len(texts)} user text(s)"
    stream = torch.tensor(_token_stream(tokenizer, chosen, vocab_size), dtype=torch.long)

    batches = []
    if stream.numel() < seq_len:
        ids = torch.full((seq_len,), _pad_id(tokenizer), dtype=torch.long)
        ids[: stream.numel()] = stream
        mask = torch.zeros(seq_len, dtype=torch.long)
        mask[: stream.numel()] = 1
        for _ in range(steps):
            batches.append({"input_ids": ids.expand(shape).clone(), "attention_mask": mask.expand(shape).clone()})
    else:
        last_start = stream.numel() - seq_len
        for _ in range(steps):
            starts = torch.randint(0, last_start + 1, (batch_size,), generator=generator)
            ids = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])
            batches.append({"input_ids": ids, "attention_mask": torch.ones(shape, dtype=torch.long)})
    return batches, f"{origin}, {stream.numel()} tokens, tokenized windows of {seq_len}, seed {seed}"
