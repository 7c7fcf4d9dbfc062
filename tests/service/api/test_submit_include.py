"""An include pattern that selects no Linear layer is refused by POST /v1/jobs (422, field include[i]) instead of
failing the job in a worker seconds later: checked against the module paths in the checkpoint's file headers
where the API can read them (a local model, the demo once built; converters/analysis/include_check.py)."""

from __future__ import annotations

import json

from service.config import Settings
from tests.service_helpers import build_tiny_llama, live_app


def test_an_include_pattern_that_matches_nothing_is_refused_at_submit(tmp_path):
    models = tmp_path / "models"
    build_tiny_llama(models / "llama")
    settings = Settings(data_dir=tmp_path / "data", auth_disabled=True, allowed_model_roots=(models,))
    with live_app(settings) as client:
        body = {"model": str(models / "llama"), "recipe": {"backend": "ao"}}
        answer = client.post("/v1/jobs", json={**body, "include": ["layers.1.mlp", "layers.7.mlp"]})
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["field"] == "include[1]" and "'layers.7.mlp' matches no Linear layer" in error["message"]
        assert client.get("/v1/jobs").json()["count"] == 0  # nothing queued
        assert client.post("/v1/jobs", json={**body, "include": ["layers.1.mlp"]}).status_code == 202
        assert client.post("/v1/jobs", json={**body, "include": ["lm_head"]}).status_code == 202


def test_a_tied_head_and_moe_experts_are_left_to_the_worker(tmp_path):
    from tests.models import save_tiny_model, save_tiny_moe

    models = tmp_path / "models"
    save_tiny_moe("mixtral", models / "mixtral")  # its experts are units that no file names
    save_tiny_model("gemma", models / "tied")  # lm_head is the input embedding: not stored under its own name
    assert json.loads((models / "tied" / "config.json").read_text()).get("tie_word_embeddings", True)
    settings = Settings(data_dir=tmp_path / "data", auth_disabled=True, allowed_model_roots=(models,))
    with live_app(settings) as client:
        for model, pattern in (("mixtral", "experts.3.gate_up_proj"), ("tied", "lm_head")):
            body = {"model": str(models / model), "recipe": {"backend": "ao"}, "include": [pattern]}
            assert client.post("/v1/jobs", json=body).status_code == 202, (model, pattern)
