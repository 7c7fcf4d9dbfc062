"""The quality pass on tiny models: its arithmetic against a whole-model forward, and the report's quality block."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from converters.artifact.layout import REPORT_FILE
from converters.calibration.batches import load_corpus
from converters.model.demo import build_tiny_llama
from converters.model.sources import ModelSourceOptions, load_model, load_tokenizer
from converters.quality import (
    BUILT_IN_HELD_OUT,
    KvCast,
    QualityUnavailable,
    calibration_part,
    casting_linears,
    held_out_part,
    load_source,
    measure_qualities,
    measure_quality,
    recipe_layer_casts,
)
from converters.quality.kv_cache import attention_paths
from converters.quality.text_batches import ALONE_BELOW_TOKENS, BATCH_POSITIONS, batched, rows_keep_their_bits
from converters.recipes.presets import parse_compare_recipe
from tests.converters.serving.exports import export
from tests.models import save_tiny_model

TEXTS = ["The harbor town woke slowly on the first cold morning of autumn, and the gulls argued over the boats.",
         "Delayed scaling derives the scale of this step from the amax history of earlier steps, one per tensor."]


def _linears(directory):
    source = load_source(directory)
    return source, [name for name, module in source.model.named_modules()
                    if isinstance(module, nn.Linear) and name != "lm_head"]


def _whole_model_figures(directory, casts, texts):
    """The same figures from whole-model forwards: the reference for the layer-sequential pass."""
    model = load_model(directory, ModelSourceOptions())
    tokenizer = load_tokenizer(directory, ModelSourceOptions())
    nll_ref = nll = kl_sum = 0.0
    agree = count = 0
    for text in texts:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad():
            reference = model(input_ids=ids).logits[0, :-1].float()
            with casting_linears(model, casts):
                fp8 = model(input_ids=ids).logits[0, :-1].float()
        targets = ids[0, 1:]
        log_p, log_q = reference.log_softmax(-1), fp8.log_softmax(-1)
        nll_ref -= float(log_p.gather(1, targets[:, None]).sum())
        nll -= float(log_q.gather(1, targets[:, None]).sum())
        kl_sum += float((log_p.exp() * (log_p - log_q)).sum(-1).sum())
        agree += int((reference.argmax(-1) == fp8.argmax(-1)).sum())
        count += targets.numel()
    return math.exp(nll_ref / count), math.exp(nll / count), kl_sum / count, agree / count, count


def test_held_out_and_calibration_parts_are_disjoint_and_cover_the_corpus():
    held, calibration = held_out_part(), calibration_part()
    assert held and calibration and not set(held) & set(calibration)
    assert sorted(held + calibration) == sorted(load_corpus())
    assert 0.2 <= len(held) / len(load_corpus()) <= 0.3


def test_no_cast_gives_the_source_itself(llama_dir):
    source, _ = _linears(llama_dir)
    figures = measure_quality(source, {}, TEXTS)
    assert figures.kl_mean == 0.0 and figures.kl_max == 0.0 and figures.top1_agreement == 1.0
    assert figures.perplexity == figures.perplexity_reference and figures.held_out == "request"


@pytest.mark.parametrize("recipe", ["te-current", "te-mxfp8", "te-nvfp4"])
def test_layer_sequential_figures_equal_the_whole_model_forward(llama_dir, recipe):
    source, paths = _linears(llama_dir)
    casts = recipe_layer_casts(parse_compare_recipe(recipe, "recipe"), paths)
    figures = measure_quality(source, casts, TEXTS)
    ppl_ref, ppl, kl, agree, count = _whole_model_figures(llama_dir, casts, TEXTS)
    assert figures.tokens == count
    # the layer-sequential pass runs each layer in fp32 rounding to bf16 as the model does, the whole model runs
    # in bf16: the same numbers up to summation order, which moves an input across a rounding boundary of the
    # cast now and then (measured: te-current and te-mxfp8 within 2e-3, te-nvfp4's 4-bit grid 2.5e-3)
    assert figures.perplexity_reference == pytest.approx(ppl_ref, rel=2e-3)
    assert figures.perplexity == pytest.approx(ppl, rel=1e-2)
    assert figures.kl_mean == pytest.approx(kl, rel=0.1, abs=1e-5)
    assert round(abs(figures.top1_agreement - agree) * count) <= 2  # in tokens: 2 / count is not exact in floats
    assert figures.kl_mean > 0


def test_a_cast_head_casts_each_text_s_input_with_its_own_scale(llama_dir):
    """The head pass scores the positions of all texts together, yet a cast head's input is cast per text, as the
    FP8 model's head casts each call's input: the figures equal the whole-model forward's with the head cast."""
    source, paths = _linears(llama_dir)
    casts = recipe_layer_casts(parse_compare_recipe("te-current", "recipe"), [*paths, "lm_head"])
    texts = [TEXTS[0], TEXTS[1].upper()]  # unlike texts: unlike input scales at the head
    figures = measure_quality(source, casts, texts)
    ppl_ref, ppl, kl, agree, count = _whole_model_figures(llama_dir, casts, texts)
    assert figures.tokens == count
    assert figures.perplexity == pytest.approx(ppl, rel=1e-2)
    assert figures.kl_mean == pytest.approx(kl, rel=0.1, abs=1e-5)
    assert round(abs(figures.top1_agreement - agree) * count) <= 2


