"""FP8 KV-cache scales on the real SmolLM2-135M: per-tensor amax/448 (what llm-compressor's static minmax observer
writes) against fp8forge's attention-output clipping search, by perplexity with the KV cache emulated in FP8.

What runs, in one process:

1. Calibration: the job's default token rows (``CalibrationSettings()``: 16 steps x 2 x 128 tokens of the built-in
   corpus' calibration part) through the bf16 model with fp8forge's KV recorder on (``recording_kv_amax``): the
   per-tensor amax and the searched clipping of every layer. Timed against the same pass with the search off (the
   recorder given no query), to print what the search costs as a ratio.
2. Scales: ``amax / 448`` and ``clipped amax / 448``, both computed in bf16 as the compressed-tensors export writes
   them (``converters.serving.kv_scales.kv_scale``) and as vLLM loads them.
3. Perplexity on ``--tokens`` held-out positions (the corpus' held-out part as one stream, windows of
   ``--window``), weights in bf16 so that the loss is the KV cache's alone: no FP8 KV, FP8 KV at amax/448, FP8
   KV at the searched scales. The KV emulation is this file's: every attention module's post-RoPE keys and values
   are stored as E4M3 with the layer's scale and read back before the kernel, for every position (a prefill
   reads its own tokens back from the cache in vLLM). Two roundings: ``nearest`` (vLLM's CUDA cast, saturating)
   and ``truncate`` (vLLM 0.32's CPU cast: ``x * (1/scale)`` clamped to 448, mantissa cut toward zero).

The KV-attributed loss is ``ppl_kv / ppl_bf16 - 1``; the goal of issue #36 is the searched loss at most half of
the amax/448 loss. Run:

  .venv/bin/python benchmarks/bench_kv_scales.py --tokens 8192
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from converters.calibration.batches import calibration_batches  # noqa: E402
from converters.calibration.kv_cache import KvCacheRecorder, recording_kv_amax  # noqa: E402
from converters.calibration.scaling import E4M3_MAX  # noqa: E402
from converters.pipeline.request import CalibrationSettings  # noqa: E402
from converters.quality.held_out import calibration_part, held_out_part  # noqa: E402
from converters.serving.kv_scales import KEEP_HIGH_PRECISION_ERROR, kv_scale  # noqa: E402
from tests.converters.quality.smollm import smollm_dir  # noqa: E402

EMULATED = "bench_fp8_kv"
#: attention module -> (key scale, value scale, rounding) while a perplexity pass runs
_CASTS: dict[torch.nn.Module, tuple[float, float, str]] = {}


def store_e4m3(x: torch.Tensor, scale: float, rounding: str) -> torch.Tensor:
    """``x`` written to an E4M3 cache with ``scale`` and read back (saturating at 448)."""
    if rounding == "nearest":
        scaled = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX)
        return (scaled.to(torch.float8_e4m3fn).float() * scale).to(x.dtype)
    scaled = (x.float() * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX)
    codes = scaled.to(torch.float8_e4m3fn)
    # E4M3 magnitudes grow with the byte's low seven bits: one code down where nearest rounded away from zero
    away = codes.float().abs() > scaled.abs()
    bits = codes.view(torch.uint8)
    codes = torch.where(away, bits - 1, bits).view(torch.float8_e4m3fn)
    return (codes.float() * scale).to(x.dtype)


def _emulated_attention(module, query, key, value, *args, **kwargs):
    cast = _CASTS.get(module)
    if cast is not None:
        key, value = store_e4m3(key, cast[0], cast[2]), store_e4m3(value, cast[1], cast[2])
    return sdpa_attention_forward(module, query, key, value, *args, **kwargs)


def attention_modules(model) -> dict[str, torch.nn.Module]:
    return {path: module for path, module in model.named_modules() if type(module).__name__.endswith("Attention")}


def perplexity(model, windows: list[torch.Tensor], scales: dict[str, tuple[float, float]] | None,
               rounding: str = "nearest") -> float:
    modules = attention_modules(model)
    _CASTS.clear()
    if scales is not None:
        _CASTS.update({modules[path]: (k, v, rounding) for path, (k, v) in scales.items()})
    nll, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            logits = model(input_ids=window[None]).logits[0, :-1].float()
            nll += float(torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum"))
            count += window.numel() - 1
    _CASTS.clear()
    return math.exp(nll / count)


def calibrate(model, batches, *, search: bool) -> tuple[dict, float]:
    """The recorder's results over ``batches`` and the seconds the pass took (``search=False``: amax only)."""
    original = KvCacheRecorder.observe

    def amax_only(self, path, key, value, **_):
        original(self, path, key, value)

    if not search:
        KvCacheRecorder.observe = amax_only
    try:
        start = time.perf_counter()
        with torch.no_grad(), recording_kv_amax(model) as recorder:
            for batch in batches:
                model(**batch)
            results = recorder.results()
        return results, time.perf_counter() - start
    finally:
        KvCacheRecorder.observe = original


