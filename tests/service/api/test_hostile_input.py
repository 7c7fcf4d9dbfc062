"""Input built to hurt: YAML alias bombs and deep nesting, NUL bytes, corrupt safetensors. Each is refused with a
4xx (or a model error for a job) that says what is wrong, in bounded time and memory, and the keep-alive
connection that carried it still serves the next request."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import pytest

from converters.errors import ModelNotFoundError, RecipeError
from converters.model.safetensors_stream import read_tensor_index
from converters.recipes import load_recipe_file, recipe_from_accelerate_yaml, recipe_from_dict
from service.config import Settings
from tests.models import save_tiny_model
from tests.service_helpers import keepalive_requests, live_app


def _alias_bomb(levels: int = 9) -> str:
    """Each level lists the previous one nine times: 406 bytes that expand to 9**levels strings."""
    lines = ["mixed_precision: fp8", 'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for level in range(1, levels):
        lines.append(f"a{level}: &a{level} [" + ",".join([f"*a{level - 1}"] * 9) + "]")
    lines.append(f"fp8_config: {{backend: TE, margin: *a{levels - 1}}}")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_expands() -> None:
    tracemalloc.start()
    try:
        with pytest.raises(RecipeError, match="Anchors and aliases") as caught:
            recipe_from_accelerate_yaml(_alias_bomb())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"refusing the bomb took {peak} bytes"
    assert len(caught.value.message) < 300


@pytest.mark.parametrize(("text", "words"), [
    ("mixed_precision: fp8\nfp8_config: &c {backend: TE}\n", "Anchors and aliases"),
    ("mixed_precision: fp8\nfp8_config:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 60)), "nests deeper"),
    ("mixed_precision: fp8\nfp8_config: " + "[" * 50_000 + "]" * 50_000 + "\n", "nests deeper"),
    ("mixed_precision: fp8\npad: '" + "x" * (1 << 20) + "'\n", "larger than"),
    ("mixed_precision: [" + ",".join(["1234567890"] * 10_000) + "]\n", "characters)"),
    ("mixed_precision: fp8\nfp8_config: {backend: TE, margin: " + "9" * 5000 + "}\n", "cannot be read"),
])
def test_hostile_yaml_is_refused_with_a_short_message(text: str, words: str) -> None:
    with pytest.raises(RecipeError) as caught:
        recipe_from_accelerate_yaml(text)
    assert words in caught.value.message and len(caught.value.message) < 400


@pytest.mark.parametrize("text", ["[" * 200_000 + "]" * 200_000, '{"backend": "te", "margin": ' + "9" * 5000 + "}"])
def test_a_hostile_json_recipe_file_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "recipe.json"
    path.write_text(text)
    with pytest.raises(RecipeError, match="Not valid JSON") as caught:
        load_recipe_file(path)
    assert len(caught.value.message) < 400


def test_a_huge_value_is_not_echoed() -> None:
    with pytest.raises(RecipeError, match="margin must be .* got <int too large to show>"):
        recipe_from_dict({"backend": "te", "margin": 10**5000})
    with pytest.raises(RecipeError, match=r"got 'xxxx.*\.\.\. \(100002 characters\)"):
        recipe_from_dict({"backend": "te", "margin": "x" * 100_000})


def _header_file(path: Path, header: bytes | dict, *, length: int | None = None, data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize(("header", "length", "data", "words"), [
    ({}, 2**63, b"", "header claims 9223372036854775808 bytes"),
    (b"{not json", None, b"", "not JSON"),
    (b"[1, 2]", None, b"", "not a JSON object"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, None, b"\0" * 4, "outside the file"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, None, b"\0" * 8, "need 16"),
    ({"w": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, None, b"\0" * 8, "dtype 'Q9'"),
    ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, None, b"\0" * 8, "non-negative"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, None, b"\0" * 12, "overlaps"),
    ({"__metadata__": {"x": 1}}, None, b"", "__metadata__"),
    ({"w": [1]}, None, b"", "no dtype/shape/data_offsets"),
])
def test_a_corrupt_safetensors_header_is_named(tmp_path: Path, header, length, data, words) -> None:
    path = _header_file(tmp_path / "model.safetensors", header, length=length, data=data)
    with pytest.raises(ModelNotFoundError) as caught:
        read_tensor_index(path)
    assert words in caught.value.message and "'model.safetensors'" in caught.value.message
    assert str(tmp_path) not in caught.value.message


def test_a_short_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\1\2\3")
    with pytest.raises(ModelNotFoundError, match="shorter than a safetensors header"):
        read_tensor_index(tmp_path / "model.safetensors")


@pytest.fixture
def corrupt_model(tmp_path: Path) -> Path:
    model = save_tiny_model("llama", tmp_path / "models" / "corrupt")
    size = (model / "model.safetensors").stat().st_size
    with open(model / "model.safetensors", "r+b") as handle:  # the header now claims 2**63 bytes
        handle.write(struct.pack("<Q", 2**63))
    assert (model / "model.safetensors").stat().st_size == size
    return model


def test_a_job_on_a_corrupt_checkpoint_fails_with_a_model_error(corrupt_model: Path, tmp_path: Path) -> None:
    from converters.model.sources import ModelSourceOptions
    from converters.pipeline.driver import run_conversion
    from converters.pipeline.request import ConversionRequest

    request = ConversionRequest.from_dict({"model": str(corrupt_model), "recipe": {"backend": "ao"},
                                           "calibration": {"steps": 1, "batch_size": 1, "seq_len": 8}})
    sources = ModelSourceOptions(allowed_roots=(corrupt_model.parent,))
    with pytest.raises(ModelNotFoundError, match="'model.safetensors' is not a valid safetensors file"):
        run_conversion(request, tmp_path / "out", sources)
    assert not (tmp_path / "out").exists()


def test_hostile_requests_get_4xx_on_a_connection_that_survives(tmp_path: Path, corrupt_model: Path) -> None:
    models = corrupt_model.parent
    settings = Settings(data_dir=tmp_path / "data", auth_disabled=True, allowed_model_roots=(models,), workers=0)
    calibrated = {"model": str(corrupt_model), "calibration": {"steps": 1, "batch_size": 1, "seq_len": 8}}
    requests = [
        ("POST", "/v1/jobs", {"model": f"{models}/corrupt\0/x"}),
        ("POST", "/v1/analyze", {"model": "org/na\0me"}),
        ("POST", "/ui/api/recipe-from-yaml", {"yaml": _alias_bomb()}),
        ("POST", "/ui/api/recipe-from-yaml", {"yaml": "a:\n" + " [" * 5000}),
        ("POST", "/v1/analyze", calibrated),
        ("GET", "/healthz", None),
    ]
    with live_app(settings) as client:
        port = int(str(client.base_url).rsplit(":", 1)[1])
        answers = keepalive_requests(port, requests)
    statuses = [status for status, _ in answers]
    assert statuses == [422, 422, 422, 422, 422, 200], answers
    codes = [body["error"]["code"] for _, body in answers[:-1]]
    assert codes == ["invalid_model_reference", "invalid_model_reference", "invalid_recipe", "invalid_recipe",
                     "model_not_found"], answers
    assert "control character" in answers[0][1]["error"]["message"]
    assert "Anchors and aliases" in answers[2][1]["error"]["message"]
    assert all(len(json.dumps(body)) < 1000 for _, body in answers)
