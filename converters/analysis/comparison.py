"""What a recipe comparison may compare: the layers each recipe would convert, and which recipes come out alike.

A comparison calibrates once under the job's recipe and measures every compared recipe's casts on the layers that
calibration saw. A compared recipe with a stricter shape rule (TE ``Float8BlockScaling`` and ``NVFP4BlockScaling``:
both dims % 128; MXFP8: % 32) would keep some of them in high precision, so its figures for those layers describe
a conversion that would not happen: :func:`recipe_exclusions` names them with the analysis's own reason code, and
the comparison shows no figure there.

Several recipes can measure alike to the last digit shown, and that is arithmetic, not a fault:
:func:`identical_groups` finds them and :func:`why_identical` says why. With power-of-two scales (TE MXFP8 and
Float8BlockScaling, torchao's rowwise recipes and MXFP8) a scale only shifts E4M3's exponent, so every value in
E4M3's normal range rounds to the same relative grid whatever the block (a row, 1x128, 128x128 or 32 values);
the casts differ only for values more than 2**15 below their block's largest (E4M3's subnormals) or where a scale
would clip, which well-scaled tensors rarely hold.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["recipe_exclusions", "identical_groups", "recipes_converting", "why_identical"]

#: scale rules (``converters.casts.emulation.ScaleRule`` values) that are powers of two
_POW2_RULES = {"pow2", "e8m0_rceil", "e8m0_floor"}


def recipe_exclusions(layers: Iterable[Mapping[str, Any]], recipe: Any) -> dict[str, str]:
    """Path -> reason code for each layer (Linear or expert GEMM unit) ``recipe``'s shape rule keeps in high
    precision; the reason is the one an analysis under ``recipe`` gives (``recipe.shape_rule().reason``)."""
    rule = recipe.shape_rule()
    return {layer["path"]: rule.reason for layer in layers
            if layer.get("class") != "Conv1D" and rule.fails(layer["in_features"], layer["out_features"])}


def recipes_converting(layers: Iterable[Mapping[str, Any]], recipe: Any, named: Mapping[str, Any]) -> dict[str, int]:
    """Name -> how many layers each of the ``named`` recipes (short name -> recipe) would convert where ``recipe``
    converts none, for those that would convert any: the layers ``recipe``'s shape rule alone kept out (every other
    reason, an include/exclude pattern or a first/last layer, stays whatever the recipe), less those each other
    recipe's own rule keeps out. A recipe with ``recipe``'s rule never appears: it would find the same nothing."""
    own = recipe.shape_rule()
    kept_out = [layer for layer in layers if list(layer.get("reasons") or ()) == [own.reason]]
    counts = {}
    for name, other in named.items():
        if other.shape_rule() == own:
            continue
        excluded = recipe_exclusions(kept_out, other)
        counts[name] = sum(layer["path"] not in excluded for layer in kept_out)
    return {name: count for name, count in counts.items() if count}


def identical_groups(rows: Sequence[Mapping[str, Any]], labels: Sequence[str]) -> list[list[str]]:
    """Groups of two or more ``labels`` whose figures (weight, input, output SQNR; exclusions) are equal on every row.

    ``rows`` are the comparison's layers (``{"path", "sqnr_db": {label: {...}}}``); a group needs at least one
    measured figure, so recipes that measured nothing are not called alike.
    """
    by_figures: dict[tuple[Any, ...], list[str]] = {}
    for label in labels:
        key = tuple(tuple(sorted(row["sqnr_db"][label].items(), key=lambda item: item[0])) for row in rows)
        by_figures.setdefault(key, []).append(label)
    return [group for key, group in by_figures.items()
            if len(group) > 1 and any(value is not None for row in key for _, value in row)]


def why_identical(recipes: Sequence[Mapping[str, Any]]) -> str:
    """Why recipes (their comparison descriptions: ``weight_format``, ``input_format``, ``scale_rule``) with equal
    figures are equal."""
    casts = {(r["weight_format"], r["input_format"], r["scale_rule"]["weight"], r["scale_rule"]["input"])
             for r in recipes}
    if len(casts) == 1:
        weight, inp, scale, _ = next(iter(casts))
        return f"the same forward casts ({weight} weights, {inp} inputs, {scale} scales)"
    rules = {r["scale_rule"][what] for r in recipes for what in ("weight", "input")}
    fp8 = all("nvfp4" not in r["weight_format"] and "nvfp4" not in (r["input_format"] or "") for r in recipes)
    if fp8 and rules <= _POW2_RULES:
        return ("every scale is a power of two, which only shifts E4M3's exponent: a value rounds alike whatever its "
                "block (tensor row, 1x128, 128x128 or 32 values) and differs only where it lies more than 2**15 below "
                "its block's largest (E4M3's subnormals); this model's tensors have no such values that change a "
                "figure shown")
    return "equal to the 0.01 dB shown on every measured layer"
