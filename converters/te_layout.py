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
"""

from __future__ import annotations

__all__ = ["TE_STATE_NAMES", "state_key", "split_state_key", "FORWARD_SLOTS", "BACKWARD_SLOTS"]

TE_STATE_NAMES = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
FORWARD_SLOTS = ("input", "weight", "output")
BACKWARD_SLOTS = ("grad_output", "grad_input")
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
