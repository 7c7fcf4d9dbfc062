"""The built-in demo model: a tiny Llama with its own tokenizer, built locally from a config.

It lets a new user run a real conversion end to end with no model hub. It is built on first use
(random weights, fixed seed) into ``<demo_dir>/tiny-llama`` and reused afterwards.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from converters.third_party_noise import transformers_progress_off

__all__ = ["DEMO_MODEL_REF", "ensure_demo_model", "build_tiny_llama", "build_demo_tokenizer"]

logger = logging.getLogger(__name__)

DEMO_MODEL_REF = "demo/tiny-llama"

# A few sentences are enough to give the byte-level BPE some merges; the model's weights are random.
_TOKENIZER_TEXT = [
    "FP8 training keeps a scale per tensor so that values fit the narrow range of the format.",
    "Delayed scaling derives the scale of this step from the amax history of earlier steps.",
    "The first and last linear layers usually stay in higher precision for stability.",
    "A converted checkpoint carries its weights, its scaling state and a report of what changed.",
]


def build_demo_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a few sentences (no download needed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TOKENIZER_TEXT, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def build_tiny_llama(directory: Path, *, hidden_size: int = 128, layers: int = 2, seed: int = 0,
                     kv_heads: int = 2) -> Path:
    """Write a tiny bf16 Llama (config, safetensors, tokenizer) to ``directory`` with save_pretrained; 4 attention
    heads sharing ``kv_heads`` key/value heads (4: no grouped-query attention)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = build_demo_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with transformers_progress_off():
        model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def ensure_demo_model(demo_dir: Path) -> Path:
    """Return the demo model's directory, building it atomically on first use."""
    target = Path(demo_dir) / "tiny-llama"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=target.parent))
    try:
        build_tiny_llama(staging)
        # Several workers may build at once; the first rename wins and the others reuse its result.
        os.replace(staging, target)
        logger.info("built the demo model in %s", target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
