"""Per-layer quantization error under a recipe, and the layers it keeps in high precision.

For each calibrated layer (Linear or MoE expert GEMM unit) and recipe, three signal-to-quantization-noise
ratios, ``10 log10(sum(x**2) / sum((x - q(x))**2))`` in dB, where ``q`` casts as the recipe would
(:mod:`converters.calibration.emulation`):

* ``weight``: the weight, ``[out, in]``, cast once;
* ``input``: the layer's calibration inputs (the tokens routed to it for an expert), every step pooled;
* ``output``: the layer's output computed in fp32 from the cast input and weight against the layer's own
  output (what the high-precision model computes: in fp32 for an fp32 model; for a bf16 model its bf16
  output, whose own rounding lies about 56 dB below the signal, a 0.01 dB effect on FP8's 20 to 35 dB),
  every step pooled (the bias, kept in high precision, cancels in the noise). Taking the layer's own output
  spares a second high-precision GEMM and an fp32 copy of the weight per call.

The sums are accumulated in the calibration hooks (``converters.calibration.amax``): no activation is kept.
TE delayed scaling casts an input with the scale its amax history holds *before* the step (the largest of
the last ``amax_history_len`` steps' amax, ``most_recent``: the last one; the first step, with no history,
uses its own amax as a seeded artifact would), so a step whose amax outgrows the history saturates here as
it would in training. Every other recipe scales from the tensor being cast.

``min_sqnr_db`` keeps every layer whose *output* SQNR under the job's recipe falls below it in high precision:
the report lists it with reason ``low_sqnr``, it is not converted and its calibration is not written. An
expert GEMM kind runs as one grouped GEMM (TE GroupedLinear, serving engines), so it is decided as a group:
by its lowest member. This module imports torch only inside the meter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from converters.analysis.reasons import Reason
from converters.analysis.totals import refresh_totals
from converters.calibration.emulation import E4M3_MAX, cast_spec, db, fake_quantize, tensor_scale
from converters.recipes.presets import _value, parse_compare_recipe, recipe_label

if TYPE_CHECKING:
    import torch

    from converters.calibration.emulation import CastSpec

__all__ = [
    "SQNR_DEFINITION",
    "DelayedParams",
    "RecipeCasts",
    "recipe_casts",
    "SqnrMeter",
    "meter_for",
    "relabel_comparison",
    "report_sqnr",
    "exclude_low_sqnr",
]


#: token rows per layer call on which input and output SQNR are measured (see SqnrMeter)
DEFAULT_MAX_ROWS = 32
#: output channels (weight rows) per layer on which weight and output SQNR are measured, in blocks of 128
DEFAULT_MAX_CHANNELS = 512
_CHANNEL_BLOCK = 128


def _rows_in(blocks: Any, out: int) -> float:
    """How many weight rows the 128-row ``blocks`` hold (the last block of ``out`` rows may be partial)."""
    return float(sum(min(_CHANNEL_BLOCK, out - int(block) * _CHANNEL_BLOCK) for block in blocks))

SQNR_DEFINITION = ("10*log10(sum(x^2)/sum((x-q(x))^2)) dB; weight: the weight cast once; input: the calibration "
                   "inputs, all steps pooled; output: the output from the cast input and weight against the layer's "
                   "own output, all steps pooled; input and output on at most 32 token rows per call (the 8 "
                   "largest and an even spread of the others, weighted; scales from the whole input); 300 means "
                   "exact")

# Recipes whose fp8 scales are powers of two: TE Float8BlockScaling by default, torchao's rowwise recipes
_POW2_SCALES = {("te", "float8_block"), ("ao", "rowwise"), ("ao", "rowwise_with_gw_hp"), ("ao", "float8_training_op")}


@dataclass(frozen=True, kw_only=True)
class DelayedParams:
    history_len: int = 1024
    algo: str = "max"
    margin: int = 0


@dataclass(frozen=True, kw_only=True)
class RecipeCasts:
    """What one recipe does to a Linear's forward operands."""

    label: str
    recipe: dict[str, Any]  #: the recipe as data
    weight: CastSpec
    input: CastSpec | None  #: None: the input stays in high precision (a weight-only format)
    delayed: DelayedParams | None = None  #: TE delayed scaling: per-tensor scales from the amax history
    not_emulated: tuple[str, ...] = ()  #: options of the recipe the emulation leaves out

    @property
    def casts_key(self) -> tuple[Any, ...]:
        """Equal for recipes whose forward casts are the same (measured once for all of them)."""
        return self.weight, self.input, self.delayed

    def describe(self) -> dict[str, Any]:
        return {"label": self.label, "recipe": self.recipe, "weight_format": self.weight.name,
                "input_format": self.input.name if self.input else None,
                "scale_rule": {"weight": self.weight.scale.value,
                               "input": self.input.scale.value if self.input else None},
                "delayed": self.delayed is not None, "not_emulated": list(self.not_emulated)}


