"""Model configs out of bounds or malformed are refused before transformers builds anything: fast, with a message
that names the field, its value, the limit and the setting; through the library, the CLI, a conversion and the
real HTTP API (a 4xx on a keep-alive connection that survives, never internal_error)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from converters.errors import ModelConfigError
from converters.model.config_checks import ConfigLimits, check_config, estimate_parameters, read_config_file
from service.config import Settings
from tests.service_helpers import keepalive_requests, live_app

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}

# The fields that size the largest public models (their config.json, as published).
REAL = {
    "Llama-3.1-405B": {"model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248,
                       "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
                       "vocab_size": 128256, "tie_word_embeddings": False},
    "DeepSeek-V3": {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
                    "num_experts_per_tok": 8, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "num_nextn_predict_layers": 1, "vocab_size": 129280},
    "Kimi-K2": {"model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
                "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "kv_lora_rank": 512,
                "q_lora_rank": 1536, "v_head_dim": 128, "vocab_size": 163840},
    "Qwen3-235B-A22B": {"model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
                        "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
                        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                        "vocab_size": 151936},
    "Qwen3-Next-80B-A3B": {"model_type": "qwen3_next", "hidden_size": 2048, "intermediate_size": 5120,
                           "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                           "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                           "head_dim": 256, "num_experts": 512, "num_experts_per_tok": 10, "vocab_size": 151936},
    "gemma-3-27b": {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                    "text_config": {"model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
                                    "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
                                    "head_dim": 128, "vocab_size": 262208},
                    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152,
                                      "intermediate_size": 4304, "num_hidden_layers": 27,
                                      "num_attention_heads": 16}},
}
# parameters the model has, in billions: the estimate must not be below, nor absurdly above
REAL_SIZES_B = {"Llama-3.1-405B": 405, "DeepSeek-V3": 671, "Kimi-K2": 1026, "Qwen3-235B-A22B": 235,
                "Qwen3-Next-80B-A3B": 80, "gemma-3-27b": 27}


@pytest.mark.parametrize("name", list(REAL))
def test_the_largest_real_models_fit_the_defaults(name: str) -> None:
    check_config(REAL[name])
    sections = [REAL[name], *(value for value in REAL[name].values() if isinstance(value, dict))]
    estimate = sum(estimate_parameters(section) for section in sections) / 1e9
    assert REAL_SIZES_B[name] * 0.9 <= estimate <= REAL_SIZES_B[name] * 1.6, estimate
    assert estimate * 3 < ConfigLimits().max_parameters / 1e9  # room to spare


@pytest.mark.parametrize(("patch", "words"), [
    ({"num_hidden_layers": 10_000}, "num_hidden_layers is 10,000, above the limit of 1,000 layers; the service's "
                                    "FP8FORGE_MAX_MODEL_LAYERS"),
    ({"hidden_size": 1 << 20}, "hidden_size is 1,048,576, above the limit of 262,144; the service's "
                               "FP8FORGE_MAX_MODEL_DIM"),
    ({"intermediate_size": [128, 10**9]}, "intermediate_size is 1,000,000,000, above the limit of 262,144"),
    ({"num_local_experts": 100_000}, "num_local_experts is 100,000, above the limit of 2,048 experts; the service's "
                                     "FP8FORGE_MAX_MODEL_EXPERTS"),
    ({"vocab_size": 10**8}, "vocab_size is 100,000,000, above the limit of 2,097,152 tokens; the service's "
                            "FP8FORGE_MAX_MODEL_VOCAB"),
    ({"text_config": {"num_hidden_layers": 5000}}, "text_config.num_hidden_layers is 5,000"),
    ({"hidden_size": 200_000, "intermediate_size": 200_000, "num_hidden_layers": 900},
     "above the limit of 4,000,000,000,000; the service's FP8FORGE_MAX_MODEL_PARAMETERS"),
])
def test_each_bound_names_the_field_its_value_the_limit_and_the_setting(patch: dict, words: str) -> None:
    with pytest.raises(ModelConfigError) as info:
        check_config({**TINY, **patch})
    assert words in info.value.message and info.value.field == "model"


def test_the_limits_are_settings() -> None:
    settings = Settings(max_model_layers=2, max_model_dim=128, max_model_experts=1, max_model_vocab=256,
                        max_model_parameters=10**6)
    limits = settings.model_sources()["config_limits"]
    check_config(TINY, limits)
    with pytest.raises(ModelConfigError, match="num_hidden_layers is 3, above the limit of 2 layers"):
        check_config({**TINY, "num_hidden_layers": 3}, limits)
    with pytest.raises(ModelConfigError, match="FP8FORGE_MAX_MODEL_PARAMETERS"):
        check_config(TINY, ConfigLimits(max_parameters=1000))


BAD_CONFIGS = {
    "layers a word": ({"num_hidden_layers": "many"}, "num_hidden_layers must be a whole number, not a string"),
    "negative width": ({"hidden_size": -1}, "hidden_size is -1; it must be at least 1"),
    "list for layers": ({"num_hidden_layers": [1, 2]}, "num_hidden_layers must be a whole number, not a list"),
    "fraction": ({"vocab_size": 256.5}, "vocab_size must be a whole number, not a number with a fraction"),
    "boolean": ({"num_attention_heads": True}, "num_attention_heads must be a whole number or a list of them"),
    "no heads": ({"num_attention_heads": 0}, "num_attention_heads is 0; it must be at least 1"),
    "tokenizer class": ({"architectures": ["AutoTokenizer"]}, "names 'AutoTokenizer', which is not a model class"),
    "base class": ({"architectures": ["PreTrainedModel"]}, "names 'PreTrainedModel', which is not a model class"),
    "abstract base": ({"architectures": ["LlamaPreTrainedModel"]}, "which is not a model class"),
    "a call": ({"architectures": ["os.system"]}, "holds 'os.system', which is not a class name"),
    "a string": ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of class names"),
    "model_type list": ({"model_type": ["llama"]}, "model_type must be a string, not a list"),
    "sub-config string": ({"text_config": "x"}, "text_config must be a JSON object, not a string"),
    "transformers refuses": ({"rms_norm_eps": "small"}, "transformers cannot read config.json"),
}


def _model(root: Path, name: str, config: dict | str) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return directory


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_a_malformed_config_is_a_model_config_error(tmp_path: Path, name: str) -> None:
    from converters.model.sources import ModelSourceOptions, load_config

    patch, words = BAD_CONFIGS[name]
    directory = _model(tmp_path, "m", {**TINY, **patch})
    with pytest.raises(ModelConfigError) as info:
        load_config(directory, ModelSourceOptions(allowed_roots=(tmp_path,)))
    assert words in info.value.message, info.value.message


@pytest.mark.parametrize("text", [DEEP, json.dumps(TINY)[:-1] + ', "x": ' + "[" * 40 + "]" * 40 + "}",
                                  "{not json", "[1, 2]"])
def test_json_nested_too_deep_or_not_an_object_is_refused(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.json").write_text(text)
    started = time.monotonic()
    with pytest.raises(ModelConfigError, match="nests JSON more than 32 levels|not valid JSON|must hold a JSON object"):
        read_config_file(tmp_path / "config.json")
    assert time.monotonic() - started < 5  # bounds, not a speed target: unbounded, the parse ran out of stack


def test_a_10000_layer_config_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    _model(tmp_path, "m", {**TINY, "num_hidden_layers": 10_000})
    started = time.monotonic()
    with pytest.raises(ModelConfigError, match="num_hidden_layers is 10,000"):
        read_config_file(tmp_path / "m" / "config.json")
    # milliseconds on a quiet machine; the bound leaves room for a loaded CI host (building it took 64 s)
    assert time.monotonic() - started < 5


def test_a_conversion_applies_the_limits_before_loading(tmp_path: Path) -> None:
    """The worker's path: run_conversion -> resolve -> load_config, with the limits the settings put in sources."""
    from converters.model.sources import ModelSourceOptions
    from converters.pipeline.driver import run_conversion
    from converters.pipeline.request import ConversionRequest

    directory = _model(tmp_path / "models", "m", {**TINY, "architectures": ["AutoTokenizer"]})
    request = ConversionRequest.from_dict({"model": str(directory), "recipe": {"backend": "ao"},
                                           "calibration": {"steps": 1, "batch_size": 1, "seq_len": 8}})
    with pytest.raises(ModelConfigError, match="not a model class"):
        run_conversion(request, tmp_path / "out", ModelSourceOptions(allowed_roots=(tmp_path / "models",)))
    (directory / "config.json").write_text(json.dumps(TINY))
    sources = ModelSourceOptions(allowed_roots=(tmp_path / "models",), config_limits=ConfigLimits(max_layers=1))
    with pytest.raises(ModelConfigError, match="num_hidden_layers is 2, above the limit of 1 layers"):
        run_conversion(request, tmp_path / "out", sources)
    assert not (tmp_path / "out").exists()


