"""Our eligible set equals what Accelerate's torchao path selects, using accelerate's own functions."""

import pytest
import torch
from accelerate.utils.ao import filter_linear_layers, find_first_last_linear_layers
from torch import nn

from converters.analysis.eligibility import analyze_model, eligible_paths
from converters.model.sources import build_meta_model, load_config
from tests.converters.analysis.test_eligibility import MoeBlock, meta_model
from tests.models import minilm_dir


def accelerate_selection(model: nn.Module) -> list[str]:
    first, last = find_first_last_linear_layers(model)
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and filter_linear_layers(module, name, layers_to_filter=[first, last])
    ]


@pytest.mark.parametrize("name", ["llama", "mixtral", "bert"])
def test_tiny_models_match_accelerate(name):
    model = meta_model(name)
    ours = eligible_paths(analyze_model(model))
    assert ours == accelerate_selection(model)
    assert ours  # a parity of two empty sets would prove nothing


def test_real_minilm_matches_accelerate(sources):
    from converters.model.sources import ModelSourceOptions

    directory = minilm_dir()
    options = ModelSourceOptions(allowed_roots=(directory.parent,))
    model = build_meta_model(load_config(directory, options), options)
    ours = eligible_paths(analyze_model(model))
    assert ours == accelerate_selection(model)
    assert len(ours) == 6 * 6 - 1  # 6 layers x 6 Linears + pooler, minus first and last


def test_router_gates_differ_on_purpose():
    """Accelerate converts an nn.Linear MoE router gate; we keep it in high precision by default."""
    model = nn.Sequential(nn.Linear(64, 64), MoeBlock(), nn.Linear(64, 64))
    with torch.no_grad():
        ours = set(eligible_paths(analyze_model(model)))
    theirs = set(accelerate_selection(model))
    assert theirs - ours == {"1.gate", "1.shared_expert_gate"}
    assert ours <= theirs
