"""Where each serving export loads: vLLM, SGLang, TensorRT-LLM and transformers (with compressed-tensors).

One row per layout; every name of :data:`converters.serving.SERVING_FORMATS` maps to the layout it writes (a training
twin writes its parent's layout, with another library's arithmetic), so the table answers for every format the
registry knows and a new format without a row fails the tests. Each cell is what the consumer does with the export
as written: ``loads`` (it builds the quantized layers and runs them), ``loads, dequantizes to bf16`` (it reads the
FP8/FP4 tensors and turns them back into bf16 weights, so the model runs but nothing is quantized) or ``not loaded``
with why, and the source of the claim.

Sources. transformers: run here, by ``tests/converters/serving/test_loads_in.py``, which loads every layout's export
with ``AutoModelForCausalLM.from_pretrained`` on the CPU (transformers 5.24, compressed-tensors 0.20.1) and checks
the cell against what happened; ``quantizers/auto.py`` (``AUTO_QUANTIZER_MAPPING``) lists the ``quant_method``
values it recognises, and ``modelopt`` is not one of them. The engines cannot be installed on the CPU-only machines
(see :mod:`converters.serving.audit`), so their cells come from their code and documentation:
vLLM from the files the load audit restates (:mod:`converters.serving.audit`, vLLM v0.33.0 and the commits it
names); SGLang from its quantization documentation (docs.sglang.io ``advanced_features/quantization``: ``fp8``,
``compressed-tensors``, ``modelopt_fp8`` on SM90+, ``modelopt_fp4`` on SM100+) and its compressed-tensors schemes
(``python/sglang/srt/layers/quantization/compressed_tensors/schemes/``); TensorRT-LLM from
``tensorrt_llm/_torch/model_config.py`` ``load_hf_quant_config`` (commit 008e0af8) and
``tensorrt_llm/models/quant_config_utils.py`` ``_quant_config_from_config_group`` (commit 21156a7a), which read
``hf_quant_config.json`` (ModelOpt), ``quant_method: fp8`` with ``weight_block_size`` and compressed-tensors FP8
only per channel or per block, NVFP4 only with FP4 activations.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from converters.serving_names import SERVING_FORMAT_SPECS

__all__ = ["CONSUMERS", "LAYOUT_OF", "LoadStatus", "LoadsIn", "loads_in", "loads_in_markdown", "loads_in_warnings"]


class LoadStatus(str, enum.Enum):
    """What a consumer does with an export (the cell's first words)."""

    LOADS = "loads"  #: builds the quantized layers and runs them
    DEQUANTIZES = "loads, dequantizes to bf16"  #: reads the low-precision tensors back into bf16 weights
    NOT_LOADED = "not loaded"  #: refuses the export, or reads it wrongly (the note says which)


@dataclass(frozen=True, kw_only=True)
class LoadsIn:
    """One cell: ``consumer`` and what it does with the export (``status``), why (``note``), from where (``source``)."""

    consumer: str
    status: LoadStatus
    note: str
    source: str

    def to_dict(self) -> dict[str, str]:
        return {"consumer": self.consumer, "status": self.status.value, "note": self.note, "source": self.source}


CONSUMERS = ("vLLM", "SGLang", "TensorRT-LLM", "transformers")

_RUN_HERE = "run here: tests/converters/serving/test_loads_in.py (transformers 5.24, compressed-tensors 0.20.1, CPU)"
_VLLM = "vLLM v0.33.0 code, as restated by the load audit (converters/serving/audit/__init__.py names the files)"
_SGLANG_DOCS = "docs.sglang.io advanced_features/quantization"
_SGLANG_CT = "sglang python/sglang/srt/layers/quantization/compressed_tensors/schemes/"
_SGLANG_W8A8 = ("compressed-tensors W8A8 FP8 scheme",
                f"{_SGLANG_DOCS}; {_SGLANG_CT}compressed_tensors_w8a8_fp8.py")
_TRTLLM_CT = "TensorRT-LLM tensorrt_llm/models/quant_config_utils.py _quant_config_from_config_group (21156a7a)"
_TRTLLM_HF = "TensorRT-LLM tensorrt_llm/_torch/model_config.py load_hf_quant_config (008e0af8)"

_L, _D, _N = LoadStatus.LOADS, LoadStatus.DEQUANTIZES, LoadStatus.NOT_LOADED
_CT_DEQUANTIZES = (_D, "compressed-tensors decompresses the weights to bf16 on load; nothing runs in FP8/FP4 there",
                   _RUN_HERE)
#: transformers' quantizers/auto.py (AUTO_QUANTIZER_MAPPING) has no "modelopt": it warns "Unknown quantization type"
_MODELOPT_SKIPPED = "no 'modelopt' quantizer: it skips quantization_config and"
_TRT_PER_TENSOR = ("compressed-tensors FP8 weights only per channel or per block ('Unsupported "
                   "weights_quant_strategy: tensor')")

#: layout -> consumer -> (status, note, source)
_TABLE: dict[str, dict[str, tuple[LoadStatus, str, str]]] = {
    "compressed-tensors-fp8": {
        "vLLM": (_L, "CompressedTensorsW8A8Fp8, per-tensor weight and static input scales", _VLLM),
        "SGLang": (_L, *_SGLANG_W8A8),
        "TensorRT-LLM": (_N, _TRT_PER_TENSOR, _TRTLLM_CT),
        "transformers": _CT_DEQUANTIZES,
    },
    "compressed-tensors-fp8-dynamic": {
        "vLLM": (_L, "CompressedTensorsW8A8Fp8, per-channel weight scales, dynamic per-token activations", _VLLM),
        "SGLang": (_L, *_SGLANG_W8A8),
        "TensorRT-LLM": (_L, "FP8_PER_CHANNEL_PER_TOKEN", _TRTLLM_CT),
        "transformers": _CT_DEQUANTIZES,
    },
    "compressed-tensors-fp8-per-tensor-dynamic": {
        "vLLM": (_L, "CompressedTensorsW8A8Fp8, per-tensor weight scale, dynamic per-token activations", _VLLM),
        "SGLang": (_L, *_SGLANG_W8A8),
        "TensorRT-LLM": (_N, _TRT_PER_TENSOR, _TRTLLM_CT),
        "transformers": _CT_DEQUANTIZES,
    },
    "fp8-block": {
        "vLLM": (_L, "Fp8LinearMethod with weight_block_size [128, 128]", _VLLM),
        "SGLang": (_L, "fp8 with weight_block_size (the DeepSeek-V3 layout)", _SGLANG_DOCS),
        "TensorRT-LLM": (_L, "FP8_BLOCK_SCALES (quant_method fp8 with weight_block_size [128, 128])", _TRTLLM_HF),
        "transformers": (_D, "FineGrainedFP8 quantizer: without a GPU it dequantizes to bf16 on load (with a CUDA GPU "
                             "it keeps FP8Linear layers; not run here)", _RUN_HERE),
    },
    "fp8-block-ue8m0": {
        "vLLM": (_L, "Fp8LinearMethod with weight_block_size [128, 128]; the power-of-two scales are fp32 values",
                 _VLLM),
        "SGLang": (_L, "fp8 with weight_block_size (the DeepSeek-V3.1 layout, scale_fmt ue8m0)", _SGLANG_DOCS),
        "TensorRT-LLM": (_L, "FP8_BLOCK_SCALES; the power-of-two scales are read as the fp32 values they are",
                         _TRTLLM_HF),
        "transformers": (_D, "FineGrainedFP8 quantizer: without a GPU it dequantizes the fp32 power-of-two scales to "
                             "bf16 on load (with a CUDA GPU it keeps FP8Linear layers; not run here)", _RUN_HERE),
    },
    "mxfp8": {
        "vLLM": (_L, "CompressedTensorsW8A8Mxfp8 (FlashInfer CUTLASS on SM100+, Marlin W8A16 on SM80+)", _VLLM),
        "SGLang": (_L, "compressed-tensors W8A8 MXFP8 scheme (SM100+)",
                   f"{_SGLANG_CT}compressed_tensors_w8a8_mxfp8.py"),
        "TensorRT-LLM": (_N, "compressed-tensors 8-bit weights only per channel or per block ('Unsupported "
                             "weights_quant_strategy: group'); MXFP8 only as quant_method mxfp8", _TRTLLM_CT),
        "transformers": _CT_DEQUANTIZES,
    },
    "nvfp4": {
        "vLLM": (_L, "CompressedTensorsW4A4Fp4 (W4A4)", _VLLM),
        "SGLang": (_L, "compressed-tensors W4A4 NVFP4 scheme (Blackwell)",
                   f"{_SGLANG_CT}compressed_tensors_w4a4_nvfp4.py"),
        "TensorRT-LLM": (_L, "NVFP4 (tensor_group weights and activations, group 16)", _TRTLLM_CT),
        "transformers": _CT_DEQUANTIZES,
    },
    "nvfp4-a16": {
        "vLLM": (_L, "CompressedTensorsW4A16Fp4 (weights FP4, activations bf16)", _VLLM),
        "SGLang": (_L, "compressed-tensors W4A16 NVFP4 scheme", f"{_SGLANG_CT}compressed_tensors_w4a16_nvfp4.py"),
        "TensorRT-LLM": (_N, "compressed-tensors NVFP4 only with FP4 activations (a weight-only config fails "
                             "where it reads input_activations['strategy'])", _TRTLLM_CT),
        "transformers": _CT_DEQUANTIZES,
    },
    "modelopt-fp8": {
        "vLLM": (_L, "ModelOptFp8LinearMethod (hf_quant_config.json or config.json quant_method modelopt)", _VLLM),
        "SGLang": (_L, "modelopt_fp8 (Hopper, SM90+)", _SGLANG_DOCS),
        "TensorRT-LLM": (_L, "ModelOpt's own checkpoint: hf_quant_config.json quant_algo FP8", _TRTLLM_HF),
        "transformers": (_N, f"{_MODELOPT_SKIPPED} runs the E4M3 codes as weights, without their scales (logits "
                             "unrelated to the source's)", _RUN_HERE),
    },
    "modelopt-nvfp4": {
        "vLLM": (_L, "ModelOptNvFp4LinearMethod", _VLLM),
        "SGLang": (_L, "modelopt_fp4 (Blackwell, SM100+)", _SGLANG_DOCS),
        "TensorRT-LLM": (_L, "ModelOpt's own checkpoint: hf_quant_config.json quant_algo NVFP4", _TRTLLM_HF),
        "transformers": (_N, f"{_MODELOPT_SKIPPED} from_pretrained fails on the packed FP4 weights (size "
                             "mismatch)", _RUN_HERE),
    },
}

#: serving format name -> the layout it writes (a row of the table; a training twin writes its parent's layout)
LAYOUT_OF: dict[str, str] = {spec.name: spec.layout.value for spec in SERVING_FORMAT_SPECS}


def loads_in(format_name: str) -> list[LoadsIn]:
    """Where an export of ``format_name`` loads, one cell per consumer of :data:`CONSUMERS`.

    Raises KeyError for a name without a layout (every name of ``SERVING_FORMATS`` has one; tested).
    """
    row = _TABLE[LAYOUT_OF[format_name]]
    return [LoadsIn(consumer=consumer, status=row[consumer][0], note=row[consumer][1], source=row[consumer][2])
            for consumer in CONSUMERS]


def loads_in_warnings(format_name: str) -> list[str]:
    """One line per consumer that loads the export wrongly or not at all: the report's warnings for this export."""
    return [f"serving/{format_name}: {cell.consumer} does not load it ({cell.note}); load it with "
            f"{', '.join(c.consumer for c in loads_in(format_name) if c.status is not LoadStatus.NOT_LOADED)}"
            for cell in loads_in(format_name) if cell.status is LoadStatus.NOT_LOADED]


def _cell(cell: LoadsIn) -> str:
    return cell.status.value if cell.status is not LoadStatus.NOT_LOADED else f"**not loaded**: {cell.note}"


def loads_in_markdown(format_names: Any) -> str:
    """The README's table: one row per format of ``format_names`` (the registry's, in its order)."""
    lines = ["| format | " + " | ".join(CONSUMERS) + " |", "|---|" + "---|" * len(CONSUMERS)]
    for name in format_names:
        cells = loads_in(name)
        lines.append(f"| `{name}` | " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines)