def test_the_cli_exits_2_with_the_message(tmp_path: Path, capsys) -> None:
    from service.cli.main import main

    directory = _model(tmp_path, "m", {**TINY, "num_hidden_layers": 10_000})
    assert main(["analyze", str(directory), "--allow-root", str(tmp_path)]) == 2
    assert "num_hidden_layers is 10,000, above the limit of 1,000 layers" in capsys.readouterr().err


# --- the HTTP API ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    models = root / "models"
    _model(models, "huge", {**TINY, "num_hidden_layers": 10_000})
    for index, name in enumerate(BAD_CONFIGS):
        _model(models, f"bad{index}", {**TINY, **BAD_CONFIGS[name][0]})
    _model(models, "deep", DEEP)
    settings = Settings(data_dir=root / "data", auth_disabled=True, allowed_model_roots=(models,), workers=0)
    with live_app(settings) as client:
        yield client, models


def test_a_10000_layer_config_is_refused_fast_while_healthz_answers(served) -> None:
    client, models = served
    body = {"model": str(models / "huge")}
    answers: list[tuple[float, httpx.Response]] = []

    def post(path: str) -> None:
        started = time.monotonic()
        response = client.post(path, json=body)
        answers.append((time.monotonic() - started, response))

    threads = [threading.Thread(target=post, args=(path,)) for path in ["/v1/analyze", "/v1/jobs"] * 10]
    for thread in threads:
        thread.start()
    health = []
    for _ in range(10):
        started = time.monotonic()
        assert client.get("/healthz").status_code == 200
        health.append(time.monotonic() - started)
    for thread in threads:
        thread.join(60)
    assert len(answers) == 20
    for elapsed, response in answers:
        assert response.status_code == 422, response.text
        assert response.json()["error"]["code"] == "invalid_model_config"
        assert "FP8FORGE_MAX_MODEL_LAYERS" in response.json()["error"]["message"]
        assert elapsed < 10  # refused on arrival; building 10,000 layers took 64 s
    assert max(health) < 5, health  # the API stalled 20-60 s before; this bound leaves room for a loaded host


def test_malformed_configs_get_4xx_over_http_and_the_connection_survives(served) -> None:
    client, models = served
    port = int(str(client.base_url).rsplit(":", 1)[1])
    names = [f"bad{index}" for index in range(len(BAD_CONFIGS))] + ["deep"]
    requests = [("POST", path, {"model": str(models / name)}) for name in names for path in ("/v1/analyze", "/v1/jobs")]
    answers = keepalive_requests(port, [*requests, ("GET", "/healthz", None)])
    assert answers[-1][0] == 200
    expected = [*(words for _, words in BAD_CONFIGS.values()), "nests JSON more than 32 levels"]
    for index, ((status, body), (_, path, request)) in enumerate(zip(answers[:-1], requests, strict=True)):
        words = expected[index // 2]
        if path == "/v1/jobs" and ("model class" in words or "transformers" in words):
            # only transformers tells a model class from another, and the API does not import it: the job is
            # queued and its worker fails it with invalid_model_config (test_a_conversion_applies_the_limits...)
            assert status == 202, (request, body)
            continue
        assert status == 422, (request, body)
        assert body["error"]["code"] == "invalid_model_config" and body["error"]["field"] == "model", body
        assert words in body["error"]["message"], (words, body)