def test_a_batch_of_padded_texts_casts_each_text_as_a_call_of_its_own():
    """Texts of one batch are cast each on its own positions: a scale from the call's amax is the text's, never its
    neighbour's or the padding's."""
    if not rows_keep_their_bits({(32, 16)}, torch.float32, torch.device("cpu")):
        pytest.skip("this machine's fp32 GEMM gives a text's rows other bits inside a bigger call: the quality pass "
                    "scores one text a call here (test_a_machine_whose_gemm_moves_bits_scores_one_text_a_call)")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16))
    casts = recipe_layer_casts(parse_compare_recipe("te-current", "r"), ["0"])
    # unlike amax: unlike input scales; texts of ALONE_BELOW_TOKENS tokens or more, as the pass batches them
    quiet, loud = torch.randn(1, 20, 32), 40 * torch.randn(1, 27, 32)
    batch = torch.cat([torch.cat([quiet, 1e4 * torch.ones(1, 7, 32)], dim=1), loud])  # padding far above both
    with torch.no_grad(), casting_linears(model, casts) as cast:
        alone = [model(quiet)[0], model(loud)[0]]
        cast.lengths = [20, 27]
        batched = model(batch)
        cast.lengths = None
        shared = model(batch)  # one scale for the whole call, padding included
    assert torch.equal(batched[0, :20], alone[0]) and torch.equal(batched[1], alone[1])
    assert not torch.equal(shared[0, :20], alone[0])


def test_texts_batch_in_order_within_the_padded_positions_and_short_ones_run_alone():
    """Batches hold whole texts in order up to BATCH_POSITIONS padded positions; a text under ALONE_BELOW_TOKENS
    tokens (whose GEMM rows take another kernel alone) and, with one_a_call, every text, sit in a batch alone."""
    short, long = ALONE_BELOW_TOKENS - 1, BATCH_POSITIONS // 4
    tokens = [[1] * long, [2] * (long - 5), [3] * short, [4] * long, [5] * long, [6] * long, [7] * long, [8] * long]
    lengths = [batch.lengths for batch in batched(tokens, None, nn.Identity())]
    assert lengths == [[long, long - 5], [short], [long] * 4, [long]]
    one = batched(tokens, None, nn.Identity(), one_a_call=True)
    assert [batch.lengths for batch in one] == [[len(ids)] for ids in tokens]
    padded = batched(tokens, None, nn.Identity())[0].inputs
    assert padded["attention_mask"][1].tolist() == [1] * (long - 5) + [0] * 5


@pytest.fixture(scope="module")
def llama_fp32_dir(llama_dir):
    """The tiny Llama in fp32: no bf16 rounding between its modules to hide a last bit that padding moves."""
    from transformers import AutoModelForCausalLM

    directory = llama_dir.parent / "llama-fp32"
    AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).save_pretrained(directory)
    load_tokenizer(llama_dir, ModelSourceOptions()).save_pretrained(directory)
    return directory


