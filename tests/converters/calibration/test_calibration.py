"""Calibration on a tiny Llama built from a config: batches, amax recording, TE scaling state."""

from __future__ import annotations

import pytest
import torch

from converters.calibration.amax import LayerAmax, record_amax, te_scaling_state
from converters.calibration.batches import CORPUS_PATH, calibration_batches, load_corpus
from converters.calibration.scaling import delayed_scaling_state
from converters.errors import CalibrationDataError, ConversionCancelled, RecipeError
from converters.recipes import TECurrentScalingRecipe, TEDelayedScalingRecipe

VOCAB = 256
Q_PROJ = "model.layers.0.self_attn.q_proj"
LM_HEAD = "lm_head"


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def tokenizer():
    """A small BPE tokenizer trained on the built-in corpus (no hub); it has EOS but no pad token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"], show_progress=False)
    tok.train_from_iterator(load_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


# --- batches --------------------------------------------------------------------------------------


def test_corpus_is_shipped_and_sizeable():
    assert CORPUS_PATH.is_file()
    assert 20_000 <= CORPUS_PATH.stat().st_size <= 60_000
    assert len(load_corpus()) > 50


def test_batches_from_builtin_corpus(tokenizer):
    batches, source = calibration_batches(tokenizer, vocab_size=VOCAB, steps=3, batch_size=2, seq_len=16)
    assert "built-in corpus" in source
    assert len(batches) == 3
    for batch in batches:
        assert batch["input_ids"].shape == (2, 16) and batch["input_ids"].dtype == torch.long
        assert batch["attention_mask"].all()
        assert int(batch["input_ids"].max()) < len(tokenizer)
    again, _ = calibration_batches(tokenizer, vocab_size=VOCAB, steps=3, batch_size=2, seq_len=16)
    other, _ = calibration_batches(tokenizer, vocab_size=VOCAB, steps=3, batch_size=2, seq_len=16, seed=1)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, again, strict=True))
    assert not all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, other, strict=True))


def test_short_user_text_is_padded_with_eos_when_there_is_no_pad_token(tokenizer):
    assert tokenizer.pad_token_id is None
    batches, source = calibration_batches(
        tokenizer, vocab_size=VOCAB, texts=["", "the tide"], steps=2, batch_size=1, seq_len=32
    )
    assert "user text" in source
    ids, mask = batches[0]["input_ids"][0], batches[0]["attention_mask"][0]
    real = int(mask.sum())
    assert 0 < real < 32
    assert (ids[real:] == tokenizer.eos_token_id).all()
    assert not mask[real:].any()


def test_random_ids_without_tokenizer():
    batches, source = calibration_batches(None, vocab_size=50, steps=2, batch_size=3, seq_len=8, seed=7)
    assert "random" in source
    assert batches[0]["input_ids"].shape == (3, 8)
    assert int(batches[0]["input_ids"].max()) < 50 and int(batches[0]["input_ids"].min()) >= 0
    again, _ = calibration_batches(None, vocab_size=50, steps=2, batch_size=3, seq_len=8, seed=7)
    assert torch.equal(batches[1]["input_ids"], again[1]["input_ids"])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"texts": []}, "texts"),
        ({"texts": ["", "   \n"]}, "texts"),
        ({"texts": ["fine", 3]}, "texts"),
        ({"texts": "a string is not a list"}, "texts"),
        ({"steps": 0}, "steps"),
        ({"batch_size": -1}, "batch_size"),
        ({"seq_len": True}, "seq_len"),
        ({"vocab_size": 10}, "tokenizer"),  # tokenizer ids beyond the model's vocabulary
    ],
)
def test_bad_calibration_settings(tokenizer, kwargs, field):
    args = {"vocab_size": VOCAB, "steps": 1, "batch_size": 1, "seq_len": 8} | kwargs
    with pytest.raises(CalibrationDataError) as info:
        calibration_batches(tokenizer, **args)
    assert info.value.field == field


# --- recording ------------------------------------------------------------------------------------


def _random_batches(steps: int = 3):
    batches, _ = calibration_batches(None, vocab_size=VOCAB, steps=steps, batch_size=2, seq_len=12, seed=3)
    return batches


def test_forward_amax_matches_direct_recomputation(model):
    batches = _random_batches()
    progress = []
    recorded = record_amax(model, [Q_PROJ, LM_HEAD], batches, on_step=lambda d, t: progress.append((d, t)))
    assert progress == [(1, 3), (2, 3), (3, 3)]
    assert recorded[Q_PROJ].backward is None and recorded[Q_PROJ].steps == 3

    q_proj = model.get_submodule(Q_PROJ)
    with torch.no_grad():
        for step, batch in enumerate(batches):
            x = model.model.layers[0].input_layernorm(model.model.embed_tokens(batch["input_ids"]))
            expected = torch.stack([x.abs().amax(), q_proj.weight.abs().amax(), q_proj(x).abs().amax()])
            assert torch.equal(recorded[Q_PROJ].forward[step], expected)

            hidden = model.model(**batch).last_hidden_state
            logits = model(**batch).logits
            expected = torch.stack([hidden.abs().amax(), model.lm_head.weight.abs().amax(), logits.abs().amax()])
            assert torch.equal(recorded[LM_HEAD].forward[step], expected)


def test_backward_records_gradients_and_leaves_the_model_clean(model):
    model.train()
    batches = _random_batches(steps=2)
    recorded = record_amax(model, [Q_PROJ, LM_HEAD], batches, backward=True)

    assert model.training  # restored
    assert all(p.grad is None for p in model.parameters())
    for path in (Q_PROJ, LM_HEAD):
        module = model.get_submodule(path)
        assert not module._forward_hooks and not module._backward_hooks
        assert recorded[path].backward.shape == (2, 2)
        assert (recorded[path].backward > 0).all()

    # lm_head's grad_output is d(loss)/d(logits); recompute it directly for the first batch (eval mode,
    # as calibration runs).
    model.eval()
    batch = batches[0]
    out = model(**batch, labels=batch["input_ids"])
    out.logits.retain_grad()
    out.loss.backward()
    grad_logits = out.logits.grad
    model.zero_grad(set_to_none=True)
    model.train()
    assert torch.equal(recorded[LM_HEAD].backward[0, 0], grad_logits.abs().amax())
    expected_grad_input = (grad_logits @ model.lm_head.weight).abs().amax()
    assert torch.allclose(recorded[LM_HEAD].backward[0, 1], expected_grad_input, rtol=1e-5)


def test_should_stop_cancels_between_steps_and_removes_hooks(model):
    calls = []

    def should_stop() -> bool:
        calls.append(1)
        return len(calls) > 1

    with pytest.raises(ConversionCancelled):
        record_amax(model, [Q_PROJ], _random_batches(), should_stop=should_stop)
    assert not model.get_submodule(Q_PROJ)._forward_hooks


@pytest.mark.parametrize(
    ("paths", "batches"),
    [
        (["model.layers.9.mlp"], 1),
        (["model.norm"], 1),
        ([], 1),
        ([Q_PROJ], 0),
    ],
)
def test_record_amax_rejects(model, paths, batches):
    with pytest.raises(CalibrationDataError):
        record_amax(model, paths, _random_batches(steps=1)[:batches])


# --- TE state -------------------------------------------------------------------------------------


def _div(a: float, b: float) -> float:
    """fp32 division, as TE's kernel does it."""
    return (torch.tensor(a, dtype=torch.float32) / torch.tensor(b, dtype=torch.float32)).item()


