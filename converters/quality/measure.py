"""Layer-sequential quality pass: the source and its FP8 variants side by side, one layer in memory at a time.

Pass 1 runs the modules around the layers once per text and records what each layer is called with (the
calibration's machinery, :mod:`converters.calibration.sequential`). Pass 2 loads each layer once and runs every
text through it as the source (the reference stream) and once per FP8 variant, each on that variant's own
hidden states from the layer before, with its Linears cast (:mod:`converters.quality.casts`). The head pass
replays the final hidden states of each stream through the model's final norm, and the output head scores
them a slice of positions at a time: no ``[tokens, vocab]`` tensor of the whole text, and never the whole model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from converters.calibration.compute import emulating, restore_dtypes, tensor_dtypes
from converters.calibration.emulation import fake_quantize

# The calibration's pass-1 and replay machinery, shared so that both passes see the layers called the same way.
from converters.calibration.sequential import (
    LayerStack,
    SequentialStats,
    _choose_compute,
    _LayerStandIn,
    _module_path,
    _Passes,
    _Replay,
    _run_around_layers,
    _StopForward,
    _under,
    find_layer_stack,
)
from converters.errors import ConversionCancelled, Fp8ForgeError
from converters.model.checkpoint import Checkpoint, release, unit_keys
from converters.model.sources import ModelSourceOptions, build_meta_model, load_config, load_tokenizer, model_dtype
from converters.quality.casts import LayerCast, cast_linear_weight, casting_linears
from converters.quality.figures import QualityFigures, TokenScores
from converters.quality.held_out import BUILT_IN_HELD_OUT, REQUEST_TEXTS, held_out_part

__all__ = ["QualitySource", "QualityUnavailable", "load_source", "measure_quality", "measure_qualities",
           "DEFAULT_MAX_TOKENS", "DEFAULT_SEQ_LEN"]

DEFAULT_MAX_TOKENS = 256
DEFAULT_SEQ_LEN = 256
_HEAD_POSITIONS = 64  # positions scored at a time: two [64, vocab] fp32 logits (33 MB each for a 128k vocab)


class QualityUnavailable(Fp8ForgeError):
    """The model cannot be scored on next-token prediction (no output head, no tokenizer, not layer-sequential),
    or the texts give nothing to score. A job reports it (quality not measured, and why) and goes on."""

    code = "quality_unavailable"


@dataclass
class QualitySource:
    """A source model opened for the quality pass: meta model, checkpoint, layer list and tokenizer."""

    model: nn.Module
    checkpoint: Checkpoint
    stack: LayerStack
    tokenizer: Any


def load_source(directory: Path, sources: Any = None) -> QualitySource:
    """Open the model in ``directory`` on the meta device (no weight is read).

    Raises QualityUnavailable for a model without an output head or a tokenizer, or whose layers the
    layer-sequential pass cannot walk.
    """
    sources = sources or ModelSourceOptions(allowed_roots=(Path(directory).resolve().parent,))
    config = load_config(Path(directory), sources)
    model = build_meta_model(config, sources)
    if model.get_output_embeddings() is None:
        raise QualityUnavailable(f"{type(model).__name__} has no language-model head: next-token quality (perplexity, "
                                 "KL, top-1 agreement) applies to decoder LMs only", field="model")
    stack, why = find_layer_stack(model)
    if stack is None or getattr(config, "is_encoder_decoder", False):
        raise QualityUnavailable(f"the quality pass runs layer by layer and this model does not fit: {why}",
                                 field="model")
    tokenizer = load_tokenizer(Path(directory), sources)
    if tokenizer is None:
        raise QualityUnavailable("the model ships no tokenizer: quality is measured on text", field="model")
    checkpoint = Checkpoint(Path(directory), model, dtype=model_dtype(config), device="cpu")
    return QualitySource(model=model, checkpoint=checkpoint, stack=stack, tokenizer=tokenizer)


def measure_quality(source: Path | QualitySource, layer_casts: Mapping[str, LayerCast | None],
                    texts: Sequence[str] | None = None, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                    seq_len: int = DEFAULT_SEQ_LEN, should_stop: Callable[[], bool] | None = None) -> QualityFigures:
    """The FP8 model given by ``layer_casts`` (Linear path -> its cast; None or absent: high precision) against
    its source, on ``texts`` (None: the built-in held-out part), at most ``max_tokens`` scored positions, each
    text cut to ``seq_len`` tokens. See :func:`measure_qualities` for what it raises."""
    return measure_qualities(source, {"fp8": layer_casts}, texts, max_tokens=max_tokens, seq_len=seq_len,
                             should_stop=should_stop)["fp8"]


def measure_qualities(source: Path | QualitySource, variants: Mapping[str, Mapping[str, LayerCast | None]],
                      texts: Sequence[str] | None = None, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                      seq_len: int = DEFAULT_SEQ_LEN, should_stop: Callable[[], bool] | None = None,
                      on_layer: Callable[[int, int], None] | None = None) -> dict[str, QualityFigures]:
    """Several FP8 variants in one pass: the reference runs once; each variant's stream runs beside it.

    Raises QualityUnavailable (see :func:`load_source`; also texts that give fewer than two tokens),
    ConversionCancelled when ``should_stop()`` turns true between layers, ValueError for a cast on a module
    that is not a Linear of the model.
    """
    if isinstance(source, (str, Path)):
        source = load_source(Path(source))
    if max_tokens < 1 or seq_len < 2:
        raise ValueError(f"max_tokens must be >= 1 and seq_len >= 2, got {max_tokens} and {seq_len}")
    held_out = REQUEST_TEXTS if texts is not None else BUILT_IN_HELD_OUT
    batches = _token_batches(source, list(texts) if texts is not None else held_out_part(), max_tokens, seq_len)
    model = source.model
    known = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    for casts in variants.values():
        unknown = sorted(set(casts) - known)
        if unknown:
            raise ValueError(f"layer_casts names modules that are not Linears of the model: {unknown[:5]}")
    # Variants with the same casts (TE delayed without calibrated amax and TE current; a recipe compared with
    # itself) run once.
    unique: dict[frozenset, str] = {}
    for name, casts in variants.items():
        unique.setdefault(frozenset((path, cast) for path, cast in casts.items() if cast is not None), name)
    runs = {name: variants[name] for name in unique.values()}
    streams, passes = _run_layers(source, batches, runs, should_stop, on_layer)
    scores = _score_heads(source, batches, streams, passes, runs)
    return {name: scores[unique[frozenset((path, cast) for path, cast in casts.items() if cast is not None)]]
            .figures(texts=len(batches), held_out=held_out) for name, casts in variants.items()}


def _token_batches(source: QualitySource, texts: list[str], max_tokens: int, seq_len: int) -> list[dict[str, Any]]:
    """One text a step (batch 1, no padding), cut to ``seq_len`` tokens, until ``max_tokens`` positions are scored."""
    batches, scored = [], 0
    accepted = inspect.signature(source.model.forward).parameters
    for text in texts:
        if not isinstance(text, str):
            raise QualityUnavailable(f"quality texts must be strings, got {type(text).__name__}", field="quality_texts")
        room = min(seq_len, max_tokens - scored + 1)
        ids = list(source.tokenizer(text, add_special_tokens=True)["input_ids"])[:room]
        if len(ids) < 2:
            continue
        batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        if "use_cache" in accepted:
            batch["use_cache"] = False
        batches.append(batch)
        scored += len(ids) - 1
        if scored >= max_tokens:
            break
    if not batches:
        raise QualityUnavailable("the quality texts give no text of two tokens or more: nothing to score",
                                 field="quality_texts")
    return batches


def _run_layers(source: QualitySource, batches: list[dict[str, Any]],
                variants: Mapping[str, Mapping[str, LayerCast | None]], should_stop: Callable[[], bool] | None,
                on_layer: Callable[[int, int], None] | None) -> tuple[dict[str | None, list[torch.Tensor]], _Passes]:
    """Passes 1 and 2: each stream's hidden states after the last layer (``None``: the reference's), and the
    recorded calls, whose ``hidden_in`` then holds the input embedding per text for the head pass's replay."""
    model, stack, checkpoint = source.model, source.stack, source.checkpoint
    model.eval()
    layers: nn.ModuleList = model.get_submodule(stack.path)
    real = list(layers)
    head_path = _module_path(model, model.get_output_embeddings())
    embed_path = _module_path(model, model.get_input_embeddings())
    passes = _Passes(stack.count, len(batches))
    try:
        embedded = _run_around_layers(model, stack, checkpoint, batches, passes, head_path, embed_path,
                                      keep_embeddings=True)
        _choose_compute(passes, checkpoint, None, SequentialStats())
        streams: dict[str | None, list[torch.Tensor]] = {None: list(passes.hidden_in)}
        streams.update({name: list(passes.hidden_in) for name in variants})
        for index in range(stack.count):
            if should_stop is not None and should_stop():
                raise ConversionCancelled(f"the quality pass was cancelled before layer {index} of {stack.count}")
            layers[index] = real[index]
            _run_layer(model, stack, checkpoint, passes, index, real[index], streams, variants)
            if on_layer is not None:
                on_layer(index + 1, stack.count + 1)
    finally:
        for index, layer in enumerate(real):
            layers[index] = layer
        release(model)
    passes.hidden_in = embedded
    return streams, passes


