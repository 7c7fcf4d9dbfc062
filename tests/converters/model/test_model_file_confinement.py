"""A model directory's links cannot make a job read files outside the places models come from.

The attack: a directory below an allowed root whose tokenizer or side files link to the server's own files
(its job database, its key file, anything else); the worker copied them into the artifact and any key could
download them. Every file is now resolved and checked before a job reads it, and copied without following a
link out.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from converters.errors import ModelReferenceError
from converters.model.files import FileConfinement, copy_model_file
from converters.model.sources import ModelSourceOptions, resolve_model_dir, validate_model_reference
from service.config import Settings
from tests.models import install_in_hf_cache, save_tiny_model
from tests.service_helpers import ServeProcess, live_app, sse_events, wait_for


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    models = tmp_path / "models"
    data = tmp_path / "data"
    data.mkdir()
    (data / "api_keys").write_text("alice:user:" + "ab" * 32 + "\n")
    outside = tmp_path / "elsewhere" / "secret.txt"
    outside.parent.mkdir()
    outside.write_text("not for tenants")
    model = save_tiny_model("llama", models / "linked")
    return {"models": models, "data": data, "outside": outside, "model": model}


def _sources(layout: dict[str, Path], **more) -> ModelSourceOptions:
    return ModelSourceOptions(allowed_roots=(layout["models"],), private_paths=(layout["data"],),
                              cache_dir=layout["data"].parent / "hf-cache", offline=True, **more)


@pytest.mark.parametrize(("name", "target"), [
    ("vocab.txt", "outside"),
    ("chat_template.jinja", "keys"),
    ("tokenizer_config.json", "keys"),
    ("generation_config.json", "outside"),
    ("config.json", "outside"),
    ("original/params.json", "outside"),
])
def test_a_link_out_of_the_roots_is_refused_naming_the_file(layout, name: str, target: str) -> None:
    path = layout["model"] / name
    path.parent.mkdir(exist_ok=True)
    path.unlink(missing_ok=True)
    path.symlink_to(layout["outside"] if target == "outside" else layout["data"] / "api_keys")
    for check in (lambda: resolve_model_dir(str(layout["model"]), _sources(layout), with_weights=True),
                  lambda: validate_model_reference(str(layout["model"]), _sources(layout))):
        with pytest.raises(ModelReferenceError) as caught:
            check()
        assert repr(name) in caught.value.message and "link" in caught.value.message
        assert str(layout["data"]) not in caught.value.message  # the server's layout is not revealed


def test_a_link_into_the_servers_data_is_refused_even_below_an_allowed_root(tmp_path: Path) -> None:
    # An operator who keeps the data directory below a model root must not expose it either.
    root = tmp_path / "srv"
    data = root / "fp8forge-data"
    data.mkdir(parents=True)
    (data / "fp8forge.db").write_bytes(b"SQLite format 3\0")
    model = save_tiny_model("llama", root / "models" / "m")
    (model / "spiece.model").symlink_to(data / "fp8forge.db")
    sources = ModelSourceOptions(allowed_roots=(root,), private_paths=(data,))
    with pytest.raises(ModelReferenceError, match="'spiece.model' is a link"):
        resolve_model_dir(str(model), sources, with_weights=True)
    with pytest.raises(ModelReferenceError, match="keeps to itself"):
        validate_model_reference(str(data), sources)


def test_links_that_stay_inside_are_followed(layout) -> None:
    shared = layout["models"] / "shared-tokenizer"
    shared.mkdir()
    shutil.move(layout["model"] / "generation_config.json", shared / "generation_config.json")
    (layout["model"] / "generation_config.json").symlink_to(shared / "generation_config.json")
    (layout["model"] / "loop").symlink_to(layout["model"])  # a loop back into the model ends the walk
    assert resolve_model_dir(str(layout["model"]), _sources(layout), with_weights=True) == layout["model"]


def test_broken_and_looping_links_are_refused(layout) -> None:
    (layout["model"] / "vocab.txt").symlink_to(layout["model"] / "vocab.txt")
    with pytest.raises(ModelReferenceError, match="'vocab.txt' is a broken or looping link"):
        resolve_model_dir(str(layout["model"]), _sources(layout), with_weights=True)


def test_hub_cache_links_to_blobs_are_accepted_and_links_out_refused(layout) -> None:
    cache = layout["data"].parent / "hf-cache"
    snapshot = install_in_hf_cache(layout["model"], cache, "org/tiny")
    blobs = snapshot.parents[1] / "blobs"
    blobs.mkdir()
    for file in list(snapshot.iterdir()):  # the cache's own layout: snapshot files link to blobs
        blob = blobs / f"blob-{file.name}"
        shutil.move(file, blob)
        file.symlink_to(os.path.relpath(blob, snapshot))
    assert resolve_model_dir("org/tiny", _sources(layout), with_weights=True) == snapshot
    (snapshot / "vocab.txt").symlink_to(layout["outside"])
    with pytest.raises(ModelReferenceError, match="'vocab.txt' is a link"):
        resolve_model_dir("org/tiny", _sources(layout), with_weights=True)


def test_copy_refuses_a_link_swapped_in_after_the_check(layout, tmp_path: Path) -> None:
    confinement = FileConfinement(roots=(layout["models"].resolve(),), private=(layout["data"].resolve(),))
    source = layout["model"] / "config.json"
    copy_model_file(source, tmp_path / "config.json", confinement)
    assert (tmp_path / "config.json").read_bytes() == source.read_bytes()
    swapped = layout["model"] / "tokenizer.json"
    swapped.symlink_to(layout["data"] / "api_keys")
    with pytest.raises(ModelReferenceError, match="outside the directories"):
        copy_model_file(swapped, tmp_path / "tokenizer.json", confinement)
    assert not (tmp_path / "tokenizer.json").exists()


def test_submit_refuses_a_linked_model_with_422(layout) -> None:
    (layout["model"] / "vocab.txt").symlink_to(layout["data"] / "api_keys")
    settings = Settings(data_dir=layout["data"], auth_disabled=True, allowed_model_roots=(layout["models"],),
                        workers=0)
    with live_app(settings) as client:
        response = client.post("/v1/jobs", json={"model": str(layout["model"])})
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_model_reference" and error["field"] == "model"
        assert "'vocab.txt' is a link" in error["message"]
        assert client.get("/v1/jobs").json()["count"] == 0


@pytest.mark.slow
def test_a_link_made_after_submission_fails_the_job_and_exposes_nothing(layout) -> None:
    """The worker checks again: a link that appears between submission and the run fails the job, whose
    artifacts never hold the server's database."""
    data = layout["data"]
    env = {"FP8FORGE_ALLOWED_MODEL_ROOTS": str(layout["models"]), "FP8FORGE_POLL_INTERVAL_S": "0.2"}
    with ServeProcess(data, workers=0, env=env) as serve, serve.client() as client:
        created = client.post("/v1/jobs", json={"model": str(layout["model"]),
                                                "calibration": {"steps": 1, "batch_size": 1, "seq_len": 8}})
        assert created.status_code == 202, created.text
        job_id = created.json()["id"]
    (layout["model"] / "vocab.txt").symlink_to(data / "fp8forge.db")
    with ServeProcess(data, workers=1, env=env) as serve, serve.client() as client:
        events = sse_events(client, f"/v1/jobs/{job_id}/events", timeout=120)
        job = wait_for(lambda: (j := client.get(f"/v1/jobs/{job_id}").json())["status"] == "failed" and j,
                       timeout=30, what="the job to fail")
        assert job["error"]["code"] == "invalid_model_reference", job["error"]
        assert "'vocab.txt' is a link" in job["error"]["message"]
        assert events[-1][1]["status"] == "failed"
        assert client.get(f"/v1/jobs/{job_id}/artifacts").json()["data"] == []
    assert not [p for p in (data / "jobs").rglob("vocab.txt")]
