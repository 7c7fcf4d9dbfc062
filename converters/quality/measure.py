"""Layer-sequential quality pass: the source and its FP8 variants side by side, one layer in memory at a time.

The texts run batched, several a call (:mod:`converters.quality.text_batches`), each scored to the bit as a call of
it alone would score it. Pass 1 runs the modules around the layers once per batch and records what
each layer is called with (the calibration's replay API, :mod:`converters.calibration.sequential`). Pass 2 loads
each layer once and runs every batch through it as the source (the reference stream) and once per FP8 variant,
each on that variant's own hidden states from the layer before, with its Linears cast
(:mod:`converters.quality.casts`); a variant that casts nothing up to a layer shares the reference's hidden states
there instead of computing them again. The head pass replays the final hidden states of each stream through the
model's final norm, and the output head scores them a slice of positions at a time: no ``[tokens, vocab]`` tensor
of the whole text, and never the whole model.

Across the ranks of a data-parallel job (:class:`QualityShare`) each rank scores a contiguous block of the texts and
the sums of every variant are added over the ranks in rank order (text order): the figures are the one-process
run's up to float summation order and the head's GEMM blocking (a block of positions spans texts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from converters.calibration.compute import choose_compute_dtype, emulating, tensor_dtypes

# The calibration's pass-1 and replay machinery, shared so that both passes see the layers called the same way.
from converters.calibration.sequential import (
    LayerCalls,
    LayerStack,
    SequentialStats,
    StopForward,
    choose_compute,
    find_layer_stack,
    module_path,
    record_layer_calls,
    release_layer,
    replaying_outer_modules,
    under,
)
from converters.casts.emulation import fake_quantize
from converters.errors import ConversionCancelled
from converters.model.checkpoint import Checkpoint, release, return_freed_memory, unit_keys
from converters.model.sources import ModelSourceOptions, build_meta_model, load_config, load_tokenizer, model_dtype
from converters.quality.casts import LayerCast, cast_linear_weight, casting_linears, input_amax
from converters.quality.figures import QualityFigures, QualityUnavailable, ReferenceLogits, TokenScores
from converters.quality.held_out import BUILT_IN_HELD_OUT, REQUEST_TEXTS, held_out_part
from converters.quality.kv_cache import KvCast, attention_paths, quantizing_kv_cache
from converters.quality.ranks import QualityShare, summed_over_ranks
from converters.quality.text_attention import attending_per_text
from converters.quality.text_batches import TextBatch, batched, rows_keep_their_bits, token_texts

__all__ = ["QualityShare", "QualitySource", "QualityUnavailable", "load_source", "measure_quality", "measure_qualities",
           "DEFAULT_MAX_TOKENS", "DEFAULT_SEQ_LEN"]

DEFAULT_MAX_TOKENS = 256
DEFAULT_SEQ_LEN = 256
_HEAD_POSITIONS = 64  # least positions scored at a time: a [64, vocab] fp32 logits per stream (33 MB at 128k)
_HEAD_ROWS = 16384  # vocabulary rows of the head's weight upcast to fp32 at a time, into one reused buffer
#: logits held at once by the head pass: the streams scored against one upcast slice of the head's weight, and
#: the scoring's own tensors of their size (at 256 MiB the head pass was the peak of a SmolLM2 job: +207 MiB)
_HEAD_LOGITS_BYTES = 64 * 2**20


@dataclass
class QualitySource:
    """A source model opened for the quality pass: meta model, checkpoint, layer list and tokenizer."""

    model: nn.Module
    checkpoint: Checkpoint
    stack: LayerStack
    tokenizer: Any


def load_source(directory: Path, sources: Any = None, *, tokenizer: Any = None) -> QualitySource:
    """Open the model in ``directory`` on the meta device (no weight is read); ``tokenizer``: the model's own,
    already loaded (None: loaded here).

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
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(Path(directory), sources)
    if tokenizer is None:
        raise QualityUnavailable("the model ships no tokenizer: quality is measured on text", field="model")
    checkpoint = Checkpoint(Path(directory), model, dtype=model_dtype(config), device="cpu")
    return QualitySource(model=model, checkpoint=checkpoint, stack=stack, tokenizer=tokenizer)


