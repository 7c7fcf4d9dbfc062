"""Requantize writes the same bytes as the implementation before the shard-rewrite engine did.

``golden_bytes.json`` holds the sha256 of every file (but the report and the manifest, which carry figures and the
report's hash) that ``convert_model_free`` wrote for each target on the suite's tiny Llama and Mixtral, each saved
in several shards (fused groups straddle them), and for quantized sources converted to another target. It was
recorded with the per-tensor writer of ``converters.modelfree.tasks`` before that writer moved onto
``converters.rewrite``; set ``FP8FORGE_RECORD_GOLDEN=1`` to record it again (only when a format's bytes are meant
to change, saying why in the commit).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from converters.modelfree import convert_model_free
from converters.modelfree.targets import MODEL_FREE_TARGETS

GOLDEN = Path(__file__).with_name("golden_bytes.json")
#: every model-free target the tiny Llama can take (its dims are multiples of 128), bf16 aside (it needs a
#: quantized source)
LLAMA_TARGETS = tuple(name for name in MODEL_FREE_TARGETS if name != "bf16")
MIXTRAL_TARGETS = ("compressed-tensors-fp8-dynamic", "mxfp8", "nvfp4-a16")  # hidden 64: no whole 128-blocks
#: (source target, target): a quantized source dequantized, then converted again
RETARGETS = (("fp8-block", "bf16"), ("fp8-block", "mxfp8"), ("nvfp4-a16", "compressed-tensors-fp8-dynamic"),
             ("mxfp8", "fp8-block"), ("compressed-tensors-fp8-dynamic", "nvfp4-a16"))
_NOT_HASHED = {"requantize_report.json", "manifest.json"}


def _resharded(source: Path, directory: Path, max_shard_size: str) -> Path:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(source).save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def _content(path: Path) -> bytes:
    """The file's bytes; a JSON config without its ``transformers_version`` stamp, which names the transformers
    installed where the test runs (``>=5.24,<6``), not anything the writer chose."""
    if path.suffix != ".json":
        return path.read_bytes()
    config = json.loads(path.read_text())
    config.pop("transformers_version", None)
    return json.dumps(config, sort_keys=True).encode()


def _hashes(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(_content(path)).hexdigest() for path in sorted(directory.iterdir())
            if path.is_file() and path.name not in _NOT_HASHED}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, dict[str, str]]:
    """``model/target`` (``model/source->target`` for a quantized source) -> file name -> sha256."""
    root = tmp_path_factory.mktemp("golden")
    with pytest.MonkeyPatch.context() as patch:
        # strips of 1 Ki elements (4 Ki for formats of strip_factor 4): the tiny models' weights are cast in several
        # strips of rows (each format's row-separable cast, converters.rewrite.strips), and must give the bytes of
        # the whole-tensor cast
        patch.setattr("converters.rewrite.strips.STRIP_ELEMENTS", 1 << 10)
        return _convert_all(root)


def _convert_all(root: Path) -> dict[str, dict[str, str]]:
    from converters.model.demo import build_tiny_llama
    from tests.models import save_tiny_moe

    llama = _resharded(build_tiny_llama(root / "llama-one"), root / "llama", "100KB")
    mixtral = _resharded(save_tiny_moe("mixtral", root / "mixtral-one"), root / "mixtral", "300KB")
    hashes = {}
    for source, targets in ((llama, LLAMA_TARGETS), (mixtral, MIXTRAL_TARGETS)):
        for target in targets:
            convert_model_free(source, root / f"{source.name}-{target}", target)
            hashes[f"{source.name}/{target}"] = _hashes(root / f"{source.name}-{target}")
    for first, target in RETARGETS:
        out = root / f"llama-{first}-{target}"
        convert_model_free(root / f"llama-{first}", out, target)
        hashes[f"llama/{first}->{target}"] = _hashes(out)
    shutil.rmtree(root)
    return hashes


def test_every_target_writes_the_recorded_bytes(outputs):
    if os.environ.get("FP8FORGE_RECORD_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(outputs, indent=1, sort_keys=True) + "\n")
    recorded = json.loads(GOLDEN.read_text())
    assert sorted(outputs) == sorted(recorded)
    for case, files in outputs.items():
        assert sorted(files) == sorted(recorded[case]), case
        changed = [name for name, digest in files.items() if recorded[case][name] != digest]
        assert not changed, f"{case}: {changed} differ from the bytes the previous writer wrote"