def recipe_casts(recipe: Any, label: str | None = None) -> RecipeCasts:
    """The forward casts of ``recipe`` (its ``cast_formats()``)."""
    key = (_value(recipe.backend), _value(recipe.scaling))
    formats = recipe.cast_formats()
    weight, inp = formats["weight"], formats["input"]
    library = "torchao" if key[0] == "ao" else "te"
    pow2 = key in _POW2_SCALES and not getattr(recipe, "use_f32_scales", False)  # TE Float8BlockScaling's option
    options = {"library": library, "pow2_scales": pow2,
               "mx_rounding": _value(getattr(recipe, "scale_calculation_mode", "rceil")).lower()}
    delayed = None
    if key == ("te", "delayed"):
        delayed = DelayedParams(history_len=getattr(recipe, "amax_history_len", 1024),
                                algo=_value(getattr(recipe, "amax_compute_algo", "max")),
                                margin=getattr(recipe, "margin", 0))
    return RecipeCasts(label=label or recipe_label(recipe), recipe=recipe.to_dict(),
                       weight=cast_spec(weight, **options), input=cast_spec(inp, **options), delayed=delayed,
                       not_emulated=_not_emulated(recipe))


def _not_emulated(recipe: Any) -> tuple[str, ...]:
    """Recipe options that change the forward casts and that the emulation leaves out (said in the report)."""
    notes = []
    if _value(getattr(recipe, "nvfp4_4over6", "none")) != "none":
        notes.append("nvfp4_4over6 (per-block choice between two scales): emulated with the plain NVFP4 scale")
    if getattr(recipe, "row_scaled_activation", False):
        notes.append("row_scaled_activation: emulated with the plain NVFP4 activation scale")
    return tuple(notes)


