"""A directory swapped for a link while a job reads cannot make it read the server's files.

The attack (issue #34): a model file links to a decoy inside an allowed root, ``tokenizer.json ->
<root>/deep/d/api_keys``, so every check passes; beside ``d`` lies ``dlink -> <data dir>``, and a loop swaps the
two with ``renameat2(RENAME_EXCHANGE)``. A reader that resolved the path, checked it and then opened it by path
(``O_NOFOLLOW`` guards only the last component) read ``<data dir>/api_keys`` whenever the swap fell between the
check and the open. Each reader now opens the file one component at a time from the root, following no link:
under the race it reads the decoy or refuses, never the private file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from converters.errors import ModelReferenceError
from converters.model.files import (
    FileConfinement,
    check_model_directory,
    copy_model_file,
    open_model_file,
    pinned_model_path,
    read_model_text,
    staged_model_directory,
)
from converters.model.safetensors_stream import read_tensor, read_tensor_index
from converters.pipeline.state import NullSink

SECRET = b"alice:user:" + b"5e" * 32 + b"\n"
DECOY = b"a decoy tokenizer inside the allowed root\n"

#: swaps argv[1] and argv[2] until killed: renameat2(RENAME_EXCHANGE) where libc or the x86_64 syscall has it,
#: else two renames (not atomic, so the paths are sometimes missing: a reader must then refuse too)
_SWAPPER = r"""
import ctypes, os, platform, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b = (arg.encode() for arg in sys.argv[1:3])
exchange = getattr(libc, "renameat2", None)
if exchange is None and platform.machine() == "x86_64":
    exchange = lambda *args: libc.syscall(316, *args)
if exchange is not None and exchange(-100, a, -100, b, 2) == 0:
    swap = lambda: exchange(-100, a, -100, b, 2)
else:
    swap = lambda: (os.rename(a, a + b".swap"), os.rename(b, a), os.rename(a + b".swap", b))
print("swapping", flush=True)
while True:
    swap()
