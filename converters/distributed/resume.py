"""The resume record of a layer-sequential calibration: what the finished layers recorded, and the last one's outputs.

It lives beside the job's output directory, in ``.<out name>.resume/`` (:func:`resume_dir_for`), on storage every
rank can reach (a cluster's shared file system). After each layer:

* every rank writes its steps' outputs of that layer, ``hidden/layer-<i>-step-<s>.safetensors`` (one file a step,
  so that a restart with another number of ranks reads its own share);
* with GPTQ rounding, also its steps of each rounding family's stream (the hidden states the rounded layers give),
  ``hidden/layer-<i>-step-<s>-<family>.safetensors``, and rank 0 the layer's rounded weights, ``rounded/<file>``;
* then, once all ranks have written theirs, rank 0 writes ``layer-<i>.safetensors``: the layer's amax (reduced over
  the ranks), its attention layers' KV amax and KV scale search, its SQNR sums and its rounded weights' files; that
  file is what says the layer is finished. The previous layer's outputs are then removed.

Every file is written to a temporary name, fsynced and renamed into place, so a reader never sees half of one.
``job.json`` holds the job's fingerprint (request, model files, calibration data, layers): a record left by a
different job is discarded, never resumed. The record is removed once the artifact is published.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, save

from converters.calibration.kv_cache import KvAmax
from converters.calibration.kv_search import KvSearch
from converters.errors import Fp8ForgeError
from converters.model.files import is_plain_file_name

__all__ = ["LayerRecord", "ResumeStore", "resume_dir_for", "atomic_write"]

_JOB_FILE = "job.json"
_FORMAT = 1


def resume_dir_for(out_dir: Path) -> Path:
    """Where the resume record of the job writing ``out_dir`` lives: its hidden sibling ``.<name>.resume``."""
    return out_dir.parent / f".{out_dir.name}.resume"


def atomic_write(path: Path, data: bytes) -> None:
    """``data`` at ``path`` through a temporary file, fsynced, renamed into place, and the directory fsynced (so the
    rename itself survives a crash of the host)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


@dataclass(frozen=True)
class LayerRecord:
    """What one finished layer recorded, reduced over the ranks."""

    index: int
    amax: dict[str, dict[str, torch.Tensor]]  #: path -> {"forward", and "backward", "tokens" where recorded}
    kv: dict[str, KvAmax]  #: attention path -> its KV amax, dtype and chosen clipping
    sqnr: list[tuple[str, str, str, float, float]]  #: (path, label, what, signal, noise)
    #: GPTQ rounding: family -> weight key -> its file under ``rounded/`` (the layer's weights it rounded)
    rounded: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        tensors = {f"amax/{path}/{name}": tensor.contiguous() for path, parts in self.amax.items()
                   for name, tensor in parts.items()}
        tensors.update({f"kv/{path}/{name}": tensor.contiguous() for path, amax in self.kv.items()
                        for name, tensor in (("key", amax.key), ("value", amax.value))})
        # safetensors keeps no order: the amax order (that of a whole run's result) is in the metadata
        metadata = {"format": str(_FORMAT), "layer": str(self.index),
                    "amax": json.dumps({path: list(parts) for path, parts in self.amax.items()}),
                    "kv": json.dumps({path: str(amax.dtype).removeprefix("torch.") for path, amax in self.kv.items()}),
                    "kv_search": json.dumps({path: asdict(amax.search) for path, amax in self.kv.items()
                                             if amax.search is not None}),
                    "sqnr": json.dumps(self.sqnr),  # Python floats print and parse back exactly
                    "rounded": json.dumps(self.rounded)}
        return save(tensors, metadata=metadata)

    @classmethod
    def from_file(cls, path: Path) -> LayerRecord:
        data = path.read_bytes()
        tensors = load(data)
        metadata = _metadata(data)
        amax = {name: {part: tensors[f"amax/{name}/{part}"] for part in parts}
                for name, parts in json.loads(metadata["amax"]).items()}
        searches = {name: KvSearch(**{field: tuple(value) if isinstance(value, list) else value
                                      for field, value in search.items()})
                    for name, search in json.loads(metadata.get("kv_search", "{}")).items()}
        kv = {name: KvAmax(key=tensors[f"kv/{name}/key"], value=tensors[f"kv/{name}/value"],
                           dtype=getattr(torch, dtype), search=searches.get(name))
              for name, dtype in json.loads(metadata["kv"]).items()}
        sqnr = [tuple(entry) for entry in json.loads(metadata["sqnr"])]
        return cls(index=int(metadata["layer"]), amax=amax, kv=kv, sqnr=sqnr,
                   rounded=json.loads(metadata.get("rounded", "{}")))


