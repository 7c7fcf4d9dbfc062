"""The source's weight files copied into the artifact while calibration runs.

A TE or torchao artifact holds the source's weight files byte for byte, so their copy needs nothing from
calibration: it starts as soon as resolve has found the files, in one background thread (the kernel copies,
``sendfile``), and export only waits for it. The job then costs about the longer of the copy and the
calibration forward instead of their sum. The same thread checksums each copied file for the manifest, so
that pass over the bytes is off the job's path too. A failed copy fails the job at export; a job that fails
or is cancelled first stops the copy between files and waits for it before its staging directory is removed.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from converters.artifact.files import copy_weight_files
from converters.artifact.layout import sha256_file
from converters.model.checkpoint import weight_files
from converters.model.files import FileConfinement
from converters.model.quantized.stored import write_dequantized_files
from converters.model.sources import confinement_for

__all__ = ["BackgroundWeightCopy", "start_weight_copy"]


class BackgroundWeightCopy:
    """Copy ``files`` (and their index) into ``directory`` in a background thread; :meth:`result` waits."""

    def __init__(self, files: list[Path], directory: Path, confinement: FileConfinement, *,
                 checkpoint: Any = None) -> None:
        """``checkpoint``: the source's :class:`~converters.model.checkpoint.Checkpoint`; when the source is stored
        quantized, its weights are written dequantized to the model's dtype instead of copied."""
        self._stop = threading.Event()
        self._names: list[str] = []
        self._digests: dict[str, str] = {}
        self._error: BaseException | None = None
        self._checkpoint = checkpoint
        self._thread = threading.Thread(target=self._copy, args=(files, directory, confinement),
                                        name="fp8forge-weight-copy", daemon=True)
        self._thread.start()

    @classmethod
    def of_source(cls, resolved: Any, staging: Path, sources: Any) -> BackgroundWeightCopy:
        """The copy of the resolved source's (``run.resolved``) weight files into ``staging``, started."""
        return cls(weight_files(resolved.directory), staging, confinement_for(sources), checkpoint=resolved.checkpoint)

    def _copy(self, files: list[Path], directory: Path, confinement: FileConfinement) -> None:
        try:
            stored = getattr(self._checkpoint, "stored", None)
            if stored is not None:  # the artifact holds the high-precision weights a quantized source stands for
                self._names = write_dequantized_files(files, directory, stored, self._checkpoint.dtype,
                                                      should_stop=self._stop.is_set, digests=self._digests)
            else:
                self._names = copy_weight_files(files, directory, confinement, should_stop=self._stop.is_set)
            for name in self._names:
                if self._stop.is_set():
                    return
                if name not in self._digests:  # a dequantized weight file was hashed as it was written
                    self._digests[name] = sha256_file(directory / name)
        except BaseException as exc:  # handed to the job's thread by result()
            self._error = exc

    def result(self) -> list[str]:
        """The names of the files copied, once the copy is done; its error, raised here, if it failed."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._names

    def digests(self) -> dict[str, str]:
        """The sha256 of each copied file, by name (after :meth:`result`)."""
        return dict(self._digests)

    def abandon(self) -> None:
        """Stop after the file being copied and wait: the caller is about to remove ``directory``."""
        self._stop.set()
        self._thread.join()


def start_weight_copy(run: Any) -> None:
    """Start the artifact's copy of the run's source (``run.resolved``: the source the job converts, or its smoothed
    copy) into the run's staging directory, once. A run with no staging directory (a rank that only calibrates)
    writes no artifact and copies nothing."""
    if run.staging is not None and run.weight_copy is None:
        run.weight_copy = BackgroundWeightCopy.of_source(run.resolved, run.staging, run.sources)
