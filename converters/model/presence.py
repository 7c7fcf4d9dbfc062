"""Is a local model where its reference says? A typo'd path is refused with what is wrong and the fix, and the
nearest model directory beside it ("did you mean"), by the API on arrival (``analysis.include_check``) and by the
CLI and Python API before any work (``model.sources.resolve_model_dir``): the same words wherever it is caught.

Only a path that passed the allowed-root rules gets here, so nothing is said of what exists outside them; the
suggestion too must lie where the server may read models (``FileConfinement``).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from converters.errors import ModelNotFoundError
from converters.model.files import FileConfinement

__all__ = ["check_local_model_present"]

#: How many entries of a missing model's parent directory are compared with its name for a "did you mean": a
#: client's typo must not make the check list a directory of a million files.
_NEAR_NAME_SCAN = 2000


def check_local_model_present(path: Path, shown: str, confinement: FileConfinement) -> None:
    """Refuse a local model ``path`` (resolved; ``shown`` as the client wrote it) that is not a readable directory
    holding a config.json.

    Raises:
        ModelNotFoundError (field ``model``): naming ``shown``, what is wrong and the fix; a missing path gets the
            nearest model directory beside it when there is one.
    """
    if not path.exists():
        near = _near_model_dir(path, shown, confinement)
        hint = f"did you mean {near!r}? " if near else ""
        raise ModelNotFoundError(
            f"local model directory {shown!r} does not exist on this server; {hint}check the spelling: the path must "
            "name a directory written by save_pretrained (with its config.json), below an allowed root",
            field="model")
    if not path.is_dir():
        raise ModelNotFoundError(f"local model {shown!r} is a file, not a model directory; give the directory that "
                                 "holds config.json and the safetensors files", field="model")
    config = path / "config.json"
    if not os.access(path, os.R_OK | os.X_OK) or (config.exists() and not os.access(config, os.R_OK)):
        raise ModelNotFoundError(f"local model directory {shown!r} cannot be read by the server (permission "
                                 "denied); make it and its files readable by the user the server runs as",
                                 field="model")
    if not config.is_file():
        raise ModelNotFoundError(f"local model directory {shown!r} has no config.json; point at a Hugging Face model "
                                 "directory (one written by save_pretrained)", field="model")


def _near_model_dir(path: Path, shown: str, confinement: FileConfinement) -> str | None:
    """``shown`` with its last segment replaced by the closest name of a model directory beside ``path``, when that
    directory lies where this server may read models; else None."""
    parent, name = path.parent, path.name
    if not parent.is_dir() or not confinement.allows(parent):
        return None
    try:
        with os.scandir(parent) as entries:
            names = [entry.name for _, entry in zip(range(_NEAR_NAME_SCAN), entries, strict=False)]
    except OSError:
        return None
    for candidate in difflib.get_close_matches(name, names, n=3, cutoff=0.75):
        real = (parent / candidate).resolve()
        if confinement.allows(real) and (real / "config.json").is_file():
            return os.path.join(os.path.dirname(shown.rstrip("/\\")), candidate)
    return None
