"""The SQNR meter: signal and noise sums per layer and recipe, fed by the calibration hooks, sampled so that
measuring costs a fraction of the forward (see :class:`SqnrMeter`; what is measured and why:
:mod:`converters.calibration.sensitivity`). Imports torch only inside the meter's methods.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from converters.calibration.sqnr_arithmetic import (
    CHANNEL_BLOCK,
    CallInput,
    CastRows,
    DelayedHistory,
    DelayedParams,
    MeasuredChannels,
    PendingRows,
    RecipeCasts,
    Sums,
    amax_per_row,
    energy_per_row,
    rows_in_blocks,
    scaled_product,
    stratified_sample,
    weight_sqnr_sums,
    weighted_sum,
)
from converters.casts.emulation import E4M3_MAX, tensor_scale

if TYPE_CHECKING:
    import torch


__all__ = ["DEFAULT_MAX_ROWS", "DEFAULT_ROWS_PER_LAYER", "DEFAULT_MAX_CHANNELS", "DelayedParams", "RecipeCasts",
           "SqnrMeter"]


#: token rows per layer call on which input and output SQNR are measured (see SqnrMeter)
DEFAULT_MAX_ROWS = 32
#: a job's token rows per Linear over the whole calibration: its 16 default steps x DEFAULT_MAX_ROWS; a longer
#: calibration spreads them over its steps, so the meter's cost stays fixed while the forward's grows
DEFAULT_ROWS_PER_LAYER = 512
#: a call spread thinner still measures this many rows per sequence in it: the quarter of its rows with the largest
#: |x| (measured exactly) then holds each sequence's first token and its other outliers. On the real SmolLM2 at 64
#: steps (bench_sqnr_sampling.py --steps 64), 4 a sequence was 1.08 dB off the exact output SQNR at layer 2's
#: down projection (its top 2 rows a call missed outliers that the spread then weighted 40-fold); 8 is 0.31 dB off
_LEAST_ROWS_PER_SEQUENCE = 8
#: output channels (weight rows) per layer on which weight and output SQNR are measured, in blocks of 128
DEFAULT_MAX_CHANNELS = 512
#: a layer with at most this many times ``max_channels`` output channels is measured whole (SqnrMeter)
_WHOLE_UP_TO = 4
#: a sampled layer is measured on at least one in this many of its output channels (SqnrMeter)
_LEAST_SHARE = 8


class SqnrMeter:
    """Signal and noise sums per layer and recipe, fed by the calibration hooks (:meth:`observe`).

    Memory stays near one weight's size: a weight is cast and multiplied by slices of rows (whole blocks, the
    per-tensor and NVFP4 global scales taken from the whole weight), and a layer's cast weights are kept between
    its flushes only while all kept ones fit in ``cache_bytes``. A job's meter keeps none (``cache_bytes=0``,
    :func:`~converters.calibration.sensitivity.meter_for`): a layer-sequential calibration measures each layer
    in one flush, where its weight is cast once, a slice at a time, for the weight's and the output's SQNR alike
    (keeping the casts cost a 0.5B-width job ~130 MiB of its peak and saved nothing).

    Cost: the input and output SQNR of a call are measured on at most ``max_rows`` of its token rows (the
    quarter with the largest ``|x|``, and an even spread of the others weighted to stand for all of them; see
    ``_sampled_rows``); with ``rows_per_layer``, a calibration of more steps than ``rows_per_layer / max_rows``
    (:meth:`expect_steps`) measures fewer rows a call, ``rows_per_layer`` in all but at least
    ``_LEAST_ROWS_PER_SEQUENCE`` per sequence of a call. The per-tensor and NVFP4 global input scales are still
    taken from the whole input, as the recipe takes them. Likewise the weight and the output of a layer with more
    than ``4 x max_channels`` output channels are measured on ``max_channels`` of them or an eighth, whichever is
    more (weight rows, in whole 128-row blocks so that every block scale is the recipe's own: the blocks carrying
    most of the first output's energy, and an even spread over the others in the order of their energy,
    weighted), so a weight is cast on that share of its rows only. A call's sampled rows are only gathered; they
    are cast and multiplied in one batch per layer (:meth:`flush`): one input cast and one GEMM per recipe and slice of
    channels for all the calls, not one per call. ``None`` for either limit measures everything (the exact
    figure); ``benchmarks/bench_sqnr_sampling.py`` measures how far the sampled figure is from it on a real
    model.
    """

    def __init__(self, recipes: Sequence[RecipeCasts], compared: Sequence[str] = (), *,
                 cache_bytes: int = 256 * 1024**2, slice_elements: int = 2 * 1024**2,
                 max_rows: int | None = DEFAULT_MAX_ROWS, max_channels: int | None = DEFAULT_MAX_CHANNELS,
                 flush_rows: int = 1024, pending_bytes: int = 64 * 1024**2, rows_per_layer: int | None = None) -> None:
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be at least 1 or None, got {max_rows}")
        if rows_per_layer is not None and rows_per_layer < 1:
            raise ValueError(f"rows_per_layer must be at least 1 or None, got {rows_per_layer}")
        if max_channels is not None and max_channels < 2 * CHANNEL_BLOCK:
            raise ValueError(f"max_channels must be at least {2 * CHANNEL_BLOCK} or None, got {max_channels}")
        self.max_channels = max_channels
        self.recipes = list(recipes)
        self.compared = list(compared)
        self.cache_bytes = cache_bytes
        self.slice_elements = slice_elements
        self.max_rows = max_rows
        self.rows_per_layer = rows_per_layer
        self._call_rows = max_rows  # a call's budget of token rows (expect_steps lowers it)
        #: ``(path, chosen) -> chosen``: the ranks of a data-parallel calibration take rank 0's choice of a sampled
        #: layer's channels (made from step 0's output, as one process makes it); None: this meter's own
        self.agree_channels: Callable[[str, MeasuredChannels], MeasuredChannels] | None = None
        # recipes with the same forward casts (torchao's three rowwise ones) are computed once
        self._groups: dict[tuple[Any, ...], list[RecipeCasts]] = {}
        for casts in self.recipes:
            self._groups.setdefault(casts.casts_key, []).append(casts)
        self._delayed_params = list(dict.fromkeys(casts.delayed for casts in self.recipes if casts.delayed))
        self.flush_rows = flush_rows  #: a layer's gathered rows are measured once this many wait
        self.pending_bytes = pending_bytes  #: every layer's are once the gathered rows hold more bytes than this
        self.reset()

    def reset(self) -> None:
        self._sums: dict[tuple[str, str, str], Sums] = {}
        self._history: dict[str, DelayedHistory] = {}
        self._weighed: set[str] = set()  # layers whose weight SQNR is recorded
        self._cache: dict[str, list[list[CastRows]]] = {}  # path -> per group, the cast slices; oldest first
        self._floats: dict[str, torch.Tensor] = {}  # path -> the measured rows in fp32, kept with the cast slices
        self._channels: dict[str, MeasuredChannels] = {}  # path -> the rows measured (the weight does not change)
        self._pending: dict[str, PendingRows] = {}  # path -> its sampled rows not yet measured
        self._last_input: CallInput | None = None  # the last call's input (see input_rows)
        self._pending_bytes = 0  # held by the gathered rows (an input shared by several Linears counted for each)

    def sums_of(self, owned: Callable[[str], bool]) -> list[tuple[str, str, str, float, float]]:
        """``(path, label, what, signal, noise)`` of the layers ``owned(path)`` picks, as measured so far (the ranks
        of a data-parallel calibration add them up; a resume record keeps them)."""
        return [(*key, sums.signal, sums.noise) for key, sums in self._sums.items() if owned(key[0])]

    def replace_sums(self, entries: Sequence[tuple[str, str, str, float, float]]) -> None:
        """Set the sums :meth:`sums_of` gave (added over the ranks, or read back from a resume record)."""
        for path, label, what, signal, noise in entries:
            self._sums[(path, label, what)] = Sums(signal=float(signal), noise=float(noise))

    def use_step_amax(self, path: str, input_amax: torch.Tensor) -> None:
        """Take what delayed scaling's history held for each waiting call of ``path`` from ``input_amax`` (``[steps]``:
        every step's input amax, reduced over the ranks of a data-parallel calibration), since a rank's own history
        lacks the steps the other ranks ran. A call with no earlier non-zero step keeps its own figure (its step's
        running max, which the one rank that ran the step saw whole). Measure before any flush of ``path``."""
        pending = self._pending.get(path)
        if pending is None or not self._delayed_params:
            return
        amax = input_amax.tolist()
        for number, (call_amax, delayed, rows) in enumerate(pending.calls):
            history = DelayedHistory(earlier=[value for value in amax[:pending.steps[number]] if value > 0][-4096:])
            if history.earlier:
                pending.calls[number] = (call_amax, {params: history.amax_for(params) for params in delayed}, rows)

    def expect_steps(self, steps: int) -> None:
        """The calibration calls each layer ``steps`` times: spread ``rows_per_layer`` over them (at most
        ``max_rows`` a call; no change without ``rows_per_layer``)."""
        if self.rows_per_layer is not None and self.max_rows is not None and steps > 0:
            self._call_rows = min(self.max_rows, -(-self.rows_per_layer // steps))

    def drop_cast_weights(self) -> None:
        """Measure what waits, then forget the cast weights kept between calls (a layer-sequential calibration is
        done with a layer: its weights are still loaded)."""
        self.flush()
        self._cache.clear()
        self._floats.clear()
        self._last_input = None

    def _channels_of(self, path: str, weight: torch.Tensor, output: torch.Tensor | None = None) -> MeasuredChannels:
        """The output channels measured for ``path``, chosen once: by the energy of each 128-row block in the
        layer's first output seen (``output``, ``[rows, out]``; a block carrying an outlier channel, such as a
        residual stream's massive activation, holds most of the output signal and is measured exactly), else by
        the weight's row amax. A layer of at most ``4 x max_channels`` rows is measured whole (sampling it
        would save little and cost accuracy), a larger one on ``max_channels`` rows or an eighth of them,
        whichever is more (a vocabulary head's logits spread their energy over many blocks)."""
        import torch

        if path in self._channels:
            return self._channels[path]
        row_amax = amax_per_row(weight.detach())
        out = row_amax.shape[0]
        chosen = MeasuredChannels(rows=None, weights=None, amax=row_amax.max())
        if self.max_channels is not None and out > _WHOLE_UP_TO * self.max_channels:
            blocks = -(-out // CHANNEL_BLOCK)
            score = row_amax if output is None else output.detach().float().square().sum(dim=0)
            score = torch.nn.functional.pad(score, (0, blocks * CHANNEL_BLOCK - out)).reshape(blocks, -1)
            budget = max(self.max_channels // CHANNEL_BLOCK, blocks // _LEAST_SHARE)
            top, rest, spread = stratified_sample(score.amax(dim=1) if output is None else score.sum(dim=1), budget,
                                            by_score=True)
            picked = torch.cat([top, spread]).sort().values
            starts = picked * CHANNEL_BLOCK
            rows = torch.cat([torch.arange(int(start), min(int(start) + CHANNEL_BLOCK, out), device=weight.device)
                              for start in starts])
            standing = rows_in_blocks(rest, out) / rows_in_blocks(spread, out)  # each spread row stands for this many
            weights = torch.where(torch.isin(rows // CHANNEL_BLOCK, top), torch.ones(()), torch.tensor(standing))
            chosen = MeasuredChannels(rows=rows, weights=weights.float(), amax=chosen.amax)
            if self.agree_channels is not None:
                chosen = self.agree_channels(path, chosen)
        self._channels[path] = chosen
        return chosen

    def _measured_weight(self, path: str, weight: torch.Tensor) -> torch.Tensor:
        """The weight's measured rows in fp32 (all of them, or the chosen blocks gathered in order): kept with the
        cast slices between calls (gathered and upcast once per layer, not per call; a mixed-dtype op upcasts
        element by element on a CPU, several times slower than this copy)."""
        if path in self._floats:
            return self._floats[path]
        rows = self._channels_of(path, weight).rows
        return (weight.detach() if rows is None else weight.detach().index_select(0, rows)).float()

    def paths(self) -> list[str]:
        self.flush()
        return list(dict.fromkeys(path for path, _, _ in self._sums))

    def _add(self, path: str, group: list[RecipeCasts], what: str, signal: Any, noise: Any) -> None:
        signal, noise = float(signal), float(noise)
        for casts in group:
            self._sums.setdefault((path, casts.label, what), Sums()).add(signal, noise)

    def _slices(self, weight: torch.Tensor) -> list[slice]:
        out_features, in_features = weight.shape
        rows = max(128, self.slice_elements // max(in_features, 1) // 128 * 128)  # whole 128-row blocks
        return [slice(start, min(start + rows, out_features)) for start in range(0, out_features, rows)]

    def _cast_weights(self, path: str, weight: torch.Tensor) -> list[list[CastRows]] | None:
        """Per group, the weight's cast row slices: from the cache, else cast now (and cached if they fit)."""
        if path in self._cache:
            return self._cache[path]
        measured = self._measured_weight(path, weight)
        size = measured.numel() * 4 * (len(self._groups) + 1)  # the cast slices and the fp32 rows
        if size > self.cache_bytes:
            return None
        amax = self._channels_of(path, weight).amax
        cast = [[self._cast_weight(group[0], measured[rows], amax).compact() for rows in self._slices(measured)]
                for group in self._groups.values()]
        while self._cache and self._cached_bytes() + size > self.cache_bytes:
            oldest = next(iter(self._cache))
            self._cache.pop(oldest)
            self._floats.pop(oldest, None)
        self._cache[path] = cast
        self._floats[path] = measured
        return cast

    def _cached_bytes(self) -> int:
        casts = sum(cast.nbytes for v in self._cache.values() for g in v for cast in g)
        return casts + sum(t.numel() * t.element_size() for t in self._floats.values())

    def observe_weight(self, path: str, weight: torch.Tensor) -> None:
        """The weight's SQNR under every recipe, recorded the first time a layer is seen."""
        import torch

        if path in self._weighed:
            return
        with torch.no_grad():
            cached = self._cast_weights(path, weight)
            channels = self._channels_of(path, weight)
            measured = self._measured_weight(path, weight)
            for index, group in enumerate(self._groups.values()):
                signal = noise = 0.0
                for number, rows in enumerate(self._slices(measured)):
                    w = measured[rows]
                    q = (cached[index][number] if cached is not None
                         else self._cast_weight(group[0], w, channels.amax)).dequantized()
                    part_signal, part_noise = weight_sqnr_sums(w, q, None if channels.weights is None
                                                           else channels.weights[rows])
                    signal, noise = signal + part_signal, noise + part_noise
                self._add(path, group, "weight", signal, noise)
        self._weighed.add(path)

    def input_rows(self, x: torch.Tensor, in_features: int, step: int) -> CallInput:
        """What a call's input gives the meter: its token rows' amax, the rows sampled and those rows gathered.
        Derived once for the Linears called one after another on the same tensor at a step (q, k and v; gate and
        up): the last input is kept (a reference, so its memory cannot be reused while it is) and reused while it
        is the same tensor, unchanged."""
        import torch

        last = self._last_input
        if last is not None and last.tensor is x and last.version == x._version and last.step == step:
            return last
        rows = x.detach().reshape(-1, in_features)
        row_amax = amax_per_row(rows)
        sequences = x.shape[0] if x.dim() > 2 else 1
        picked, weights = self._sampled_rows(row_amax, step, sequences)
        count = rows.shape[0] if picked is None else picked.numel()
        self._last_input = CallInput(
            tensor=x, version=x._version, step=step, row_amax=row_amax,
            amax=float(row_amax.max()) if row_amax.numel() else 0.0, picked=picked,
            weights=torch.ones(count, device=rows.device) if weights is None else weights,
            rows=rows if picked is None else rows.index_select(0, picked))
        return self._last_input

    def observe(self, path: str, step: int, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None, output: torch.Tensor | None = None) -> None:
        """One call of a layer: input ``x`` (``[..., in]``), ``weight [out, in]``, optional bias, and the layer's
        own output, the reference (computed here in fp32 when the caller has none of the layer's shape).

        The call's sampled rows are only gathered here, with the scales the recipes would cast them with at this
        step; they are cast and multiplied in one batch per layer (:meth:`flush`: when ``flush_rows`` rows wait,
        when a layer-sequential calibration is done with the layer, when a result is read, or for every layer at
        once when all the gathered rows hold more than ``pending_bytes``)."""
        import torch

        own_output = output is not None and output.is_floating_point() \
            and output.numel() == x.numel() // weight.shape[1] * weight.shape[0]
        if own_output and path not in self._channels:
            self._channels_of(path, weight, output.reshape(-1, weight.shape[0]))
        with torch.no_grad():
            call = self.input_rows(x, weight.shape[1], step)
            history = self._history.setdefault(path, DelayedHistory())
            history.see(step, call.amax)
            if call.rows.shape[0] == 0:
                self.observe_weight(path, weight)  # no rows to measure it with at a flush
                return
            channels = self._channels_of(path, weight)
            reference = None
            if own_output:
                reference = output.detach().reshape(-1, weight.shape[0])
                reference = reference if call.picked is None else reference.index_select(0, call.picked)
                reference = reference if channels.rows is None else reference.index_select(1, channels.rows)
            pending = self._pending.get(path)
            if pending is None:  # the weight does not change during calibration: the first call's stands for all
                pending = self._pending[path] = PendingRows(weight=weight, bias=bias)
            pending.add(call.rows, reference, call.weights, call.amax,
                        {params: history.amax_for(params) for params in self._delayed_params}, step)
            self._pending_bytes += call.rows.nbytes + (0 if reference is None else reference.nbytes)
            if self._pending_bytes > self.pending_bytes:
                self.flush()  # a whole-model pass holds every layer's rows until its end otherwise
            elif pending.rows >= self.flush_rows:
                self._flush(path)

    def flush(self) -> None:
        """Measure every layer's gathered rows now (the layers' weights must still be loaded)."""
        for path in list(self._pending):
            self._flush(path)
        self._pending_bytes = 0

    def _flush(self, path: str) -> None:
        """The gathered rows of ``path`` through every recipe's casts: one input cast and one GEMM per slice of
        measured channels, for all its calls since the last flush."""
        import torch
        from torch.nn.functional import linear

        pending = self._pending.pop(path)
        weight, bias = pending.weight, pending.bias
        with torch.no_grad():
            channels = self._channels_of(path, weight)
            measured = self._measured_weight(path, weight)
            # in fp32 once: a mixed-dtype op upcasts element by element on a CPU, several times slower than this copy
            x = torch.cat(pending.x).float()
            weights = torch.cat(pending.weights)
            call_amax = pending.call_amax()
            b = None if bias is None else bias.detach().float()
            if b is not None and channels.rows is not None:
                b = b[channels.rows]
            slices = self._slices(measured)
            if pending.own_output:  # the layer's own outputs, upcast once like x (the error below is fp32 - fp32)
                reference = torch.cat(pending.reference).float()
            else:
                reference = torch.cat([linear(x, measured[rows].float(), None if b is None else b[rows])
                                       for rows in slices], dim=1)
            cached = self._cast_weights(path, weight)
            stands = channels.weights
            # A bf16 layer's emulated FP8 GEMM runs in bf16 (native, 5x fp32's speed on a CPU with AMX) on the
            # casts' values, exact there, with the scales taken out applied to its fp32-accumulated output (see
            # fake_quantize_factored); otherwise (fp16's range would overflow), and for casts without such a
            # split, in fp32.
            half = torch.bfloat16 if pending.x[0].dtype == torch.bfloat16 else None
            x_signal = weighted_sum(energy_per_row(x), weights)
            y_signal = weighted_sum(energy_per_row(reference, stands), weights)
            # the weight's own SQNR from the same casts, the first time the layer is measured (one cast of the
            # weight per layer and recipe when the cast slices are not cached)
            weigh = path not in self._weighed
            for index, group in enumerate(self._groups.values()):
                cx = self._cast_input(group[0], x, call_amax, pending.delayed_amax(group[0].delayed), half)
                qx = cx.dequantized()
                self._add(path, group, "input", x_signal, weighted_sum(energy_per_row(x - qx), weights))
                noise = w_signal = w_noise = 0.0
                for number, rows in enumerate(slices):
                    cw = cached[index][number] if cached is not None else \
                        self._cast_weight(group[0], measured[rows], channels.amax, half)
                    if weigh:
                        part_signal, part_noise = weight_sqnr_sums(measured[rows], cw.dequantized(),
                                                               None if stands is None else stands[rows])
                        w_signal, w_noise = w_signal + part_signal, w_noise + part_noise
                    if half is not None and cx.exact and cw.exact:
                        y = scaled_product(cx, cw, half, None if b is None else b[rows])
                    else:
                        y = linear(qx, cw.dequantized(), None if b is None else b[rows])
                    # the error in place of the emulated output (a fresh tensor of either path)
                    error = y.sub_(reference[:, rows])
                    columns = None if stands is None else stands[rows]
                    noise += float(weighted_sum(energy_per_row(error, columns), weights))
                self._add(path, group, "output", y_signal, noise)
                if weigh:
                    self._add(path, group, "weight", w_signal, w_noise)
            self._weighed.add(path)

    @staticmethod
    def _cast_weight(casts: RecipeCasts, w: torch.Tensor, amax: torch.Tensor, values_dtype: torch.dtype | None = None
                     ) -> CastRows:
        """Rows of a weight cast under ``casts``; ``amax`` is the whole weight's (per-tensor and NVFP4 scales)."""
        if casts.delayed is None:
            return CastRows.of(w, casts.weight, tensor_amax=amax, values_dtype=values_dtype)
        return CastRows.of(w, casts.weight, scale=tensor_scale(amax, E4M3_MAX * 2.0 ** -casts.delayed.margin),
                        values_dtype=values_dtype)

    def _sampled_rows(self, row_amax: torch.Tensor, step: int, sequences: int = 1
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The rows of a call that are measured and each one's weight in the sums (None, None: every row, once).

        :func:`stratified_sample` picks them: outlier tokens (such as a sequence's first one) exactly, an even spread
        of the others (starting at a different row each step) weighted, so the weighted sums estimate the full
        ones without bias.
        """
        import torch

        if self.max_rows is None:
            return None, None
        budget = min(self.max_rows, max(self._call_rows, _LEAST_ROWS_PER_SEQUENCE * sequences))
        if row_amax.shape[0] <= budget:
            return None, None
        outliers, rest, spread = stratified_sample(row_amax, budget, offset=step)
        weights = torch.ones(outliers.numel() + spread.numel(), device=row_amax.device)
        weights[outliers.numel():] = rest.numel() / max(spread.numel(), 1)
        return torch.cat([outliers, spread]), weights

    @staticmethod
    def _cast_input(casts: RecipeCasts, x: torch.Tensor, call_amax: torch.Tensor, delayed_amax: torch.Tensor | None,
                    values_dtype: torch.dtype | None = None) -> CastRows:
        """Gathered input rows cast under ``casts``; ``call_amax[row]`` is the amax of the whole input of the row's
        call (per-tensor and NVFP4 scales), ``delayed_amax[row]`` what delayed scaling's history held then."""
        if casts.input is None:
            return CastRows(values=x, factor=None, exact=True)  # gathered from the layer's own (half) inputs
        if casts.delayed is None:
            return CastRows.of(x, casts.input, tensor_amax=call_amax, values_dtype=values_dtype)
        return CastRows.of(x, casts.input, scale=tensor_scale(delayed_amax, E4M3_MAX * 2.0 ** -casts.delayed.margin),
                        values_dtype=values_dtype)

    def result(self, path: str, label: str) -> dict[str, float | None]:
        """``{"weight", "input", "output"}`` in dB (None: no signal, e.g. an expert that got no token)."""
        if path in self._pending:
            self._flush(path)
        return {what: (self._sums[(path, label, what)].db() if (path, label, what) in self._sums else None)
                for what in ("weight", "input", "output")}