def _metadata(data: bytes) -> dict[str, str]:
    header = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + header]).get("__metadata__", {})


def fingerprint(parts: Iterable[Any]) -> str:
    """sha256 over the JSON of ``parts`` (strings, numbers, lists, dicts) and the bytes of any tensor among them."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            digest.update(part.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(json.dumps(part, sort_keys=True, default=str).encode())
    return digest.hexdigest()


class ResumeStore:
    """The resume record of one job at ``directory`` (see the module docstring)."""

    def __init__(self, directory: Path, job: str) -> None:
        self.directory = Path(directory)
        self.job = job  #: the job's fingerprint
        self.hidden_dir = self.directory / "hidden"

    def open(self, *, writer: bool) -> bool:
        """Whether the record holds this job's layers. The ``writer`` (rank 0, before any other rank reads) starts
        a fresh record when there is none or it belongs to another job."""
        job_file = self.directory / _JOB_FILE
        try:
            ours = json.loads(job_file.read_text(encoding="utf-8")).get("job") == self.job
        except (OSError, ValueError):
            ours = False
        if writer and not ours:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.hidden_dir.mkdir(parents=True)
            atomic_write(job_file, json.dumps({"format": _FORMAT, "job": self.job}).encode())
        return ours

    def finished(self, layers: int) -> list[LayerRecord]:
        """The records of layers 0, 1, ... up to the first one missing (a later one without it is not used)."""
        records = []
        for index in range(layers):
            path = self.directory / f"layer-{index}.safetensors"
            if not path.is_file():
                break
            records.append(LayerRecord.from_file(path))
        return records

    def save_outputs(self, index: int, steps: list[int], outputs: list[torch.Tensor], stream: str = "") -> None:
        """This rank's outputs of layer ``index``, one file per calibration step; ``stream``: another stream's than
        the calibration's own (a GPTQ rounding family's)."""
        for step, output in zip(steps, outputs, strict=True):
            atomic_write(self._hidden(index, step, stream), save({"hidden": output.cpu().contiguous()}))

    def load_outputs(self, index: int, steps: list[int], stream: str = "") -> list[torch.Tensor]:
        """Layer ``index``'s outputs at ``steps`` (of ``stream``). Raises Fp8ForgeError naming a missing file."""
        outputs = []
        for step in steps:
            path = self._hidden(index, step, stream)
            if not path.is_file():
                raise Fp8ForgeError(f"the resume record in {self.directory} says layer {index} is finished but lacks "
                                    f"its output for step {step} ({path.name}); remove {self.directory} to start the "
                                    "calibration over", field="resume")
            outputs.append(load(path.read_bytes())["hidden"])
        return outputs

    def save_rounded(self, files: list[Path]) -> None:
        """Copies of a layer's rounded-weights ``files`` (before its record names them)."""
        (self.directory / "rounded").mkdir(exist_ok=True)
        for file in files:
            atomic_write(self.directory / "rounded" / file.name, file.read_bytes())

    def restore_rounded(self, records: list[LayerRecord], directory: Path) -> None:
        """The finished layers' rounded-weights files back in ``directory`` (the run's, which a restart made anew)."""
        directory.mkdir(parents=True, exist_ok=True)
        for name in sorted({name for record in records for files in record.rounded.values()
                            for name in files.values()}):
            if not is_plain_file_name(name):
                raise Fp8ForgeError(f"the resume record in {self.directory} names the rounded weights {name!r}, not a "
                                    f"file name of its own; remove {self.directory} to start the calibration over",
                                    field="resume")
            source = self.directory / "rounded" / name
            if not source.is_file():
                raise Fp8ForgeError(f"the resume record in {self.directory} lacks the rounded weights {name}; remove "
                                    f"{self.directory} to start the calibration over", field="resume")
            atomic_write(directory / name, source.read_bytes())

    def save_layer(self, record: LayerRecord) -> None:
        """Mark layer ``record.index`` finished (after every rank saved its outputs); drop the previous outputs."""
        atomic_write(self.directory / f"layer-{record.index}.safetensors", record.to_bytes())
        for stale in self.hidden_dir.glob(f"layer-{record.index - 1}-step-*.safetensors"):
            stale.unlink(missing_ok=True)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def _hidden(self, index: int, step: int, stream: str = "") -> Path:
        return self.hidden_dir / f"layer-{index}-step-{step}{'-' + stream if stream else ''}.safetensors"