"""


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """``models/m`` (the tenant's model) links into the decoy ``models/deep/d``; ``models/deep/dlink`` links to
    the private ``data`` directory, which holds files of the decoys' names."""
    models, data = tmp_path / "models", tmp_path / "data"
    decoy, model = models / "deep" / "d", models / "m"
    for directory in (decoy, model, data):
        directory.mkdir(parents=True)
    (decoy / "api_keys").write_bytes(DECOY)
    (data / "api_keys").write_bytes(SECRET)
    save_file({"w": torch.ones(64)}, decoy / "model.safetensors")
    save_file({"w": torch.full((64,), 7.0)}, data / "model.safetensors")  # the same header: only the bytes differ
    (models / "deep" / "dlink").symlink_to(data)
    (model / "tokenizer.json").symlink_to(decoy / "api_keys")
    (model / "model.safetensors").symlink_to(decoy / "model.safetensors")
    return {"models": models, "data": data, "model": model, "d": decoy, "dlink": models / "deep" / "dlink"}


def _confinement(layout: dict[str, Path]) -> FileConfinement:
    return FileConfinement(roots=(layout["models"].resolve(),), private=(layout["data"].resolve(),))


@contextmanager
def racing(layout: dict[str, Path]) -> Iterator[None]:
    """The swap loop in a child process (a thread would share this process's interpreter lock)."""
    swapper = subprocess.Popen([sys.executable, "-c", _SWAPPER, str(layout["d"]), str(layout["dlink"])],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert swapper.stdout.readline().strip() == "swapping"
        yield
    finally:
        swapper.kill()
        swapper.wait()
    for name in ("d", "dlink"):  # leave the layout as it was (the swap count may have been odd)
        if layout[name].is_symlink() != (name == "dlink"):
            os.rename(layout["d"], layout["d"].with_name("swap"))
            os.rename(layout["dlink"], layout["d"])
            os.rename(layout["d"].with_name("swap"), layout["dlink"])
            break


def _attempt(read) -> str:
    """``read()``'s bytes classified: the decoy's, the private file's, or refused (a model error, or the file
    missing for an instant where the swap is two renames)."""
    try:
        data = read()
    except ModelReferenceError:
        return "refused"
    except FileNotFoundError:
        return "refused"
    return "private" if data in (SECRET, 7.0) else "decoy" if data in (DECOY, 1.0) else f"other {data!r}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the swap needs Linux's renameat2")
def test_copies_under_the_rename_race_never_read_the_private_file(layout, tmp_path: Path) -> None:
    confinement, copy = _confinement(layout), tmp_path / "tokenizer.json"

    def read() -> bytes:
        copy_model_file(layout["model"] / "tokenizer.json", copy, confinement)
        return copy.read_bytes()

    with racing(layout):
        outcomes = Counter(_attempt(read) for _ in range(3000))
    # both states of the swap were met (so the race ran), and the private file was never read
    assert set(outcomes) == {"decoy", "refused"}, outcomes
    assert not any(path.read_bytes() == SECRET for path in tmp_path.glob("*tokenizer.json*"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the swap needs Linux's renameat2")
def test_weight_tokenizer_and_config_readers_under_the_race_never_read_the_private_file(layout) -> None:
    # checked first, as every job does: the readers that get a path only use the confinement it was checked with
    check_model_directory(layout["model"], _confinement(layout), shown="m")
    weights, model = layout["model"] / "model.safetensors", layout["model"]

    def header_and_tensor() -> float:  # the layer-sequential and serving readers: header, then pread
        tensors, _ = read_tensor_index(weights)
        return float(read_tensor(tensors["w"])[0])

    def library_read() -> float:  # safe_open (the checkpoint loader, the quality measure): a pinned path
        with pinned_model_path(weights) as pinned, safe_open(pinned, framework="pt") as handle:
            return float(handle.get_tensor("w")[0])

    def staged() -> bytes:  # from_pretrained's tokenizer and config: a private staging directory
        with staged_model_directory(model, copies=["tokenizer.json", "config.json"],
                                    links=["model.safetensors"]) as directory:
            assert oct((directory.parent.stat().st_mode) & 0o777) == oct(0o700)
            with safe_open(directory / "model.safetensors", framework="pt") as handle:
                assert float(handle.get_tensor("w")[0]) == 1.0
            return (directory / "tokenizer.json").read_bytes()

    with racing(layout):
        outcomes = {read.__name__: Counter(_attempt(read) for _ in range(600))
                    for read in (header_and_tensor, library_read, staged)}
    for name, counts in outcomes.items():
        assert set(counts) == {"decoy", "refused"}, (name, counts)



def test_a_reader_given_no_confinement_keeps_to_the_one_its_directory_was_checked_against(layout, tmp_path) -> None:
    """The weight and index readers get a path only: they use the confinement this process checked the model
    directory against, and for a file in no checked directory follow no link out of its own directory."""
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "tokenizer.json").symlink_to(layout["d"] / "api_keys")
    with pytest.raises(ModelReferenceError, match="'tokenizer.json' is a link to a file outside"):
        open_model_file(loose / "tokenizer.json")
    check_model_directory(layout["model"], _confinement(layout), shown="m")
    assert read_model_text(layout["model"] / "tokenizer.json").encode() == DECOY
    (layout["model"] / "vocab.txt").symlink_to(layout["data"] / "api_keys")  # made after the check
    with pytest.raises(ModelReferenceError, match="'vocab.txt' is a link to a file outside"):
        read_model_text(layout["model"] / "vocab.txt")


class _RaceFromAnalyze(NullSink):
    """A progress sink that starts the swap loop once the job has resolved (and checked) its model directory, as
    a tenant would once the job is running; ``stop()`` ends it."""

    def __init__(self, layout: dict[str, Path]) -> None:
        super().__init__()
        self.layout, self.race = layout, None

    def stage(self, name: str) -> None:
        if name != "resolve" and self.race is None:
            self.race = racing(self.layout)
            self.race.__enter__()

    def stop(self) -> None:
        if self.race is not None:
            self.race.__exit__(None, None, None)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the swap needs Linux's renameat2")
def test_a_job_under_the_race_publishes_the_decoy_or_fails_never_the_private_file(layout, tmp_path: Path) -> None:
    """The issue's job: a tokenizer side file links to the decoy, the swap runs from the analyze stage on. Each
    run either succeeds with the decoy's bytes in its artifact or fails with invalid_model_reference."""
    from converters.model.sources import ModelSourceOptions
    from converters.pipeline.driver import run_conversion
    from converters.pipeline.request import ConversionRequest
    from tests.models import save_tiny_model

    for name in ("model.safetensors", "tokenizer.json"):  # the fixture's links: this job converts real weights
        (layout["model"] / name).unlink()
    model = save_tiny_model("llama", layout["model"])
    (model / "vocab.txt").symlink_to(layout["d"] / "api_keys")
    sources = ModelSourceOptions(allowed_roots=(layout["models"],), private_paths=(layout["data"],),
                                 cache_dir=tmp_path / "hf-cache", offline=True)
    request = ConversionRequest.from_dict({"model": str(model), "recipe": {"backend": "ao"},
                                           "calibration": {"steps": 1, "batch_size": 1, "seq_len": 8}})
    outcomes = []
    for attempt in range(3):
        sink = _RaceFromAnalyze(layout)
        try:
            result = run_conversion(request, tmp_path / f"out{attempt}", sources, sink)
        except ModelReferenceError as exc:
            assert str(layout["data"]) not in exc.message
            outcomes.append(exc.message)
        else:
            assert (result.out_dir / "vocab.txt").read_bytes() == DECOY
            outcomes.append("decoy")
        finally:
            sink.stop()
    written = [Path(top) / name for top, _, names in os.walk(tmp_path) if not top.startswith(str(layout["data"]))
               for name in names]  # os.walk follows no link
    assert not [path for path in written if path.is_file() and not path.is_symlink()
                and path.stat().st_size < 1 << 20 and SECRET in path.read_bytes()]
    assert sink.race is not None and all(outcome == "decoy" or "'vocab.txt'" in outcome for outcome in outcomes)