def _spy_batches(monkeypatch) -> list:
    """The batches of texts each quality pass from here on forms, a list per pass."""
    import converters.quality.measure as measure

    seen = []
    real_batched = measure.batched
    monkeypatch.setattr(measure, "batched", lambda *args, **kwargs: seen.append(real_batched(*args, **kwargs))
                        or seen[-1])
    return seen


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("model", ["llama_dir", "llama_fp32_dir"])
def test_batched_texts_score_exactly_as_one_text_a_call(request, monkeypatch, model, attention):
    """Padding moves no bit of a text: the source's figures and those of a current-scaling recipe (a scale from each
    call's amax) with and without an FP8 KV cache equal one text a call's exactly, as the data-parallel pass, whose
    ranks batch their own blocks of texts, needs."""
    source, paths = _linears(request.getfixturevalue(model))
    source.model.config._attn_implementation = attention
    casts = recipe_layer_casts(parse_compare_recipe("te-current", "recipe"), paths)
    kv = {path: KvCast(k_scale=0.01, v_scale=0.01) for path in attention_paths(source.model)}
    variants = {"te-current": casts, "te-current+kv": {**casts, **kv}}
    # unlike lengths and scales; the last one short enough to run alone (ALONE_BELOW_TOKENS)
    texts = [" ".join([TEXTS[0]] * 3), TEXTS[1].upper(), TEXTS[1], "Delayed scaling"]
    import converters.quality.measure as measure

    if not measure._gemm_rows_keep_bits(source):
        pytest.skip("this machine's GEMM gives a text's rows other bits inside a bigger call: the pass scores one "
                    "text a call here (test_a_machine_whose_gemm_moves_bits_scores_one_text_a_call)")
    seen = _spy_batches(monkeypatch)
    batched = measure_qualities(source, variants, texts, max_tokens=1024)
    assert max(len(batch.lengths) for batch in seen[0]) > 1  # texts did share a call
    monkeypatch.setattr("converters.quality.text_batches.BATCH_POSITIONS", 1)  # one text a batch
    alone = measure_qualities(source, variants, texts, max_tokens=1024)
    for name in variants:
        assert batched[name].tokens == alone[name].tokens and batched[name].texts == alone[name].texts == 4
        for key in ("perplexity_reference", "perplexity", "kl_mean", "kl_max", "top1_agreement"):
            assert getattr(batched[name], key) == getattr(alone[name], key), (name, key)


def test_a_machine_whose_gemm_moves_bits_scores_one_text_a_call(llama_dir, monkeypatch):
    """Where the GEMM probe finds a text's rows get other bits inside a bigger call, every text runs in a call of its
    own, and the figures are one text a call's."""
    import converters.quality.measure as measure

    source, paths = _linears(llama_dir)
    variants = {"te-current": recipe_layer_casts(parse_compare_recipe("te-current", "recipe"), paths)}
    texts = [" ".join([TEXTS[0]] * 3), TEXTS[1]]
    seen = _spy_batches(monkeypatch)
    monkeypatch.setattr(measure, "rows_keep_their_bits", lambda shapes, dtype, device: False)
    fallback = measure_qualities(source, variants, texts, max_tokens=1024)
    monkeypatch.setattr("converters.quality.text_batches.BATCH_POSITIONS", 1)
    alone = measure_qualities(source, variants, texts, max_tokens=1024)
    assert [len(batch.lengths) for batch in seen[0]] == [1, 1]
    assert fallback["te-current"].perplexity == alone["te-current"].perplexity
    assert fallback["te-current"].kl_mean == alone["te-current"].kl_mean


def test_several_variants_in_one_pass_equal_each_alone(llama_dir):
    source, paths = _linears(llama_dir)
    variants = {name: recipe_layer_casts(parse_compare_recipe(name, "r"), paths)
                for name in ("te-current", "te-nvfp4", "te-delayed")}
    together = measure_qualities(source, variants, TEXTS)
    for name, casts in variants.items():
        assert together[name] == measure_quality(source, casts, TEXTS)
    # without calibrated amax, TE delayed scaling casts as current scaling does: one stream serves both
    assert variants["te-delayed"] == variants["te-current"] and together["te-delayed"] == together["te-current"]
    assert together["te-nvfp4"].kl_mean > together["te-current"].kl_mean  # 4-bit elements cost more than 8-bit


def test_default_texts_are_the_held_out_part_and_max_tokens_bounds_the_count(llama_dir):
    source, paths = _linears(llama_dir)
    figures = measure_quality(source, recipe_layer_casts(parse_compare_recipe("te-current", "r"), paths),
                              max_tokens=40, seq_len=16)
    assert figures.held_out == BUILT_IN_HELD_OUT and figures.tokens == 40 and figures.texts == 3


@pytest.mark.parametrize(("casts", "message"), [({"model.embed_tokens": None}, "not Linears"),
                                                ({"nope.q_proj": None}, "not Linears")])
def test_casts_on_unknown_modules_are_refused(llama_dir, casts, message):
    source, _ = _linears(llama_dir)
    with pytest.raises(ValueError, match=message):
        measure_quality(source, casts, TEXTS)


def test_texts_without_two_tokens_are_refused(llama_dir):
    with pytest.raises(QualityUnavailable, match="nothing to score"):
        measure_quality(llama_dir, {}, ["a"])


def test_an_encoder_has_no_lm_head_and_says_so(tmp_path):
    save_tiny_model("bert", tmp_path / "bert")
    with pytest.raises(QualityUnavailable, match="no language-model head"):
        load_source(tmp_path / "bert")