def held_out_windows(tokenizer, tokens: int, window: int) -> list[torch.Tensor]:
    stream: list[int] = []
    for text in held_out_part():
        stream += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    stream = stream[: tokens // window * window]
    if len(stream) < window:
        raise SystemExit(f"the held-out part has {len(stream)} tokens, fewer than one window of {window}")
    return list(torch.tensor(stream).split(window))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="held-out positions scored (default 8192)")
    parser.add_argument("--window", type=int, default=512, help="tokens per scored window (default 512)")
    parser.add_argument("--calib-steps", type=int, default=CalibrationSettings().steps,
                        help="calibration steps of 2 x 128 tokens (default: the job's)")
    parser.add_argument("--time-search", action="store_true",
                        help="also run the calibration pass without the search, to print what the search costs")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # eight processes share two cores here: one thread spins on no OpenMP barrier
    directory = smollm_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    # float32 compute: this CPU has no fast bf16 GEMM (the pipeline's layer-sequential pass upcasts too); the
    # weights are the bf16 checkpoint's values, and the scales are computed in bf16 as the export writes them
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa").eval()
    settings = CalibrationSettings(steps=args.calib_steps)
    batches, source = calibration_batches(tokenizer, vocab_size=model.config.vocab_size, texts=calibration_part(),
                                          steps=settings.steps, batch_size=settings.batch_size,
                                          seq_len=settings.seq_len)
    plain_s = calibrate(model, batches, search=False)[1] if args.time_search else float("nan")
    searched, search_s = calibrate(model, batches, search=True)
    print(f"calibration with the search: {search_s:.1f} s", file=sys.stderr, flush=True)

    dtype = torch.bfloat16
    amax_scales = {path: (float(kv_scale(layer.key_amax, dtype)), float(kv_scale(layer.value_amax, dtype)))
                   for path, layer in searched.items()}
    search_scales = {path: (float(kv_scale(layer.key_clip, dtype)), float(kv_scale(layer.value_clip, dtype)))
                     for path, layer in searched.items()}

    AttentionInterface.register(EMULATED, _emulated_attention)
    model.set_attn_implementation(EMULATED)
    windows = held_out_windows(tokenizer, args.tokens, args.window)
    base = perplexity(model, windows, None)
    rows = []
    for rounding in ("nearest", "truncate"):
        at_amax = perplexity(model, windows, amax_scales, rounding)
        at_search = perplexity(model, windows, search_scales, rounding)
        rows.append((rounding, at_amax, at_search))
        print(f"{rounding}: bf16 {base:.3f}, amax {at_amax:.3f}, searched {at_search:.3f}", file=sys.stderr, flush=True)

    print(f"# FP8 KV-cache scales, SmolLM2-135M-Instruct (bf16 weights, fp32 compute), {time.strftime('%Y-%m-%d')}")
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"calibration: {settings.steps} x {settings.batch_size} x {settings.seq_len} tokens ({source}); "
          f"held-out: {len(windows)} windows of {args.window} tokens")
    timing = f" / without: {plain_s:.1f} s = {search_s / plain_s:.2f}x" if args.time_search else ""
    print(f"calibration pass with the search: {search_s:.1f} s{timing}\n")
    print("| KV cache | rounding | perplexity | KV-attributed loss | searched / amax loss |")
    print("|---|---|---|---|---|")
    print(f"| bf16 | | {base:.3f} | | |")
    for rounding, at_amax, at_search in rows:
        loss_amax, loss_search = at_amax / base - 1, at_search / base - 1
        ratio = loss_search / loss_amax if loss_amax > 0 else float("nan")
        print(f"| FP8, amax/448 (llm-compressor's minmax) | {rounding} | {at_amax:.3f} | {loss_amax:+.2%} | |")
        print(f"| FP8, searched clipping | {rounding} | {at_search:.3f} | {loss_search:+.2%} | {ratio:.2f} |")
    print("\n| layer | k ratio | v ratio | attention error at amax/448 | searched | k amax | v amax |")
    print("|---|---|---|---|---|---|---|")
    for path, layer in searched.items():
        found = layer.search
        flag = " (high precision)" if found.error_chosen > KEEP_HIGH_PRECISION_ERROR else ""
        print(f"| {path}{flag} | {found.key_ratio:.2f} | {found.value_ratio:.2f} | {found.error_at_amax:.2e} | "
              f"{found.error_chosen:.2e} | {layer.key_amax:.1f} | {layer.value_amax:.1f} |")
    errors = sorted(layer.search.error_chosen for layer in searched.values())
    print(f"\nattention error at the searched scales: median {errors[len(errors) // 2]:.2e}, max {errors[-1]:.2e}; "
          f"threshold for high precision {KEEP_HIGH_PRECISION_ERROR:g}")


if __name__ == "__main__":
    main()
