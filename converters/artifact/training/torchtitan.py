"""torchtitan converter settings for a torchao artifact, as a Python file (torchtitan configures in Python).

Read from torchtitan 0.3.0 (PyPI; ``torchtitan/components/quantization/``): ``Float8LinearConverter.Config``
(``recipe_name`` "rowwise" | "rowwise_with_gw_hp", ``filter_fqns``: modules whose FQN contains an entry stay in high
precision, ``emulate``: torchao's default tensorwise config emulated), ``MXFP8LinearConverter.Config`` (``fqns``:
only modules whose FQN contains an entry are converted; Blackwell only), both with ``model_compile_enabled``; and
``utils.module_filter_fn``, which also skips any Linear with a dimension not divisible by 16. Module names follow
torchtitan's own Llama 3 state-dict adapter (``models/llama3/state_dict_adapter.py`` ``from_hf_map``).
"""

from __future__ import annotations

from converters.artifact.training.decisions import TrainingDecisions
from converters.recipes import AOFloat8TrainingOpRecipe, AOMXFP8TrainingOpRecipe, AORecipeName, TorchAORecipe

__all__ = ["TORCHTITAN_NAMES", "torchtitan_converters", "torchtitan_unsupported", "torchtitan_fqn",
           "torchtitan_note"]

#: Hugging Face module path pattern -> torchtitan Llama 3 FQN ({} is the block index)
TORCHTITAN_NAMES = {"model.layers.{}.self_attn.q_proj": "layers.{}.attention.qkv_linear.wq",
                    "model.layers.{}.self_attn.k_proj": "layers.{}.attention.qkv_linear.wk",
                    "model.layers.{}.self_attn.v_proj": "layers.{}.attention.qkv_linear.wv",
                    "model.layers.{}.self_attn.o_proj": "layers.{}.attention.wo",
                    "model.layers.{}.mlp.gate_proj": "layers.{}.feed_forward.w1",
                    "model.layers.{}.mlp.up_proj": "layers.{}.feed_forward.w3",
                    "model.layers.{}.mlp.down_proj": "layers.{}.feed_forward.w2",
                    "lm_head": "lm_head"}
_LLAMA_FAMILY = ("llama",)


def torchtitan_unsupported(decisions: TrainingDecisions) -> str | None:
    """Why no torchtitan settings are written (None when they are)."""
    if decisions.recipe.backend.value != "ao":
        return "torchtitan trains with torchao; this is a TransformerEngine artifact"
    if decisions.model_type not in _LLAMA_FAMILY:
        return (f"fp8forge maps Hugging Face names to torchtitan's for Llama models (torchtitan's Llama 3 adapter); "
                f"this is a {decisions.model_type!r}")
    return None


def torchtitan_fqn(path: str) -> str | None:
    """The torchtitan FQN of a Hugging Face module path, or None."""
    head, _, rest = path.partition("model.layers.")
    index, _, inner = rest.partition(".")
    key = f"model.layers.{{}}.{inner}" if not head and index.isdigit() else path
    name = TORCHTITAN_NAMES.get(key)
    return name.format(index) if name is not None and "{}" in name else name


def torchtitan_converters(decisions: TrainingDecisions) -> str | None:
    """The Python text of ``torchtitan_converters.py`` (None where :func:`torchtitan_unsupported` says why not)."""
    if torchtitan_unsupported(decisions) is not None:
        return None
    recipe, notes = decisions.recipe, []
    fp8 = [torchtitan_fqn(linear.path) for linear in decisions.linears if linear.fp8]
    kept = [torchtitan_fqn(linear.path) for linear in decisions.kept_high_precision]
    unmapped = [linear.path for linear in decisions.linears if torchtitan_fqn(linear.path) is None]
    if unmapped:
        notes.append(f"no torchtitan name for {', '.join(unmapped)}: torchtitan's Llama 3 has no such module")
    if isinstance(recipe, AOMXFP8TrainingOpRecipe):
        config = f"MXFP8LinearConverter.Config(fqns={_names(fp8)}, model_compile_enabled=True)"
        cls = "MXFP8LinearConverter"
        notes.append("torchtitan's MXFP8Linear takes torchao's defaults; the artifact's kernel_preference "
                     f"{recipe.kernel_preference.value}, scale_calculation_mode {recipe.scale_calculation_mode.value} "
                     f"and wgrad_with_hp {recipe.wgrad_with_hp} are not fields of MXFP8LinearConverter.Config")
    else:
        name = (recipe.float8_linear_recipe if isinstance(recipe, AOFloat8TrainingOpRecipe) else recipe.recipe_name)
        emulate = isinstance(recipe, TorchAORecipe) and recipe.emulate
        if name is AORecipeName.TENSORWISE and not emulate:
            return None  # torchtitan's Float8LinearConverter has no tensorwise recipe (see torchtitan_note)
        recipe_name = "rowwise" if name is AORecipeName.TENSORWISE else name.value
        config = (f"Float8LinearConverter.Config(recipe_name={recipe_name!r}, filter_fqns={_names(kept)}, "
                  f"emulate={emulate}, model_compile_enabled=False)")
        cls = "Float8LinearConverter"
        if emulate:
            notes.append("emulate=True makes torchtitan build torchao's default (tensorwise) Float8LinearConfig, "
                         "emulated, whatever recipe_name says")
    header = [f'"""torchtitan converters for {recipe.library_class}, written by fp8forge from this artifact.',
              "", "Add CONVERTERS to your model_registry(..., converters=CONVERTERS) (torchtitan 0.3).",
              "Module names are torchtitan's Llama 3 FQNs (its state-dict adapter maps the Hugging Face names).",
              *notes, '"""', "", f"from torchtitan.components.quantization import {cls}", "",
              f"CONVERTERS = [{config}]", ""]
    return "\n".join(header)


def torchtitan_note(decisions: TrainingDecisions) -> str | None:
    """Why the torchtitan file was not written, for the README (None when it was)."""
    why = torchtitan_unsupported(decisions)
    if why is None and torchtitan_converters(decisions) is None:
        why = ("torchtitan 0.3's Float8LinearConverter accepts recipe_name rowwise or rowwise_with_gw_hp only "
               "(tensorwise only through emulate=True): it cannot express this tensorwise artifact")
    return why


def _names(names: list[str | None]) -> str:
    return repr(sorted(name for name in names if name is not None))