def test_the_report_holds_training_and_each_export_read_back(llama_dir):
    out = export(llama_dir, ("compressed-tensors-fp8", "nvfp4"))
    report = _report(out)["quality"]
    assert report["measured"] and report["held_out"]["source"] == BUILT_IN_HELD_OUT
    assert report["reference"]["perplexity"] == report["training"]["perplexity_reference"]
    assert set(report["serving"]) == {"compressed-tensors-fp8", "nvfp4"}
    for figures in (report["training"], *report["serving"].values()):
        assert 0 < figures["kl_mean"] <= figures["kl_max"] and 0 < figures["top1_agreement"] <= 1
        assert figures["tokens"] == report["held_out"]["tokens"]
    # NVFP4's 4-bit weights cost more than FP8's, read back from the files as written
    assert report["serving"]["nvfp4"]["kl_mean"] > report["serving"]["compressed-tensors-fp8"]["kl_mean"]


def _report(out):
    return json.loads((out / REPORT_FILE).read_text())


def test_the_report_says_quality_is_off_with_measure_false(llama_dir, tmp_path):
    model = tmp_path / "llama"
    build_tiny_llama(model)
    report = _report(export(model, (), measure=False))
    assert report["quality"]["measured"] is False and "measure: false" in report["quality"]["reason"]
    assert "calibration part" in report["calibration"]["data_source"]


def test_compare_recipes_gain_the_quality_columns_and_the_cli_prints_them(llama_dir, capsys):
    from service.cli.main import main

    code = main(["compare", str(llama_dir), "--allow-root", str(llama_dir.parent), "--recipes",
                 "te-current,te-mxfp8,te-nvfp4", "--calib-steps", "2", "--calib-seq-len", "32", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    table = out[out.index("end-to-end quality on"):].splitlines()
    header = next(index for index, line in enumerate(table) if line.split()[:2] == ["recipe", "perplexity"])
    rows = {line.split()[0]: [float(value) for value in line.split()[1:]] for line in table[header + 2:header + 5]}
    assert list(rows) == ["te-current", "te-mxfp8", "te-nvfp4"]
    for perplexity, kl_mean, kl_max, top1 in rows.values():
        assert perplexity > 1 and 0 < kl_mean <= kl_max and 0 < top1 <= 1
    assert rows["te-nvfp4"][1] > rows["te-current"][1]


def test_convert_prints_the_quality_of_training_and_exports(llama_dir, capsys, tmp_path):
    from service.cli.main import main

    code = main(["convert", str(llama_dir), "--out", str(tmp_path / "out"), "--allow-root", str(llama_dir.parent),
                 "--serving", "compressed-tensors-fp8", "--calib-steps", "2", "--calib-seq-len", "32",
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out[out.index("end-to-end quality on"):].splitlines()
    names = [line.split()[0] for line in lines[3:6]]
    assert names == ["source", "training", "serving/compressed-tensors-fp8"]


def test_an_encoder_job_reports_quality_not_measured_and_why(tmp_path):
    from converters.model.sources import ModelSourceOptions as Sources
    from converters.pipeline.driver import run_conversion
    from converters.pipeline.request import CalibrationSettings, ConversionRequest

    save_tiny_model("bert", tmp_path / "bert")
    request = ConversionRequest(model=str(tmp_path / "bert"), recipe={"backend": "ao", "recipe_name": "tensorwise"},
                                calibration=CalibrationSettings(steps=2, seq_len=16))
    result = run_conversion(request, tmp_path / "out", Sources(allowed_roots=(tmp_path,)))
    quality = _report(result.out_dir)["quality"]
    assert quality["measured"] is False and "no language-model head" in quality["reason"]
    assert any("quality not measured" in warning for warning in _report(result.out_dir)["warnings"])


def test_a_tied_head_model_exports_and_its_ignore_entry_passes_the_load_audit(tmp_path):
    """The head of a tied-embedding model is not stored, yet vLLM builds it: ignoring it is no problem."""
    import transformers

    from converters.model.demo import build_demo_tokenizer

    tokenizer = build_demo_tokenizer()
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                                      tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tied")
    tokenizer.save_pretrained(tmp_path / "tied")
    report = _report(export(tmp_path / "tied", ("compressed-tensors-fp8",)))
    assert "lm_head" in json.loads((tmp_path / "out" / "serving" / "compressed-tensors-fp8" / "config.json")
                                   .read_text())["quantization_config"]["ignore"]
    assert report["serving"]["compressed-tensors-fp8"]["load_audit"]["problems"] == []
    assert report["quality"]["measured"] and report["quality"]["serving"]["compressed-tensors-fp8"]["kl_mean"] > 0