def measure_quality(source: Path | QualitySource, layer_casts: Mapping[str, LayerCast | KvCast | None],
                    texts: Sequence[str] | None = None, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                    seq_len: int = DEFAULT_SEQ_LEN, should_stop: Callable[[], bool] | None = None) -> QualityFigures:
    """The FP8 model given by ``layer_casts`` (Linear path -> its cast; None or absent: high precision; an
    attention module's path -> a :class:`KvCast`: its FP8 KV cache) against its source, on ``texts`` (None: the
    built-in held-out part), at most ``max_tokens`` scored positions, each text cut to ``seq_len`` tokens. See
    :func:`measure_qualities` for what it raises."""
    return measure_qualities(source, {"fp8": layer_casts}, texts, max_tokens=max_tokens, seq_len=seq_len,
                             should_stop=should_stop)["fp8"]


def measure_qualities(source: Path | QualitySource, variants: Mapping[str, Mapping[str, LayerCast | KvCast | None]],
                      texts: Sequence[str] | None = None, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                      seq_len: int = DEFAULT_SEQ_LEN, should_stop: Callable[[], bool] | None = None,
                      on_layer: Callable[[int, int], None] | None = None, share_unchanged_layers: bool = True,
                      share: QualityShare | None = None) -> dict[str, QualityFigures]:
    """Several FP8 variants in one pass: the reference runs once; each variant's stream runs beside it.

    A variant's stream is the reference's up to the first layer where it casts a Linear: with
    ``share_unchanged_layers`` (the default) it uses the reference's hidden states until then instead of
    computing the same ones again (the figures are the same either way; False computes every stream through
    every layer). A precision plan's variants, one cast unit each, skip about half the layers so. ``share``: this
    process is one rank of a data-parallel job (see :class:`QualityShare`); every rank gets the whole job's figures.

    Raises QualityUnavailable (see :func:`load_source`; also texts that give fewer than two tokens),
    ConversionCancelled when ``should_stop()`` turns true between layers, ValueError for a cast on a module
    that is not a Linear of the model.
    """
    if share is None:
        return _measure(source, variants, texts, max_tokens, seq_len, should_stop, on_layer, share_unchanged_layers)
    try:
        return _measure(source, variants, texts, max_tokens, seq_len, should_stop, on_layer, share_unchanged_layers,
                        share)
    except Exception as exc:
        if not share.gathered:  # the others wait in the gather: they get this rank's reason and stop too
            share.gather(f"{type(exc).__name__}: {exc}")
        raise


def _measure(source: Path | QualitySource, variants: Mapping[str, Mapping[str, LayerCast | KvCast | None]],
             texts: Sequence[str] | None, max_tokens: int, seq_len: int, should_stop: Callable[[], bool] | None,
             on_layer: Callable[[int, int], None] | None, share_unchanged_layers: bool,
             share: QualityShare | None = None) -> dict[str, QualityFigures]:
    if isinstance(source, (str, Path)):
        source = load_source(Path(source))
    if max_tokens < 1 or seq_len < 2:
        raise ValueError(f"max_tokens must be >= 1 and seq_len >= 2, got {max_tokens} and {seq_len}")
    held_out = REQUEST_TEXTS if texts is not None else BUILT_IN_HELD_OUT
    tokens = token_texts(source.tokenizer, list(texts) if texts is not None else held_out_part(), max_tokens, seq_len)
    model = source.model
    known = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    attention = set(attention_paths(model))
    for casts in variants.values():
        unknown = sorted(path for path, cast in casts.items()
                         if path not in (attention if isinstance(cast, KvCast) else known))
        if unknown:
            raise ValueError(f"layer_casts names modules that are not Linears of the model (or, for a KvCast, not "
                             f"attention modules): {unknown[:5]}")
    # Variants with the same casts (TE delayed without calibrated amax and TE current; a recipe compared with
    # itself) run once.
    unique: dict[frozenset, str] = {}
    for name, casts in variants.items():
        unique.setdefault(frozenset((path, cast) for path, cast in casts.items() if cast is not None), name)
    runs = {name: variants[name] for name in unique.values()}
    mine = [tokens[index] for index in share.texts(len(tokens))] if share is not None else tokens
    if mine:
        # texts attend one by one through transformers' attention modules: a model without them scores one a call,
        # as where the GEMMs give a text's rows other bits inside a bigger call
        batches = batched(mine, source.tokenizer, model, one_a_call=not attention or not _gemm_rows_keep_bits(source))
        streams, passes = _run_layers(source, batches, runs, should_stop, on_layer, share_unchanged_layers)
        scores = _score_heads(source, batches, streams, passes, runs)
    else:
        scores = {name: TokenScores() for name in runs}
    if share is not None:
        scores = summed_over_ranks(share, scores)
    if on_layer is not None:  # the head pass, counted as one more layer (as the layers' reports count it)
        on_layer(source.stack.count + 1, source.stack.count + 1)
    return {name: scores[unique[frozenset((path, cast) for path, cast in casts.items() if cast is not None)]]
            .figures(texts=len(tokens), held_out=held_out) for name, casts in variants.items()}


