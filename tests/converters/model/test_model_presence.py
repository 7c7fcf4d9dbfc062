"""A typo'd local model path gets the same refusal from the CLI and the Python API as from POST /v1/jobs
(tests/service/api/test_submit_model_path.py): what is wrong, the fix, and the nearest model directory beside it,
in the spelling the user wrote; before any work, and leaving no output behind."""

from __future__ import annotations

import pytest

from converters import api
from converters.errors import ModelNotFoundError
from service.cli.main import main
from tests.service_helpers import build_tiny_llama


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("presence")
    build_tiny_llama(root / "models" / "tiny-llama")
    (root / "models" / "weights.safetensors").write_bytes(b"not a directory")
    return root


def test_the_cli_names_the_near_directory_in_the_users_spelling(models, monkeypatch, capsys):
    monkeypatch.chdir(models)
    code = main(["convert", "./models/tiny-lama", "--out", "out/x", "--backend", "ao", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "local model directory './models/tiny-lama' does not exist" in err
    assert "did you mean './models/tiny-llama'?" in err and "save_pretrained" in err
    assert not (models / "out").exists()


def test_the_python_api_says_a_file_is_not_a_model_directory(models):
    with pytest.raises(ModelNotFoundError) as caught:
        api.convert(str(models / "models" / "weights.safetensors"), models / "out-file", recipe={"backend": "ao"},
                    sources=api.local_sources(models, offline=True))
    assert "is a file, not a model directory" in caught.value.message and caught.value.field == "model"
    with pytest.raises(ModelNotFoundError, match="did you mean") as near:
        api.analyze(str(models / "models" / "tiny_llama"), sources=api.local_sources(models, offline=True))
    assert repr(str(models / "models" / "tiny-llama")) in near.value.message
    assert not (models / "out-file").exists()
