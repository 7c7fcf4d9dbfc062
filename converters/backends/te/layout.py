"""The TransformerEngine checkpoint key scheme: scaling state as plain tensors, no pickle.

Each converted layer ``P`` keeps ``P.weight`` and ``P.bias`` (as ``te.Linear`` names them) and carries
its delayed-scaling state under four sibling keys:

============================  ==========  =================================================
key                           shape       meaning (slot order as in TE's ``fp8_meta``)
============================  ==========  =================================================
``P.fp8_scale_fwd``           ``[3]``     scale of input, weight, output
``P.fp8_amax_history_fwd``    ``[L, 3]``  amax history, row 0 = slot of the next step
``P.fp8_scale_bwd``           ``[2]``     scale of grad_output, grad_input
``P.fp8_amax_history_bwd``    ``[L, 2]``  amax history of the backward tensors
============================  ==========  =================================================

All are float32. ``L`` is the recipe's ``amax_history_len``. The same names (without ``fp8_``) are the
keys TE itself uses inside its pickled ``_extra_state``.

Mixture-of-experts GEMMs (``converters.model.experts``) carry the state of TE's ``GroupedLinear`` with one GEMM per
expert, under ``<experts module>.<gemm>`` (``gemm`` is ``gate_up_proj`` or ``down_proj``): ``fp8_scale_fwd
[3E]``, ``fp8_amax_history_fwd [L, 3E]``, ``fp8_scale_bwd [2E]``, ``fp8_amax_history_bwd [L, 2E]``. The slots
are interleaved per GEMM as GroupedLinear orders them: forward slot ``3e`` is expert e's input, ``3e + 1`` its
weight, ``3e + 2`` its output; backward slot ``2e`` its grad_output, ``2e + 1`` its grad_input
(TransformerEngine ``pytorch/module/grouped_linear.py``: ``self._offsets = {"input": 0, "weight": 1,
"output": 2, "grad_output": 0, "grad_input": 1}``, ``self._num_fp8_tensors_per_gemm = {"fwd": 3, "bwd": 2}``,
quantizer of GEMM i at ``offset + i * num_fp8_tensors_per_gemm``; ``base.py`` sizes the tensors
``num_gemms * 3`` and ``num_gemms * 2``). GroupedLinear never casts its outputs or grad_inputs, so those
slots keep amax 0 and scale 1, as in TE.
"""

from __future__ import annotations

import torch

__all__ = ["TE_STATE_NAMES", "state_key", "split_state_key", "grouped_state"]

TE_STATE_NAMES = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
_PREFIX = "fp8_"


def state_key(layer_path: str, name: str) -> str:
    """``state_key("model.layers.0.mlp.up_proj", "scale_fwd")`` -> ``"model.layers.0.mlp.up_proj.fp8_scale_fwd"``."""
    if name not in TE_STATE_NAMES:
        raise ValueError(f"unknown TE state name {name!r}; expected one of {TE_STATE_NAMES}")
    return f"{layer_path}.{_PREFIX}{name}"


def split_state_key(key: str) -> tuple[str, str] | None:
    """Inverse of :func:`state_key`; ``None`` for keys that are not scaling state."""
    layer_path, _, leaf = key.rpartition(".")
    name = leaf.removeprefix(_PREFIX)
    if leaf.startswith(_PREFIX) and name in TE_STATE_NAMES:
        return layer_path, name
    return None


def grouped_state(per_gemm: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """GroupedLinear's state from the te.Linear-shaped state of each of its GEMMs, in GEMM order.

    Concatenating each GEMM's ``[input, weight, output]`` (and ``[grad_output, grad_input]``) along the slot
    dimension gives exactly GroupedLinear's interleaved order (see the module docstring).
    """
    return {name: torch.cat([state[name] for state in per_gemm], dim=-1) for name in TE_STATE_NAMES}