def _gemm_rows_keep_bits(source: QualitySource) -> bool:
    """Whether the layers' GEMMs, in the dtype the pass computes them in, give a text's rows inside a batch the bits
    they get alone (:func:`~converters.quality.text_batches.rows_keep_their_bits`)."""
    checkpoint = source.checkpoint
    compute, _why = choose_compute_dtype(None, checkpoint.dtype, checkpoint.device)
    layer = source.model.get_submodule(f"{source.stack.path}.0")
    shapes = {(module.in_features, module.out_features) for module in layer.modules() if isinstance(module, nn.Linear)}
    return rows_keep_their_bits(shapes, compute, checkpoint.device)


def _run_layers(source: QualitySource, batches: list[TextBatch],
                variants: Mapping[str, Mapping[str, LayerCast | KvCast | None]], should_stop: Callable[[], bool] | None,
                on_layer: Callable[[int, int], None] | None, share: bool
                ) -> tuple[dict[str | None, list[torch.Tensor]], LayerCalls]:
    """Passes 1 and 2: each stream's hidden states after the last layer (``None``: the reference's; a variant that
    casts nothing in the layers holds the reference's list itself), and the recorded calls, whose ``hidden_in``
    then holds the input embedding per text for the head pass's replay."""
    model, stack, checkpoint = source.model, source.stack, source.checkpoint
    model.eval()
    layers: nn.ModuleList = model.get_submodule(stack.path)
    real = list(layers)
    head_path = module_path(model, model.get_output_embeddings())
    embed_path = module_path(model, model.get_input_embeddings())
    passes = LayerCalls(stack.count, len(batches))
    first_cast = {name: _first_cast_layer(stack, casts) if share else 0 for name, casts in variants.items()}
    # what the job freed before this pass (an export's buffers) may still sit in the allocator's arenas: handed
    # back first, so the pass's layers do not stack on top of it
    return_freed_memory()
    try:
        embedded = record_layer_calls(model, stack, checkpoint, [batch.inputs for batch in batches], passes,
                                      head_path, embed_path, keep_embeddings=True)
        choose_compute(passes, checkpoint, None, SequentialStats())
        streams: dict[str | None, list[torch.Tensor]] = {None: list(passes.hidden_in)}
        streams.update({name: streams[None] if first_cast[name] > 0 else list(passes.hidden_in) for name in variants})
        for index in range(stack.count):
            if should_stop is not None and should_stop():
                raise ConversionCancelled(f"the quality pass was cancelled before layer {index} of {stack.count}")
            layers[index] = real[index]
            _run_layer(model, stack, checkpoint, passes, index, real[index], streams, variants, first_cast,
                       [batch.lengths for batch in batches])
            if on_layer is not None:
                on_layer(index + 1, stack.count + 1)
    finally:
        for index, layer in enumerate(real):
            layers[index] = layer
        release(model)
    passes.hidden_in = embedded
    return streams, passes


def _first_cast_layer(stack: LayerStack, casts: Mapping[str, LayerCast | KvCast | None]) -> int:
    """The first layer where ``casts`` casts a Linear (``stack.count``: none; the head lies outside the layers)."""
    indices = [stack.index_of(path) for path, cast in casts.items() if cast is not None]
    return min((index for index in indices if index is not None), default=stack.count)


def _run_layer(model: nn.Module, stack: LayerStack, checkpoint: Checkpoint, passes: LayerCalls, index: int,
               layer: nn.Module, streams: dict[str | None, list[torch.Tensor]],
               variants: Mapping[str, Mapping[str, LayerCast | KvCast | None]], first_cast: Mapping[str, int],
               lengths: list[list[int]]) -> None:
    """Every stream through layer ``index``; a variant before its first cast layer takes the reference's output.
    ``lengths``: each step's texts' tokens (the input casts scale each text on its own, and the texts attend one by
    one: :mod:`converters.quality.text_attention`).

    A variant's cast weights take the place of the source's in the layer (one copy of the layer's weights at a
    time, not two); the next stream that runs the layer gets the source's weights loaded again first."""
    layer_path = f"{stack.path}.{index}"
    dtypes = tensor_dtypes(layer)
    checkpoint.load(unit_keys(model, lambda name: under(name, layer_path)))
    storage, compute = checkpoint.dtype, passes.compute or checkpoint.dtype
    replaced: list[str] = []  # Linears whose weight is a variant's cast now
    attention = [path for path in attention_paths(model) if under(path, layer_path)]
    try:
        with torch.no_grad(), emulating(layer, storage, compute), attending_per_text(model, attention) as texts:
            for name in streams:
                if name is not None and index < first_cast[name]:
                    streams[name] = streams[None]  # the reference's own list: computed once, for both
                    continue
                casts = {} if name is None else {p: c for p, c in variants[name].items() if under(p, layer_path)}
                kv = {path: casts.pop(path) for path in list(casts) if isinstance(casts[path], KvCast)}
                # a Linear this stream reads from an export's written weight needs no source weight (only its
                # shape): reloading it would read the layer's bytes again for nothing
                _load_source_weights(model, checkpoint, [path for path in replaced if not _reads_written(casts, path)],
                                     compute)
                replaced = []
                with casting_linears(model, casts, in_place=True) as cast, quantizing_kv_cache(model, kv):
                    replaced = list(cast.casts)
                    outputs = []
                    for step, hidden in enumerate(streams[name]):
                        cast.lengths = texts.lengths = lengths[step]
                        outputs.append(_output(passes.call(layer, index, step, hidden), stack).to(storage))
                    streams[name] = outputs
    finally:
        release_layer(layer, dtypes)


