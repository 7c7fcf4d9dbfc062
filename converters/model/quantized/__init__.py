"""Quantized checkpoints as input: which scheme a checkpoint is stored in, which weights are quantized, and
each weight dequantized one at a time with its reference library's own arithmetic.

Read side of the layouts :mod:`converters.serving` writes (fp8-block, compressed-tensors FP8/NVFP4/MXFP8,
ModelOpt FP8/NVFP4) and of the checkpoints others publish in them (DeepSeek-V3, Qwen3-FP8, llm-compressor,
ModelOpt exports). ``converters.model`` must not import ``converters.serving``: the layouts are restated here.
"""

from converters.model.quantized.arithmetic import dequantize_fp8, dequantize_nvfp4, unpack_e2m1
from converters.model.quantized.detect import (
    HF_QUANT_CONFIG,
    checkpoint_tensor_names,
    describe_source_quantization,
    source_quantization,
)
from converters.model.quantized.source import Scheme, SourceQuantization

__all__ = ["HF_QUANT_CONFIG", "Scheme", "SourceQuantization", "checkpoint_tensor_names", "dequantize_fp8",
           "describe_source_quantization",
           "dequantize_nvfp4", "source_quantization", "unpack_e2m1"]