def test_te_scaling_state_hand_computed():
    layer = LayerAmax(
        forward=torch.tensor([[2.0, 1.0, 5.0], [4.0, 1.0, 6.0]]),
        backward=torch.tensor([[8.0, 3.0], [0.0, 0.0]]),
    )
    state = te_scaling_state(layer, TEDelayedScalingRecipe(amax_history_len=2))
    assert state["scale_fwd"].tolist() == [112.0, 448.0, 1.0]  # output slot unused by te.Linear
    assert state["amax_history_fwd"].tolist() == [[0.0, 0.0, 0.0], [4.0, 1.0, 0.0]]
    assert state["scale_bwd"].tolist() == [7168.0, 1.0]  # HYBRID: grad_output scaled to E5M2's 57344
    assert state["amax_history_bwd"].tolist() == [[0.0, 0.0], [8.0, 0.0]]

    full = te_scaling_state(layer, TEDelayedScalingRecipe(amax_history_len=2), fp8_output=True, fp8_grad=True)
    assert full["scale_fwd"].tolist() == [112.0, 448.0, _div(448.0, 6.0)]
    assert full["amax_history_fwd"][1].tolist() == [4.0, 1.0, 6.0]
    assert full["scale_bwd"].tolist() == [7168.0, _div(57344.0, 3.0)]

    e4m3 = te_scaling_state(layer, TEDelayedScalingRecipe(amax_history_len=2, fp8_format="E4M3"))
    assert e4m3["scale_bwd"].tolist() == [56.0, 1.0]


def test_te_scaling_state_from_recorded_amax(model):
    recorded = record_amax(model, [Q_PROJ], _random_batches())[Q_PROJ]
    recipe = TEDelayedScalingRecipe(amax_history_len=4, margin=1, amax_compute_algo="most_recent")
    state = te_scaling_state(recorded, recipe)
    assert state["amax_history_fwd"].shape == (4, 3) and state["amax_history_bwd"].shape == (4, 2)
    # no backward recorded: TE's initial backward state
    assert state["scale_bwd"].tolist() == [1.0, 1.0] and not state["amax_history_bwd"].any()
    expected_scale, expected_history = delayed_scaling_state(
        recorded.forward[:, :2], history_len=4, algo="most_recent", margin=1, fp8_max=448.0
    )
    assert torch.equal(state["scale_fwd"][:2], expected_scale)
    assert torch.equal(state["amax_history_fwd"][:, :2], expected_history)


def test_te_scaling_state_needs_delayed_scaling():
    layer = LayerAmax(forward=torch.ones(1, 3))
    with pytest.raises(RecipeError):
        te_scaling_state(layer, TECurrentScalingRecipe())


def test_backward_with_frozen_parameters_is_a_clear_error(model):
    flags = [p.requires_grad for p in model.parameters()]
    try:
        model.requires_grad_(False)
        with pytest.raises(CalibrationDataError) as info:
            record_amax(model, [Q_PROJ], _random_batches(steps=1), backward=True)
        assert info.value.field == "backward"
    finally:
        for p, flag in zip(model.parameters(), flags, strict=True):
            p.requires_grad_(flag)
    assert not model.get_submodule(Q_PROJ)._backward_hooks