def _reads_written(casts: Mapping[str, LayerCast | KvCast | None], path: str) -> bool:
    cast = casts.get(path)
    return isinstance(cast, LayerCast) and cast.read_weight is not None


def _load_source_weights(model: nn.Module, checkpoint: Checkpoint, paths: list[str], compute: torch.dtype) -> None:
    """The source's tensors of the Linears ``paths`` again, in ``compute`` (their casts replaced them): one Linear
    at a time, its cast freed first, so that no more than one Linear's weight is held twice."""
    for path in paths:
        module = model.get_submodule(path)
        release(module)
        checkpoint.load(unit_keys(model, lambda name, path=path: under(name, path)))
        module.to(compute)


def _output(output: Any, stack: LayerStack) -> torch.Tensor:
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if not isinstance(output, torch.Tensor):
        raise QualityUnavailable(f"{stack.layer_class} returns a {type(output).__name__}, not its hidden states",
                                 field="model")
    return output


def _score_heads(source: QualitySource, batches: list[TextBatch],
                 streams: dict[str | None, list[torch.Tensor]], passes: LayerCalls,
                 variants: Mapping[str, Mapping[str, LayerCast | KvCast | None]]) -> dict[str, TokenScores]:
    """The head pass: each stream through the final norm (the model's own forward, layers replayed), then the head.
    Streams that share their hidden states (the same list) go through the norm once. Each stream's result: the
    normed hidden states of every text, its own positions only."""
    model, stack, checkpoint = source.model, source.stack, source.checkpoint
    head = model.get_output_embeddings()
    head_path = module_path(model, head)
    embed_path = module_path(model, model.get_input_embeddings())
    # everything outside the layers but the input embedding, which the replay stands in for (a tied head loads it)
    checkpoint.load(unit_keys(model, lambda name: stack.index_of(name) is None and not under(name, embed_path)
                              or under(name, head_path)))
    normed: list[torch.Tensor] = []

    def capture(_module: nn.Module, args: tuple) -> None:
        normed.append(args[0].detach())
        raise StopForward

    hook = head.register_forward_pre_hook(capture)
    try:
        finals: dict[str | None, list[torch.Tensor]] = {}
        done: dict[int, list[torch.Tensor]] = {}
        with torch.no_grad():
            for name, hidden in streams.items():
                if id(hidden) not in done:
                    normed = []
                    with replaying_outer_modules(model, stack, passes, passes.hidden_in, hidden):
                        for step, batch in enumerate(batches):
                            passes.step = step
                            try:
                                model(**batch.inputs)
                            except StopForward:
                                pass
                    done[id(hidden)] = [states[row, :length] for states, batch in zip(normed, batches, strict=True)
                                        for row, length in enumerate(batch.lengths)]
                finals[name] = done[id(hidden)]
        return _score(head, head_path, batches, finals, variants)
    finally:
        hook.remove()
        release(model)


