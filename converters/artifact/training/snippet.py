"""``train_one_step.py``: ten lines that load the artifact beside them and train one step."""

from __future__ import annotations

from converters.artifact.training.decisions import TrainingDecisions

__all__ = ["train_one_step_script"]

_AO = '''"""Load this fp8forge artifact ({recipe}) and train one step: python training/train_one_step.py"""
from pathlib import Path
import torch
from converters import load_torchao
model = load_torchao(Path(__file__).resolve().parent.parent)
ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
loss = {loss}
loss.backward()
torch.optim.AdamW(model.parameters(), lr=1e-5).step()
print(f"trained one step, loss {{loss.item():.4f}}")
'''

_TE = '''"""Load this fp8forge artifact ({recipe}) and train one step (CUDA): python training/train_one_step.py"""
from pathlib import Path
import torch
from converters import load_te
from converters.backends.te.runtime import te_autocast, te_module
model = load_te(Path(__file__).resolve().parent.parent).train()
ids = torch.randint(0, model.config.vocab_size, (2, 32), device="cuda")
with te_autocast(te_module(), enabled=True, recipe=model.fp8_recipe):  # the artifact's recipe, never TE's default
    loss = {loss}
loss.backward()
torch.optim.AdamW(model.parameters(), lr=1e-5).step()
print(f"trained one step, loss {{loss.item():.4f}}")
'''


def train_one_step_script(decisions: TrainingDecisions) -> str:
    """The script's text for the artifact's backend and model kind."""
    causal = any(name.endswith("ForCausalLM") for name in decisions.architectures)
    loss = "model(input_ids=ids, labels=ids).loss" if causal else "model(input_ids=ids)[0].float().square().mean()"
    template = _TE if decisions.recipe.backend.value == "te" else _AO
    return template.format(recipe=decisions.recipe.library_class, loss=loss)
