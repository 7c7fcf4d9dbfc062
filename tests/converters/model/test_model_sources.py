"""Model references: hub cache (offline), revisions, local roots, and the errors users see."""

import pytest

from converters.errors import ModelNotFoundError, ModelReferenceError
from converters.model.sources import (
    ModelSourceOptions,
    load_model,
    load_tokenizer,
    parse_model_reference,
    resolve_model_dir,
)
from tests.models import install_in_hf_cache, minilm_dir


@pytest.mark.parametrize(
    ("ref", "kind", "repo_id", "revision"),
    [
        ("org/name", "hub", "org/name", None),
        ("meta-llama/Llama-3.1-8B@main", "hub", "meta-llama/Llama-3.1-8B", "main"),
        ("org/name@0123456789abcdef0123456789abcdef01234567", "hub", "org/name",
         "0123456789abcdef0123456789abcdef01234567"),
        ("org/name@refs/pr/1", "hub", "org/name", "refs/pr/1"),
    ],
)
def test_hub_references_parse(ref, kind, repo_id, revision):
    parsed = parse_model_reference(ref, ModelSourceOptions())
    assert (parsed.kind, parsed.repo_id, parsed.revision) == (kind, repo_id, revision)


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("", "empty"),
        ("https://huggingface.co/org/name", "is a URL"),
        ("file:///etc/passwd", "is a URL"),
        ("s3://bucket/model", "is a URL"),
        ("org/../name", "contains '..'"),
        ("org/name@../../x", "contains '..'"),
        ("justaname", "neither a hub id"),
        ("a/b/c", "neither a hub id"),
        ("org/name@bad rev", "not a branch"),
    ],
)
def test_bad_references_are_rejected(ref, message):
    with pytest.raises(ModelReferenceError, match=message):
        parse_model_reference(ref, ModelSourceOptions())


def test_local_paths_need_an_allowed_root(models_root, tmp_path):
    with pytest.raises(ModelReferenceError, match="no local model roots are allowed"):
        parse_model_reference(str(models_root / "llama"), ModelSourceOptions())
    with pytest.raises(ModelReferenceError, match="outside the allowed roots"):
        parse_model_reference(str(models_root / "llama"), ModelSourceOptions(allowed_roots=(tmp_path,)))
    outside_link = tmp_path / "link"
    outside_link.symlink_to(models_root / "llama")
    with pytest.raises(ModelReferenceError, match="outside the allowed roots"):
        parse_model_reference(str(outside_link), ModelSourceOptions(allowed_roots=(tmp_path / "sub",)))


def test_missing_directory_and_missing_config(sources, models_root):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_dir(str(models_root / "nope"), sources, with_weights=False)
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_dir(str(models_root), sources, with_weights=False)


def test_hub_cache_offline_resolution_with_revision(models_root, tmp_path):
    cache = tmp_path / "hub"
    install_in_hf_cache(models_root / "llama", cache, "tiny/llama")
    install_in_hf_cache(models_root / "qwen2", cache, "tiny/llama", revision="v2",
                        commit="fedcba9876543210fedcba9876543210fedcba98")
    sources = ModelSourceOptions(cache_dir=cache, offline=True)
    main = resolve_model_dir("tiny/llama", sources, with_weights=True)
    assert (main / "model.safetensors").is_file() and main.name.startswith("0123")
    tagged = resolve_model_dir("tiny/llama@v2", sources, with_weights=False)
    assert tagged.name.startswith("fedc")
    with pytest.raises(ModelNotFoundError, match="not in the HF cache .* offline mode is on"):
        resolve_model_dir("tiny/other", sources, with_weights=False)
    with pytest.raises(ModelNotFoundError):
        resolve_model_dir("tiny/llama@v3", sources, with_weights=False)


def test_real_minilm_loads_with_weights_and_tokenizer():
    directory = minilm_dir()
    sources = ModelSourceOptions(allowed_roots=(directory.parent,))
    model = load_model(resolve_model_dir(str(directory), sources, with_weights=True), sources)
    tokenizer = load_tokenizer(directory, sources)
    assert type(model).__name__ == "BertModel"
    assert tokenizer("hello world")["input_ids"][0] == tokenizer.cls_token_id
    assert model.encoder.layer[0].attention.self.query.weight.abs().sum() > 0


def test_remote_code_is_refused_unless_enabled(tmp_path):
    import json

    directory = tmp_path / "remote"
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps({"model_type": "custom-thing", "architectures": ["CustomModel"],
                    "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}})
    )
    sources = ModelSourceOptions(allowed_roots=(tmp_path,))
    from converters.model.sources import load_config

    with pytest.raises(ModelNotFoundError, match="trust_remote_code"):
        load_config(directory, sources)