def _score(head: nn.Module, head_path: str, batches: list[TextBatch], finals: dict[str | None, list[torch.Tensor]],
           variants: Mapping[str, Mapping[str, LayerCast | KvCast | None]]) -> dict[str, TokenScores]:
    weight = head.weight.detach()
    bias = head.bias.detach().float() if getattr(head, "bias", None) is not None else None
    head_casts = {name: casts.get(head_path) for name, casts in variants.items()}
    cast_weights = {name: cast_linear_weight(cast, weight) for name, cast in head_casts.items() if cast is not None}
    # the streams multiplied by the source's head weight: the reference, and each variant with an uncast head whose
    # hidden states differ from the reference's (the others' logits are the reference's own)
    plain = [None, *(name for name, cast in head_casts.items() if cast is None and finals[name] is not finals[None])]
    # Every text's scored positions in one [positions, hidden] fp32 per stream (streams sharing their hidden states
    # share it), so that a chunk spans texts: the head's weight is upcast once per chunk, not once per text and 64
    # positions. A cast head's input is cast per text first, with the text's own scale, as the FP8 model casts the
    # input of each call.
    targets = torch.cat([batch.inputs["input_ids"][row, 1:length] for batch in batches
                         for row, length in enumerate(batch.lengths)])
    joined: dict[int, torch.Tensor] = {}
    for name in plain:
        if id(finals[name]) not in joined:
            joined[id(finals[name])] = _head_input(finals[name], None)
    cast_inputs = {name: _head_input(finals[name], cast) for name, cast in head_casts.items()
                   if cast is not None}
    positions = _head_positions(weight.shape[0], len(plain) + len(cast_weights))
    group = max(1, _HEAD_LOGITS_BYTES // (positions * weight.shape[0] * 4))
    buffer = torch.empty(min(_HEAD_ROWS, weight.shape[0]), weight.shape[1], dtype=torch.float32)
    scores = {name: TokenScores() for name in variants}
    for start in range(0, targets.numel(), positions):
        rows = slice(start, min(start + positions, targets.numel()))
        logits: dict[str | None, torch.Tensor] = {}
        for first in range(0, len(plain), group):
            names = plain[first:first + group]
            logits.update(_upcast_head_logits([joined[id(finals[name])][rows] for name in names], weight, bias,
                                              buffer, names))
        reference = ReferenceLogits(logits[None])
        for name in variants:
            if name in cast_inputs:
                logits[name] = _cast_head_logits(cast_inputs[name][rows], cast_weights[name], bias)
            scores[name].add(reference, logits.get(name, logits[None]), targets[rows])
    return scores


def _head_input(hidden: list[torch.Tensor], cast: LayerCast | None) -> torch.Tensor:
    """The scored positions of every text, ``[positions, hidden]`` fp32, each text's through ``cast``'s input cast
    (its scale from the whole text, as the FP8 head's call would take it) when there is one."""
    parts = []
    for states in hidden:
        x = states.float()
        if cast is not None and cast.input is not None:
            x = fake_quantize(x, cast.input, scale=cast.input_scale, tensor_amax=input_amax(cast))
        parts.append(x[:-1])
    return torch.cat(parts)


def _head_positions(vocab: int, streams: int) -> int:
    """Positions scored at a time: as many as keep every stream's ``[positions, vocab]`` fp32 logits within
    ``_HEAD_LOGITS_BYTES`` while they are scored, and at least ``_HEAD_POSITIONS`` (a plan's hundred variants)."""
    # each stream's logits, and three more of that size while they are scored (log p, p, a variant's log q)
    return max(_HEAD_POSITIONS, _HEAD_LOGITS_BYTES // (vocab * 4 * (streams + 3)))


def _upcast_head_logits(hidden: list[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor | None,
                        buffer: torch.Tensor, names: list[str | None]) -> dict[str | None, torch.Tensor]:
    """fp32 logits of each ``[positions, hidden]`` in ``hidden`` with the source's head weight, upcast a slice of
    the vocabulary at a time into ``buffer`` (reused: a fresh fp32 slice per stream cost more than its GEMM), each
    slice once for all the streams, whose positions go through it in one GEMM (on a CPU an fp32 GEMM of 136 rows
    ran at 1.6 times the rate of one of 68)."""
    xs = torch.cat([h.float() for h in hidden])
    out = torch.empty(xs.shape[0], weight.shape[0], dtype=torch.float32)
    for v in range(0, weight.shape[0], buffer.shape[0]):
        rows = min(buffer.shape[0], weight.shape[0] - v)
        block = buffer[:rows]
        block.copy_(weight[v: v + rows])
        out[:, v: v + rows] = nn.functional.linear(xs, block)
    parts = out.split([h.shape[0] for h in hidden])
    return {name: logits + bias if bias is not None else logits for name, logits in zip(names, parts, strict=True)}


def _cast_head_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits of ``[positions, hidden]`` inputs already cast (:func:`_head_input`) through a cast head's (fp32)
    cast weight."""
    parts = [nn.functional.linear(x, weight[v: v + _HEAD_ROWS]) for v in range(0, weight.shape[0], _HEAD_ROWS)]
    logits = torch.cat(parts, dim=-1)
    return logits + bias if bias is not None else logits
