"""A weight cast in strips of rows whose temporaries stay in cache, joined into the tensors a whole cast gives.

A format's cast is a handful of whole-tensor torch ops (``|w|``, block amax, divide, clamp, round), each a pass
over memory through fp32 temporaries four times the bf16 weight's size, freshly allocated (page faults included).
Where every scale of the cast covers whole rows (128-row blocks, one row, groups along a row) and nothing is
computed from the whole tensor, the same cast applied to a strip of rows gives that strip's part of every output,
bit for bit: a strip of about a MiB keeps the temporaries in a core's cache (measured in
docs/benchmarks/requantize-2026-12-03b.md).

Which formats: the rows of the format's ``weight_cast`` block (:mod:`converters.casts.emulation`); a per-tensor
scale (``e4m3_tensor``) needs the whole tensor, and so does NVFP4's global scale unless the format receives it
(``needs_weight_amax``: the fused group's amax is given, not read from the weight).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from converters.casts.emulation import ScaleRule, cast_spec

__all__ = ["cast_in_strips", "strip_rows"]

#: weight elements cast at a time: a bf16 strip of 512 KiB, its fp32 temporaries 1 MiB each
STRIP_ELEMENTS = 1 << 18
#: a format's optional ``strip_factor``: its strips hold that many times ``STRIP_ELEMENTS``. A cast whose
#: temporaries are in the weight's own 16-bit dtype (compressed-tensors' dynamic FP8 and MXFP8 arithmetic) has half
#: their bytes per element, and the fixed cost of each of its ops (microseconds of dispatch) is spread over more
#: elements: 4 measured fastest for those (docs/benchmarks/requantize-2026-12-03c.md)
_DEFAULT_STRIP_FACTOR = 1


def strip_rows(fmt: Any, weight: torch.Tensor) -> int | None:
    """Rows per strip for ``fmt``'s cast of ``weight`` (a multiple of its scale blocks' rows), or None where the
    cast needs the whole tensor (a per-tensor scale, a tensor that is not 2-D or not whole blocks), a single strip
    would hold it all, or the weight is not in host memory (strips are for a CPU core's cache)."""
    spec_name = getattr(fmt, "weight_cast", None)
    if spec_name is None or weight.dim() != 2 or weight.device.type != "cpu":  # a GPU casts a weight whole
        return None
    spec = cast_spec(spec_name)
    unit = spec.block[0]
    if unit is None or (spec.scale is ScaleRule.NVFP4 and not getattr(fmt, "needs_weight_amax", False)):
        return None
    rows, columns = weight.shape
    elements = STRIP_ELEMENTS * getattr(fmt, "strip_factor", _DEFAULT_STRIP_FACTOR)
    step = max(unit, elements // max(1, columns) // unit * unit)
    return step if rows % unit == 0 and step < rows else None


def cast_in_strips(cast: Callable[[torch.Tensor], Sequence[torch.Tensor]], weight: torch.Tensor, step: int,
                   planned: Mapping[str, Any]) -> list[torch.Tensor]:
    """``cast(weight)``'s tensors, computed strip by strip of ``step`` rows and joined: an output whose planned
    first dim is the sum of the strips' is concatenated along it; any other (a per-tensor scale) must be the same
    in every strip and is taken once.

    Each strip's part is copied into its output as soon as it is cast, so only one strip's parts are alive beside
    the outputs (joining a list of every strip's parts at the end held a second copy of the outputs and copied
    them once more).

    Raises:
        ValueError: a per-tensor output differs between strips (the cast reads the whole tensor: it cannot be
            cast in strips), or a strip gave another number of tensors than ``planned`` names.
    """
    rows, names = weight.shape[0], list(planned)
    joined: list[torch.Tensor] = []
    filled: list[int | None] = []  # rows of each concatenated output written so far; None: a per-tensor output
    for start in range(0, rows, step):
        part = list(cast(weight[start:start + step]))
        if len(part) != len(planned):
            raise ValueError(f"{names[min(len(part), len(names) - 1)]}: a strip's cast gave {len(part)} tensors, the "
                             f"plan names {len(planned)}")
        if start == 0:
            for name, piece in zip(names, part, strict=True):
                first = _first_dim(planned[name])
                # a part per strip: its rows are the output's, in the strip's share (a scale per 128 rows: 1/128)
                if piece.dim() and first is not None and first * min(step, rows) == piece.shape[0] * rows:
                    joined.append(torch.empty((first, *piece.shape[1:]), dtype=piece.dtype, device=piece.device))
                    filled.append(0)
                else:
                    joined.append(piece)
                    filled.append(None)
        for index, piece in enumerate(part):
            done = filled[index]
            if done is None:
                if start and not torch.equal(piece, joined[index]):
                    raise ValueError(f"{names[index]}: the strips of the weight gave different values of a "
                                     f"per-tensor output; this format's cast reads the whole tensor and cannot be "
                                     f"cast in strips")
                continue
            end = done + piece.shape[0]
            if end > joined[index].shape[0] or tuple(piece.shape[1:]) != tuple(joined[index].shape[1:]):
                raise ValueError(f"{names[index]}: a strip's part {tuple(piece.shape)} does not fit the planned "
                                 f"{tuple(joined[index].shape)}")
            joined[index][done:end].copy_(piece)
            filled[index] = end
        del part
    for index, done in enumerate(filled):
        if done is not None and done != joined[index].shape[0]:
            raise ValueError(f"{names[index]}: the strips gave {done} rows of the planned {joined[index].shape[0]}")
    return joined


def _first_dim(entry: Any) -> int | None:
    shape = tuple(entry.shape)
    return shape[0] if shape else None