def _run_layer(model: nn.Module, stack: LayerStack, checkpoint: Checkpoint, passes: _Passes, index: int,
               layer: nn.Module, streams: dict[str | None, list[torch.Tensor]],
               variants: Mapping[str, Mapping[str, LayerCast | None]]) -> None:
    layer_path = f"{stack.path}.{index}"
    dtypes = tensor_dtypes(layer)
    checkpoint.load(unit_keys(model, lambda name: _under(name, layer_path)))
    storage, compute = checkpoint.dtype, passes.compute or checkpoint.dtype
    try:
        with torch.no_grad(), emulating(layer, storage, compute):
            for name in streams:
                casts = {} if name is None else {p: c for p, c in variants[name].items() if _under(p, layer_path)}
                with casting_linears(model, casts):
                    streams[name] = [_output(passes.call(layer, index, step, hidden), stack).to(storage)
                                     for step, hidden in enumerate(streams[name])]
    finally:
        release(layer)
        restore_dtypes(layer, dtypes)


def _output(output: Any, stack: LayerStack) -> torch.Tensor:
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if not isinstance(output, torch.Tensor):
        raise QualityUnavailable(f"{stack.layer_class} returns a {type(output).__name__}, not its hidden states",
                                 field="model")
    return output


def _score_heads(source: QualitySource, batches: list[dict[str, Any]],
                 streams: dict[str | None, list[torch.Tensor]], passes: _Passes,
                 variants: Mapping[str, Mapping[str, LayerCast | None]]) -> dict[str, TokenScores]:
    """The head pass: each stream through the final norm (the model's own forward, layers replayed), then the head."""
    model, stack, checkpoint = source.model, source.stack, source.checkpoint
    head = model.get_output_embeddings()
    head_path = _module_path(model, head)
    embed_path = _module_path(model, model.get_input_embeddings())
    layers: nn.ModuleList = model.get_submodule(stack.path)
    real = list(layers)
    # everything outside the layers but the input embedding, which the replay stands in for (a tied head loads it)
    checkpoint.load(unit_keys(model, lambda name: stack.index_of(name) is None and not _under(name, embed_path)
                              or _under(name, head_path)))
    parent, _, leaf = (embed_path or "").rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    embedding = getattr(owner, leaf)
    embedded = passes.hidden_in
    normed: list[torch.Tensor] = []

    def capture(_module: nn.Module, args: tuple) -> None:
        normed.append(args[0][0].detach())
        raise _StopForward

    hook = head.register_forward_pre_hook(capture)
    passes.replaying = True
    for index in range(stack.count):
        layers[index] = _LayerStandIn(index, real[index], passes)
    setattr(owner, leaf, _Replay(embedded, passes))
    try:
        finals = {}
        with torch.no_grad():
            for name, hidden in streams.items():
                passes.final, normed = hidden, []
                for step, batch in enumerate(batches):
                    passes.step = step
                    try:
                        model(**batch)
                    except _StopForward:
                        pass
                finals[name] = normed
        return _score(head, head_path, batches, finals, variants)
    finally:
        hook.remove()
        setattr(owner, leaf, embedding)
        for index, layer in enumerate(real):
            layers[index] = layer
        release(model)


