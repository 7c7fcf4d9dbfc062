"""The TransformerEngine checkpoint key scheme: scaling state as plain tensors, no pickle.

Details, and the library sources they follow: README.md beside this file.
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