def _unique(labels: Iterable[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return out


def meter_for(recipe: Any, compare: Sequence[Any] = (), extra: Sequence[RecipeCasts] = ()) -> tuple[SqnrMeter, str]:
    """A meter for the job's ``recipe`` and the ``compare`` entries, and the label of the job's recipe.

    Compare columns are named by their short names, made unique (``te-delayed#2``); an entry equal to the job's
    recipe is measured once, under the entry's name. ``extra`` casts (the serving formats') are measured too,
    under their own labels, outside the comparison table.
    """
    parsed = [parse_compare_recipe(item, f"compare_recipes[{index}]") for index, item in enumerate(compare)]
    names = _unique(item if isinstance(item, str) else recipe_label(parsed[index])
                    for index, item in enumerate(compare))
    casts = [recipe_casts(recipe_, name) for recipe_, name in zip(parsed, names, strict=True)]
    chosen = next((c for c in casts if c.recipe == recipe.to_dict()), None)
    if chosen is None:
        label = recipe_label(recipe)
        chosen = recipe_casts(recipe, label if label not in names else f"{label} (job)")
        casts.insert(0, chosen)
    return SqnrMeter([*casts, *extra], compared=names), chosen.label


def relabel_comparison(report: dict[str, Any], labels: Sequence[str | None]) -> None:
    """Rename the comparison's columns in order (None keeps one's name), e.g. recipe files by their file names."""
    recipes = report["comparison"]["recipes"]
    old = [recipe["label"] for recipe in recipes]
    given = list(labels)[: len(old)] + [None] * (len(old) - len(labels))
    new = _unique(label or name for label, name in zip(given, old, strict=True))
    renamed = dict(zip(old, new, strict=True))
    for recipe in recipes:
        recipe["label"] = renamed[recipe["label"]]
    for row in report["comparison"]["layers"]:
        row["sqnr_db"] = {renamed[label]: value for label, value in row["sqnr_db"].items()}
    job = report["sensitivity"]["recipe"]
    job["label"] = renamed.get(job["label"], job["label"])


@dataclass
class _Sums:
    signal: float = 0.0
    noise: float = 0.0

    def add(self, signal: Any, noise: Any) -> None:
        self.signal += float(signal)
        self.noise += float(noise)

    def db(self) -> float | None:
        value = db(self.signal, self.noise)
        return None if value is None else round(value, 2)


@dataclass
class _History:
    """A layer's input amax by step, for delayed scaling: earlier steps' non-zero amaxes, and the current step's."""

    step: int = -1
    current: float = 0.0
    earlier: list[float] = field(default_factory=list)

    def see(self, step: int, amax: float) -> None:
        if step != self.step:
            if self.current > 0:
                self.earlier = (self.earlier + [self.current])[-4096:]
            self.step, self.current = step, 0.0
        self.current = max(self.current, amax)

    def amax_for(self, params: DelayedParams) -> float:
        window = self.earlier[-params.history_len:]
        if not window:
            return self.current  # no history yet: what a calibration-seeded state would hold
        return max(window) if params.algo == "max" else window[-1]


def _weighted(squares: torch.Tensor, weights: torch.Tensor | None, columns: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The sum of ``squares`` (``[rows, ...]``), each row counted ``weights[row]`` times and, for a 2-D tensor,
    each column ``columns[column]`` times (once where a weight vector is None)."""
    if columns is not None:
        squares = squares * columns
    if weights is None:
        return squares.sum()
    return (squares.reshape(squares.shape[0], -1).sum(dim=1) * weights).sum()


@dataclass(frozen=True)
class _Channels:
    """The output channels (weight rows) of a layer that are measured, and what each stands for."""

    rows: torch.Tensor | None  #: sorted row indices, whole 128-row blocks; None: every row
    weights: torch.Tensor | None  #: per measured row, how many rows it stands for; None: one each
    amax: torch.Tensor  #: the whole weight's amax (per-tensor and NVFP4 global scales come from it)


class SqnrMeter:
    """Signal and noise sums per layer and recipe, fed by the calibration hooks (:meth:`observe`).

    Memory stays near one weight's size: a weight is cast and multiplied by slices of rows (whole blocks, the
    per-tensor and NVFP4 global scales taken from the whole weight), and a layer's cast weights are kept between
    its calls only while all kept ones fit in ``cache_bytes`` (layer-sequential calibration calls one layer's
    Linears step after step, so there each weight is cast once).

    Cost: the input and output SQNR of a call are measured on at most ``max_rows`` of its token rows (the
    quarter with the largest ``|x|``, and an even spread of the others weighted to stand for all of them; see
    ``_sampled_rows``), with the per-tensor and NVFP4 global input scales still taken from the whole input, as
    the recipe takes them. Likewise the weight and the output are measured on at most ``max_channels`` output
    channels (weight rows, in whole 128-row blocks so that every block scale is the recipe's own: the blocks
    with the largest ``|w|`` and an even spread of the others, weighted), so a weight is cast on that share of
    its rows only: with few calibration tokens, casting every weight costs as much as the forward itself. The
    emulated GEMMs then cost ``max_rows / rows x max_channels / out`` of the layer's forward. ``None`` for
    either measures everything (the exact figure); ``benchmarks/bench_sqnr_sampling.py`` measures how far the
    sampled figure is from it on a real model.
    """

    def __init__(self, recipes: Sequence[RecipeCasts], compared: Sequence[str] = (), *,
                 cache_bytes: int = 256 * 1024**2, slice_elements: int = 2 * 1024**2,
                 max_rows: int | None = DEFAULT_MAX_ROWS, max_channels: int | None = DEFAULT_MAX_CHANNELS) -> None:
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be at least 1 or None, got {max_rows}")
        if max_channels is not None and max_channels < 2 * _CHANNEL_BLOCK:
            raise ValueError(f"max_channels must be at least {2 * _CHANNEL_BLOCK} or None, got {max_channels}")
        self.max_channels = max_channels
        self.recipes = list(recipes)
        self.compared = list(compared)
        self.cache_bytes = cache_bytes
        self.slice_elements = slice_elements
        self.max_rows = max_rows
        # recipes with the same forward casts (torchao's three rowwise ones) are computed once
        self._groups: dict[tuple[Any, ...], list[RecipeCasts]] = {}
        for casts in self.recipes:
            self._groups.setdefault(casts.casts_key, []).append(casts)
        self.reset()

    def reset(self) -> None:
        self._sums: dict[tuple[str, str, str], _Sums] = {}
        self._history: dict[str, _History] = {}
        self._weighed: set[str] = set()  # layers whose weight SQNR is recorded
        self._cache: dict[str, list[list[torch.Tensor]]] = {}  # path -> per group, the cast slices; oldest first
        self._channels: dict[str, _Channels] = {}  # path -> the rows measured (the weight does not change)

    def _channels_of(self, path: str, weight: torch.Tensor) -> _Channels:
        """The output channels measured for ``path``, chosen once from the weight's row amax."""
        import torch

        if path in self._channels:
            return self._channels[path]
        row_amax = weight.detach().abs().amax(dim=1).float()
        out = row_amax.shape[0]
        chosen = _Channels(rows=None, weights=None, amax=row_amax.max())
        if self.max_channels is not None and out > self.max_channels:
            blocks = -(-out // _CHANNEL_BLOCK)
            block_amax = torch.nn.functional.pad(row_amax, (0, blocks * _CHANNEL_BLOCK - out)).reshape(blocks, -1)
            budget = self.max_channels // _CHANNEL_BLOCK
            top = block_amax.amax(dim=1).topk(max(1, budget // 4)).indices
            others = torch.ones(blocks, dtype=torch.bool)
            others[top] = False
            rest = others.nonzero().squeeze(1)
            spread = rest[::-(-rest.numel() // (budget - top.numel()))]
            picked = torch.cat([top, spread]).sort().values
            starts = picked * _CHANNEL_BLOCK
            rows = torch.cat([torch.arange(int(start), min(int(start) + _CHANNEL_BLOCK, out)) for start in starts])
            standing = _rows_in(rest, out) / _rows_in(spread, out)  # each spread row stands for this many
            weights = torch.where(torch.isin(rows // _CHANNEL_BLOCK, top), torch.ones(()), torch.tensor(standing))
            chosen = _Channels(rows=rows, weights=weights.float(), amax=chosen.amax)
        self._channels[path] = chosen
        return chosen

    def _measured_weight(self, path: str, weight: torch.Tensor) -> torch.Tensor:
        """The weight's measured rows (all of them, or the chosen blocks gathered in order)."""
        rows = self._channels_of(path, weight).rows
        return weight.detach() if rows is None else weight.detach().index_select(0, rows)

    def paths(self) -> list[str]:
        return list(dict.fromkeys(path for path, _, _ in self._sums))

    def _add(self, path: str, group: list[RecipeCasts], what: str, signal: Any, noise: Any) -> None:
        signal, noise = float(signal), float(noise)
        for casts in group:
            self._sums.setdefault((path, casts.label, what), _Sums()).add(signal, noise)

    def _slices(self, weight: torch.Tensor) -> list[slice]:
        out_features, in_features = weight.shape
        rows = max(128, self.slice_elements // max(in_features, 1) // 128 * 128)  # whole 128-row blocks
        return [slice(start, min(start + rows, out_features)) for start in range(0, out_features, rows)]

    def _cast_weights(self, path: str, weight: torch.Tensor) -> list[list[torch.Tensor]] | None:
        """Per group, the weight's cast row slices: from the cache, else cast now (and cached if they fit)."""
        if path in self._cache:
            return self._cache[path]
        measured = self._measured_weight(path, weight)
        size = measured.numel() * 4 * len(self._groups)
        if size > self.cache_bytes:
            return None
        amax = self._channels_of(path, weight).amax
        cast = [[self._cast_weight(group[0], measured[rows].float(), amax) for rows in self._slices(measured)]
                for group in self._groups.values()]
        while self._cache and sum(t.numel() * 4 for v in self._cache.values() for g in v for t in g) + size > \
                self.cache_bytes:
            self._cache.pop(next(iter(self._cache)))
        self._cache[path] = cast
        return cast

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
                    w = measured[rows].float()
                    q = cached[index][number] if cached is not None else self._cast_weight(group[0], w, channels.amax)
                    stands = None if channels.weights is None else channels.weights[rows]
                    signal += float(_weighted(w.square(), stands))
                    noise += float(_weighted((w - q).square(), stands))
                self._add(path, group, "weight", signal, noise)
        self._weighed.add(path)

    def observe(self, path: str, step: int, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None, output: torch.Tensor | None = None, *,
                row_amax: torch.Tensor | None = None) -> None:
        """One call of a layer: input ``x`` (``[..., in]``), ``weight [out, in]``, optional bias, and the layer's
        own output, the reference (computed here in fp32 when the caller has none of the layer's shape).
        ``row_amax`` is each token row's ``max |x|`` where the caller has it already (the amax recorder)."""
        import torch
        from torch.nn.functional import linear

        self.observe_weight(path, weight)
        with torch.no_grad():
            x = x.detach().reshape(-1, weight.shape[1])
            if row_amax is None:
                row_amax = x.abs().amax(dim=1).float()
            x_amax = row_amax.max() if row_amax.numel() else torch.zeros((), dtype=torch.float32)
            history = self._history.setdefault(path, _History())
            history.see(step, float(x_amax))
            picked, weights = self._sampled_rows(row_amax, step)
            channels = self._channels_of(path, weight)
            measured = self._measured_weight(path, weight)
            own_output = output is not None and output.is_floating_point() \
                and output.numel() == x.shape[0] * weight.shape[0]
            if own_output:
                reference = output.detach().reshape(x.shape[0], weight.shape[0])
                reference = reference if picked is None else reference[picked]
                reference = (reference if channels.rows is None else reference[:, channels.rows]).float()
            x = (x if picked is None else x[picked]).float()
            b = None if bias is None else bias.detach().float()
            if b is not None and channels.rows is not None:
                b = b[channels.rows]
            slices = self._slices(measured)
            if not own_output:
                reference = torch.cat([linear(x, measured[rows].float(), None if b is None else b[rows])
                                       for rows in slices], dim=1)
            cached = self._cast_weights(path, weight)
            stands = channels.weights
            x_signal, y_signal = _weighted(x.square(), weights), _weighted(reference.square(), weights, stands)
            for index, group in enumerate(self._groups.values()):
                qx = self._cast_input(group[0], x, history, x_amax)
                self._add(path, group, "input", x_signal, _weighted((x - qx).square(), weights))
                noise = 0.0
                for number, rows in enumerate(slices):
                    qw = cached[index][number] if cached is not None else \
                        self._cast_weight(group[0], measured[rows].float(), channels.amax)
                    y = linear(qx, qw, None if b is None else b[rows])
                    noise += float(_weighted((reference[:, rows] - y).square(), weights,
                                             None if stands is None else stands[rows]))
                self._add(path, group, "output", y_signal, noise)

    @staticmethod
    def _cast_weight(casts: RecipeCasts, w: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """Rows of a weight cast under ``casts``; ``amax`` is the whole weight's (per-tensor and NVFP4 scales)."""
        if casts.delayed is None:
            return fake_quantize(w, casts.weight, tensor_amax=amax)
        return fake_quantize(w, casts.weight, scale=tensor_scale(amax, E4M3_MAX * 2.0 ** -casts.delayed.margin))

    def _sampled_rows(self, row_amax: torch.Tensor, step: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The rows of a call that are measured and each one's weight in the sums (None, None: every row, once).

        A quarter of the budget goes to the rows with the largest ``|x|`` (outlier tokens such as a sequence's
        first one carry much of a layer's signal and noise), each counted once; the rest is spread evenly over
        the other rows, each standing for ``others / sampled`` rows, so the weighted sums estimate the full ones
        without bias and with the outliers measured exactly.
        """
        import torch

        rows = row_amax.shape[0]
        if self.max_rows is None or rows <= self.max_rows:
            return None, None
        top = max(1, self.max_rows // 4)
        outliers = row_amax.topk(top).indices
        others = torch.ones(rows, dtype=torch.bool)
        others[outliers] = False
        rest = others.nonzero().squeeze(1)
        stride = -(-rest.numel() // (self.max_rows - top))
        spread = rest[step % stride::stride]
        weights = torch.cat([torch.ones(top), torch.full((spread.numel(),), rest.numel() / max(spread.numel(), 1))])
        return torch.cat([outliers, spread]), weights

    @staticmethod
    def _cast_input(casts: RecipeCasts, x: torch.Tensor, history: _History, x_amax: torch.Tensor) -> torch.Tensor:
        """Rows of an input cast under ``casts``; ``x_amax`` is the whole input's (per-tensor and NVFP4 scales)."""
        import torch

        if casts.input is None:
            return x
        if casts.delayed is None:
            return fake_quantize(x, casts.input, tensor_amax=x_amax)
        amax = torch.tensor(history.amax_for(casts.delayed), dtype=torch.float32)
        return fake_quantize(x, casts.input, scale=tensor_scale(amax, E4M3_MAX * 2.0 ** -casts.delayed.margin))

    def result(self, path: str, label: str) -> dict[str, float | None]:
        """``{"weight", "input", "output"}`` in dB (None: no signal, e.g. an expert that got no token)."""
        return {what: (self._sums[(path, label, what)].db() if (path, label, what) in self._sums else None)
                for what in ("weight", "input", "output")}


def report_sqnr(report: dict[str, Any], meter: SqnrMeter, label: str, *, min_sqnr_db: float | None = None
                ) -> list[str]:
    """Write the measured SQNR into ``report``; with ``min_sqnr_db``, exclude the layers below it.

    Each measured layer gets ``sqnr_db`` under the job's recipe (``label``); ``report["sensitivity"]`` says how
    it was measured and what was excluded; with compared recipes, ``report["comparison"]`` holds the table.
    Returns the excluded paths (see :func:`exclude_low_sqnr`).
    """
    measured = set(meter.paths())
    casts = {c.label: c for c in meter.recipes}
    for layer in report["layers"]:
        if layer["path"] in measured:
            layer["sqnr_db"] = meter.result(layer["path"], label)
    excluded = exclude_low_sqnr(report, min_sqnr_db) if min_sqnr_db is not None else []
    report["sensitivity"] = {
        "measured": True, "recipe": casts[label].describe(), "definition": SQNR_DEFINITION, "min_sqnr_db": min_sqnr_db,
        "decided_by": "output", "excluded": excluded, "measured_layers": len(measured),
        "without_data": [path for path in meter.paths() if meter.result(path, label)["output"] is None],
    }
    if meter.compared:
        report["comparison"] = _comparison(report, meter, min_sqnr_db)
    return excluded


def _comparison(report: dict[str, Any], meter: SqnrMeter, min_sqnr_db: float | None) -> dict[str, Any]:
    measured = set(meter.paths())
    rows = [{"path": layer["path"], "sqnr_db": {label: meter.result(layer["path"], label) for label in meter.compared}}
            for layer in report["layers"] if layer["path"] in measured]
    recipes = [c.describe() for c in meter.recipes if c.label in meter.compared]
    if min_sqnr_db is not None:
        for recipe in recipes:
            outputs = [(row["path"], row["sqnr_db"][recipe["label"]]["output"]) for row in rows]
            recipe["below_min_sqnr_db"] = [path for path, value in outputs if value is not None and value < min_sqnr_db]
    return {"recipes": recipes, "layers": rows}


def exclude_low_sqnr(report: dict[str, Any], min_sqnr_db: float) -> list[str]:
    """Mark eligible layers whose output SQNR is below ``min_sqnr_db`` as not eligible, reason ``low_sqnr``.

    An expert GEMM kind (``<experts>.<gemm>`` over all experts) is decided by its lowest member and excluded
    whole. Fused groups and totals are brought up to date. Returns the excluded paths in report order.
    """
    by_path = {layer["path"]: layer for layer in report["layers"]}

    def low(path: str) -> bool:
        value = (by_path[path].get("sqnr_db") or {}).get("output")
        return value is not None and value < min_sqnr_db

    doomed = {layer["path"] for layer in report["layers"]
              if layer["eligible"] and "expert" not in layer and low(layer["path"])}
    for group in report["fused_groups"]:
        members = [by_path[m] for m in group["members"]]
        if all("expert" in m for m in members) and any(m["eligible"] and low(m["path"]) for m in members):
            doomed.update(m["path"] for m in members if m["eligible"])
    excluded = [layer["path"] for layer in report["layers"] if layer["path"] in doomed]
    for path in excluded:
        by_path[path]["eligible"] = False
        by_path[path]["reasons"].append(Reason.LOW_SQNR.value)
    if excluded:
        _refresh(report, by_path)
    return excluded


def _refresh(report: dict[str, Any], by_path: dict[str, dict[str, Any]]) -> None:
    for group in report["fused_groups"]:
        group["eligible_members"] = [m for m in group["members"] if by_path[m]["eligible"]]
        group["partly_eligible"] = 0 < len(group["eligible_members"]) < len(group["members"])
    refresh_totals(report)