def _score(head: nn.Module, head_path: str, batches: list[dict[str, Any]], finals: dict[str | None, list[torch.Tensor]],
           variants: Mapping[str, Mapping[str, LayerCast | None]]) -> dict[str, TokenScores]:
    weight = head.weight.detach()
    bias = head.bias.detach().float() if getattr(head, "bias", None) is not None else None
    weights = {None: weight}
    for name, casts in variants.items():
        cast = casts.get(head_path)
        weights[name] = cast_linear_weight(cast, weight) if cast is not None else weight
    scores = {name: TokenScores() for name in variants}
    for step, batch in enumerate(batches):
        targets = batch["input_ids"][0, 1:]
        for start in range(0, targets.numel(), _HEAD_POSITIONS):
            rows = slice(start, min(start + _HEAD_POSITIONS, targets.numel()))
            reference = _logits(finals[None][step][rows], weights[None], bias, None)
            for name, casts in variants.items():
                logits = _logits(finals[name][step][rows], weights[name], bias, casts.get(head_path))
                scores[name].add(reference, logits, targets[rows])
    return scores


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cast: LayerCast | None
            ) -> torch.Tensor:
    """fp32 logits of ``[positions, hidden]``, the weight upcast a slice of the vocabulary at a time."""
    x = hidden.float()
    if cast is not None and cast.input is not None:
        x = fake_quantize(x, cast.input, scale=cast.input_scale)
    parts = [nn.functional.linear(x, weight[v: v + 16384].float()) for v in range(0, weight.shape[0], 16384)]
    logits = torch.cat(parts, dim=-1)
    return logits + bias if bias is not None else logits
