"""A local model path that names no readable model directory is refused by POST /v1/jobs on arrival (422
``model_not_found``, field ``model``, naming the path and the fix) instead of being queued (202) and failing in a
worker seconds later, as docs/service.md promises; a path outside the allowed roots keeps its own refusal."""

from __future__ import annotations

import os

import pytest

from service.config import Settings
from tests.service_helpers import build_tiny_llama, live_app


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("submit-path") / "models"
    build_tiny_llama(root / "tiny-llama")
    (root / "empty").mkdir()
    (root / "notes.txt").write_text("not a model\n")
    return root


@pytest.fixture(scope="module")
def client(models, tmp_path_factory):
    data = tmp_path_factory.mktemp("submit-path-data")
    settings = Settings(data_dir=data, auth_disabled=True, allowed_model_roots=(models,))
    with live_app(settings) as live:
        yield live


def _refusal(client, model: str) -> dict:
    answer = client.post("/v1/jobs", json={"model": model, "recipe": {"backend": "ao"}})
    assert answer.status_code == 422, answer.text
    return answer.json()["error"]


def test_a_typo_in_a_local_path_is_refused_on_arrival_with_the_near_name(client, models):
    typo = str(models / "tiny-lama")
    error = _refusal(client, typo)
    assert (error["code"], error["field"]) == ("model_not_found", "model")
    assert f"{typo!r} does not exist" in error["message"]
    assert f"did you mean {str(models / 'tiny-llama')!r}" in error["message"]
    assert client.get("/v1/jobs").json()["count"] == 0  # nothing queued
    assert client.post("/v1/jobs", json={"model": str(models / "tiny-llama"), "recipe": {"backend": "ao"}}
                       ).status_code == 202


def test_a_missing_directory_with_no_near_name_says_how_to_fix_it(client, models):
    error = _refusal(client, str(models / "org" / "qwen2-7b"))
    assert error["code"] == "model_not_found"
    assert "did you mean" not in error["message"]
    assert "save_pretrained" in error["message"] and "allowed root" in error["message"]


def test_a_file_and_a_directory_without_config_are_refused(client, models):
    file_error = _refusal(client, str(models / "notes.txt"))
    assert "is a file, not a model directory" in file_error["message"], file_error
    empty_error = _refusal(client, str(models / "empty"))
    assert "has no config.json" in empty_error["message"] and "save_pretrained" in empty_error["message"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every directory: an unreadable one cannot be made")
def test_an_unreadable_directory_is_refused(client, models, tmp_path):
    locked = models / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        error = _refusal(client, str(locked))
        assert "cannot be read by the server" in error["message"]
    finally:
        locked.chmod(0o755)


def test_a_path_outside_the_allowed_roots_keeps_its_own_error(client, tmp_path):
    outside = tmp_path / "elsewhere" / "llama"  # neither exists nor lies below an allowed root
    error = _refusal(client, str(outside))
    assert error["code"] == "invalid_model_reference"
    assert "not below a directory this server accepts models from" in error["message"]
    assert "does not exist" not in error["message"] and "did you mean" not in error["message"]
