"""The model being converted: references and where they may point, config bounds, the meta-device build,
loading weights tensor by tensor from safetensors checkpoints, MoE experts as GEMM units, the built-in demo model.
"""

from converters._lazy import lazy_exports

#: public name -> the module that defines it (loaded on first use: see converters._lazy)
_EXPORTS = {
    "ModelSourceOptions": "converters.model.sources",
    "resolve_model_dir": "converters.model.sources",
    "validate_model_reference": "converters.model.sources",
    "load_config": "converters.model.sources",
    "build_meta_model": "converters.model.sources",
    "load_model": "converters.model.sources",
    "load_tokenizer": "converters.model.sources",
    "model_dtype": "converters.model.sources",
    "confinement_for": "converters.model.sources",
    "TOKENIZER_FILES": "converters.model.sources",
    "FileConfinement": "converters.model.files",
    "INDEX_NAME": "converters.model.files",
    "SINGLE_FILE_NAME": "converters.model.files",
    "ConfigLimits": "converters.model.config_checks",
    "Checkpoint": "converters.model.checkpoint",
    "EXPERT_GEMMS": "converters.model.experts",
    "find_experts": "converters.model.experts",
    "unit_path": "converters.model.experts",
    "parse_unit_path": "converters.model.experts",
    "DEMO_MODEL_REF": "converters.model.demo",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
