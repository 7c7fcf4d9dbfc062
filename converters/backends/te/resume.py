"""Resuming FP8 training from an artifact: its delayed-scaling state restored as written, or re-seeded from a few
calibration steps on the resumed weights.

Scales that went stale (the weights moved since the state was recorded, or the history holds another data mix)
are behind the loss spikes seen after resuming delayed-scaling runs. TE's advice is to run a few steps under
``autocast(calibrating=True)`` first; that only copies each step's amax into row 0 (no history, scale 1) and needs
one real FP8 step for scales. fp8forge instead records the amax of every converted Linear over the steps and
computes the history and scale TE's own update would hold after them (:mod:`converters.calibration.scaling`, the
algorithm of TE's ``delayed_scaling.cu``), so the state is complete before the first FP8 step and runs on a CPU.
``load_te(dir, reseed_steps=N)`` does it while loading (CUDA + TE); :func:`reseeded_scaling_state` anywhere.
"""

from __future__ import annotations

from pathlib import Path

import torch

from converters.backends.te.loader import read_te_artifact
from converters.backends.te.reseed import reseed_from_calibration
from converters.model.sources import ModelSourceOptions, load_model, load_tokenizer

__all__ = ["reseed_from_calibration", "reseeded_scaling_state"]


def reseeded_scaling_state(directory: str | Path, *, steps: int = 4, batch_size: int = 2, seq_len: int = 128,
                           backward: bool = True, device: str | torch.device = "cpu"
                           ) -> dict[str, dict[str, torch.Tensor]]:
    """:func:`reseed_from_calibration` on the weights in ``directory`` (an artifact whose weight files may be those of
    a resumed run), for its ``converted_modules``; CPU tensors. Needs no TE. MoE experts GEMMs keep the artifact's
    state.

    Raises the errors of :func:`~converters.backends.te.loader.read_te_artifact` and of the calibration.
    """
    directory = Path(directory).resolve()
    artifact = read_te_artifact(directory)
    sources = ModelSourceOptions(allowed_roots=(directory,))
    model = load_model(directory, sources).to(device)
    states = reseed_from_calibration(model, artifact.converted_modules, artifact.recipe,
                                     tokenizer=load_tokenizer(directory, sources), steps=steps,
                                     batch_size=batch_size, seq_len=seq_len, backward=backward)
    return {path: {name: tensor.cpu() for name, tensor in state.items()} for path, state in states.items()}
