"""Runs one export in vLLM's CPU build and prints what the engine did as one JSON line (the last line of stdout).

Runs in the vLLM venv (`make vllm-venv` builds .venv-vllm), never in the project's: it imports vLLM, torch and
safetensors only. Usage: ``.venv-vllm/bin/python tests/engines/vllm_driver.py``: a request file's path per line of
stdin, an answer per line of stdout (:func:`serve`; ``tests/engines/engine.ask_vllm`` drives it); the request:

- ``model``: the export (or bf16 source) directory; ``kv_cache_dtype``: "auto" or "fp8"; ``quantization``: null
  (vLLM reads config.json) or a method name ("modelopt" for an export with only hf_quant_config.json);
- ``generate``: token-id prompts and ``max_tokens``, greedy; ``score``: token-id texts scored with prompt logprobs
  (the negative log-likelihood of each token after the first);
- ``dump``: a safetensors path: every parameter and buffer of the model as vLLM's loader filled them, taken just
  before ``process_weights_after_loading`` (which repacks, requantizes fused shards and folds scales), plus each
  attention layer's ``_k_scale`` / ``_v_scale`` after it (the scales the KV cache is written with);
- ``instrument``: true adds ``instrument`` to the run's JSON (:class:`Counters`): the linear kernel each quantized
  layer selected, the activation casts and ``torch._scaled_mm`` calls per forward, the stand-in's calls at load
  and per forward, and whether the prompt pass reads its keys back from the KV cache.

The CPU build lacks two ops the FP8 paths call; :func:`install_stand_ins` replaces them with plain torch, test-only,
and a request with ``fp8_gemm_in_torch`` runs ``torch._scaled_mm`` through torch's own CPU path where torch would
pick oneDNN's reference FP8 matmul (docs/engines.md lists every line and why). Everything else is vLLM's own code:
its config parsing, its quantization schemes' create_weights / weight loaders / process_weights_after_loading, its
kernels' selection and its model code.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

# In-process engine: its model is reachable for the dump, and no engine-core process is spawned.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the default sizes the cache to the machine
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# "auto" pins vLLM's OpenMP threads to cores; on a machine whose cores other processes share, a pinned thread waits
# for its core: one 6-token scoring pass took 88 s pinned and 11 s unpinned here (load average 20 on 2 cores)
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# enforce_eager leaves two sampler helpers that vLLM compiles with Inductor on any platform (the logprob rank count,
# top-k/top-p): on a fresh machine each driver traced them and g++ built their C++ (docs/engines.md says what it
# cost); eager, the same torch ops run uncompiled
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

E4M3_MAX = 448.0


def scaled_fp8_quant_in_torch(input, scale=None, num_token_padding=None, scale_ub=None,  # noqa: A002 (vLLM's name)
                              use_per_token_if_dynamic=False, output=None, group_shape=None):
    """Stand-in for vllm._custom_ops.scaled_fp8_quant, whose torch.ops._C kernels the CPU build lacks.

    The same contract: a given ``scale`` quantizes statically (x / scale); without one the scale is computed
    dynamically, amax/448 per tensor or per token, floored as vLLM's kernels floor it. Returns (fp8, scale)."""
    import torch

    dtype = torch.float8_e4m3fn
    values = input.float()
    if scale is None:
        if use_per_token_if_dynamic:
            amax = values.abs().amax(dim=-1, keepdim=True)
            if scale_ub is not None:
                amax = amax.clamp(max=scale_ub.float())
            # the CUDA per-token kernel floors the scale at 1 / (448 * 512): an all-zero row divides by something
            scale = (amax / E4M3_MAX).clamp(min=1.0 / (E4M3_MAX * 512.0))
        else:
            scale = values.abs().amax().reshape(1) / E4M3_MAX
        scale = scale.to(torch.float32)
    quantized = (values / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(dtype)
    if num_token_padding is not None and quantized.shape[0] < num_token_padding:
        padded = torch.zeros((num_token_padding, *quantized.shape[1:]), dtype=dtype, device=quantized.device)
        padded[: quantized.shape[0]] = quantized
        quantized = padded
    if output is not None:
        output.copy_(quantized)
        quantized = output
    return quantized, scale


def enable_amx_tiles() -> bool:
    """Ask Linux for the AMX tile registers before vLLM's attention kernels use them; True where the CPU has AMX.

    vLLM's CPU attention picks its ``amx`` kernels on such a CPU (``cpu_attn._get_attn_isa``) but never asks for the
    registers itself: the process gets them only once oneDNN has run an AMX GEMM. A model whose Linears are too
    small for oneDNN's AMX path (the tiny test Llama) then dies of SIGILL at its first attention (the driver exited
    -4). vLLM's own kernel test (tests/kernels/attention/test_cpu_attn.py) calls the same ``torch.cpu._init_amx()``
    at import. Asking changes no arithmetic: the kernels are the ones a large model runs."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


def install_stand_ins() -> list[str]:
    """The two test-only replacements; returns what each one replaced."""
    import vllm._custom_ops as custom_ops

    replaced = []
    custom_ops.scaled_fp8_quant = scaled_fp8_quant_in_torch
    replaced.append("vllm._custom_ops.scaled_fp8_quant")
    # (w8a8_utils, which requantizes fused q/k/v shards to one per-tensor scale, calls it as ops.scaled_fp8_quant:
    # the module attribute, so this one assignment covers it)
    # The fused SiLU-and-FP8-quant op is CUDA-only; with its registry empty the model runs SiLU, then the quant op.
    from vllm.model_executor.layers.fusion import fused_act_quant

    fused_act_quant._FUSED_ACT_QUANT.clear()
    replaced.append("vllm.model_executor.layers.fusion.fused_act_quant._FUSED_ACT_QUANT")
    # vLLM's own emulation kernels for MXFP8 and NVFP4 (dequantize to bf16, then a bf16 GEMM; their is_supported
    # says "always available") are listed for CUDA/ROCm/XPU only: listed for the CPU too, vLLM's own schemes,
    # weight loaders, process_weights_after_loading and model code run on these exports. Appended, so a real CPU
    # kernel, if a later build has one, still comes first.
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum

    register_linear_kernel(EmulationMxfp8LinearKernel, PlatformEnum.CPU, "mxfp8")
    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    replaced += ["kernels.linear._POSSIBLE_MXFP8_KERNELS[CPU] += EmulationMxfp8LinearKernel",
                 "kernels.linear._POSSIBLE_NVFP4_KERNELS[CPU] += EmulationNvFp4LinearKernel"]
    return replaced


def project_module(path: str):
    """A module of the project that imports torch only, loaded from its file: the project's packages are not
    installed in vLLM's venv (their ``__init__`` would import torchao and the rest)."""
    import importlib.util
    from pathlib import Path

    file = Path(__file__).resolve().parents[2] / path
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def linear_kernels(model) -> dict[str, int]:
    """The linear kernel class each quantized layer of the loaded ``model`` selected, counted by class name."""
    kernels: dict[str, int] = {}
    for module in model.modules():
        for holder in filter(None, [getattr(module, "quant_method", None), getattr(module, "scheme", None)]):
            for value in vars(holder).values():
                if type(value).__name__.endswith("Kernel"):
                    kernels[type(value).__name__] = kernels.get(type(value).__name__, 0) + 1
    return kernels


class Counters:
    """What the FP8 Linears execute, counted by wrapping the functions they call (installed before the engine is
    built: a CustomOp binds its forward when it is created). Test-only, like the stand-ins."""

    def __init__(self) -> None:
        self.phase = "load"
        self.calls: dict[str, dict[str, int]] = {"load": {}, "score": {}}
        self.forwards = 0
        self.kernels: dict[str, int] = {}
        self._undo: list = []

    def _count(self, key: str) -> None:
        table = self.calls[self.phase]
        table[key] = table.get(key, 0) + 1

    def install(self) -> None:
        import torch
        import vllm._custom_ops as custom_ops
        from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8

        stand_in, native, scaled_mm = custom_ops.scaled_fp8_quant, QuantFP8.forward_native, torch._scaled_mm

        def counted_stand_in(input, scale=None, *args, **kwargs):  # noqa: A002 (vLLM's name)
            per_token = kwargs.get("use_per_token_if_dynamic", False)
            self._count(f"scaled_fp8_quant stand-in ({'static' if scale is not None else 'dynamic'}"
                        f"{', per token' if per_token and scale is None else ''}, {input.dtype})")
            return stand_in(input, scale, *args, **kwargs)

        def counted_native(quant, x, scale=None, *args, **kwargs):
            kind = "static per-tensor" if quant.static else f"dynamic {quant.group_shape}"
            self._count(f"QuantFP8.forward_native ({kind}, input {x.dtype})")
            return native(quant, x, scale, *args, **kwargs)

        def counted_scaled_mm(a, b, *args, **kwargs):
            scale_a = kwargs.get("scale_a")
            self._count(f"torch._scaled_mm ({a.dtype} x {b.dtype} -> {kwargs.get('out_dtype')}, scale_a "
                        f"{tuple(scale_a.shape) if scale_a is not None else None})")
            return scaled_mm(a, b, *args, **kwargs)

        custom_ops.scaled_fp8_quant, QuantFP8.forward_native, torch._scaled_mm = \
            counted_stand_in, counted_native, counted_scaled_mm
        self._undo = [(custom_ops, "scaled_fp8_quant", stand_in), (QuantFP8, "forward_native", native),
                      (torch, "_scaled_mm", scaled_mm)]

    def loaded(self, model) -> None:
        """After the load: the kernel class each quantized layer selected; then count per scoring forward."""
        self.kernels = linear_kernels(model)
        original = model.forward

        def counted_forward(*args, **kwargs):
            self.forwards += 1
            return original(*args, **kwargs)

        model.forward = counted_forward
        self.phase = "score"

    def uninstall(self) -> None:
        for owner, name, value in self._undo:
            setattr(owner, name, value)

    def report(self) -> dict:
        forwards = max(self.forwards, 1)
        return {"kernels": self.kernels, "at_load": self.calls["load"], "scoring_forwards": self.forwards,
                "per_forward": {key: count / forwards for key, count in self.calls["score"].items()}}


def prefill_reads_cache(llm, texts: list[list[int]], scores: list[dict], score) -> dict:
    """Score ``texts`` again with every key written to the KV cache halved: if the prompt pass attends over what it
    wrote to the cache (not over the K/V tensors it computed), its log-likelihoods change."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    original = CPUAttentionBackendImpl.do_kv_cache_update

    def halved_keys(self, layer, key, value, kv_cache, slot_mapping):
        return original(self, layer, key * 0.5, value, kv_cache, slot_mapping)

    CPUAttentionBackendImpl.do_kv_cache_update = halved_keys
    try:
        again = score(llm, texts)
    finally:
        CPUAttentionBackendImpl.do_kv_cache_update = original
    change = max(abs(a - b) for first, second in zip(scores, again, strict=True)
                 for a, b in zip(first["per_token"], second["per_token"], strict=True))
    return {"prefill_reads_cache": change > 1e-3, "nll_change_with_halved_cached_keys": change}


def loaded_model(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


#: where the next load's snapshot goes (None: no dump asked for)
_snapshot_into: list[dict | None] = [None]


def snapshot_before_processing() -> None:
    """Wrap vLLM's process_weights_after_loading so the dump sees the parameters exactly as the loader filled them."""
    from vllm.model_executor.model_loader import base_loader, utils

    original = utils.process_weights_after_loading

    def snapshot_then_process(model, *args, **kwargs):
        store = _snapshot_into[0]
        if store is not None:
            store.update({name: tensor.detach().to("cpu").clone() for name, tensor in model.state_dict().items()})
        return original(model, *args, **kwargs)

    utils.process_weights_after_loading = snapshot_then_process
    if hasattr(base_loader, "process_weights_after_loading"):
        base_loader.process_weights_after_loading = snapshot_then_process


def attention_scales(model) -> dict[str, dict[str, float]]:
    found = {}
    for name, module in model.named_modules():
        if hasattr(module, "_k_scale") and hasattr(module, "_v_scale"):
            found[name] = {"k_scale": float(module._k_scale.float().reshape(-1)[0]),
                           "v_scale": float(module._v_scale.float().reshape(-1)[0]),
                           "kv_cache_dtype": str(getattr(module, "kv_cache_dtype", "?"))}
    return found


def score_texts(llm, texts: list[list[int]]) -> list[dict]:
    """Each token-id text's negative log-likelihood (of every token after the first) from prompt logprobs."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in texts], params, use_tqdm=False)
    scores = []
    for ids, output in zip(texts, outputs, strict=True):
        # prompt_logprobs[0] is None (nothing predicts the first token); with prompt_logprobs=0 each entry holds the
        # prompt's own token
        pairs = zip(ids[1:], output.prompt_logprobs[1:], strict=True)
        nll = [-logprobs[token].logprob for token, logprobs in pairs]
        scores.append({"nll": sum(nll), "tokens": len(ids) - 1, "per_token": nll})
    return scores


def run_one(request: dict) -> dict:
    """Build the engine for one model, generate, score and dump; the engine is torn down before returning."""
    from vllm import LLM, SamplingParams

    store: dict = {}
    _snapshot_into[0] = store if request.get("dump") else None
    counters = None
    if request.get("instrument"):
        counters = Counters()
        counters.install()
    kwargs = dict(model=request["model"], dtype="bfloat16", enforce_eager=True, distributed_executor_backend="uni",
                  kv_cache_dtype=request.get("kv_cache_dtype", "auto"), skip_tokenizer_init=True,
                  compilation_config={"custom_ops": ["none"]}, max_model_len=request.get("max_model_len"), seed=0)
    if request.get("quantization"):
        kwargs["quantization"] = request["quantization"]
    started, cpu_started = time.perf_counter(), time.process_time()
    llm = LLM(**kwargs)
    seconds = {"load": time.perf_counter() - started}
    # the process's CPU seconds per phase, all threads: on a shared machine wall time says little
    cpu_seconds = {"load": time.process_time() - cpu_started}
    model = loaded_model(llm)
    if counters is not None:
        counters.loaded(model)
    result: dict = {"model": request["model"], "kv_cache_dtype": kwargs["kv_cache_dtype"],
                    "kernels": linear_kernels(model)}
    generate = request.get("generate")
    if generate:
        params = SamplingParams(temperature=0.0, max_tokens=generate["max_tokens"], ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in generate["prompt_token_ids"]], params,
                               use_tqdm=False)
        result["generated"] = [list(output.outputs[0].token_ids) for output in outputs]
        seconds["generate"] = time.perf_counter() - started - sum(seconds.values())
        cpu_seconds["generate"] = time.process_time() - cpu_started - sum(cpu_seconds.values())
    texts = request.get("score")
    if texts:
        scores = score_texts(llm, texts)
        result["scores"] = scores
        total = sum(score["tokens"] for score in scores)
        result["perplexity"] = math.exp(sum(score["nll"] for score in scores) / total)
        seconds["score"] = time.perf_counter() - started - sum(seconds.values())
        cpu_seconds["score"] = time.process_time() - cpu_started - sum(cpu_seconds.values())
    if counters is not None and texts:
        result["instrument"] = {**counters.report(), **prefill_reads_cache(llm, texts[:1], scores[:1], score_texts)}
        counters.uninstall()
    if request.get("dump"):
        save_dump(store, request["dump"])
        result["dump"] = request["dump"]
    result["attention"] = attention_scales(model)
    result["quant_methods"] = sorted({type(module.quant_method).__name__ for module in model.modules()
                                      if getattr(module, "quant_method", None) is not None})
    result["seconds"], result["cpu_seconds"] = seconds, cpu_seconds
    del model, llm
    release_engine()
    return result


def save_dump(store: dict, path: str) -> None:
    """The loaders' snapshot (:func:`snapshot_before_processing`) as one safetensors file."""
    from safetensors.torch import save_file

    save_file({name: tensor.contiguous() for name, tensor in store.items()}, path)


def release_engine() -> None:
    """Free vLLM's process-wide distributed state and memory, so that the next run builds its engine afresh. An
    engine that shut down has done it already (its shutdown runs the same cleanup, which ends in a full garbage
    collection); one that failed while it was built has not."""
    import torch
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory, model_parallel_is_initialized

    if torch.distributed.is_initialized() or model_parallel_is_initialized():
        cleanup_dist_env_and_memory()
    freeze_what_lives()


def inspect_models_in_process() -> None:
    """vLLM reads a model class's capabilities (its ``_ModelInfo``) in a subprocess when its on-disk cache
    (``~/.cache/vllm/modelinfos``) has no entry for the class's file, "to avoid initializing CUDA" in the engine's
    process: on a fresh machine, one more Python importing vLLM per architecture. The CPU build has no CUDA to keep
    uninitialised, and the engine imports the same model module right after, so the same function runs in this
    process instead (its result still goes to that cache). docs/engines.md has what it saved."""
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda inspect: inspect()


def freeze_what_lives() -> None:
    """Put every object alive now (the imports; what outlived a released engine) out of the cyclic collector's
    reach (``gc.freeze``) until vLLM thaws them (``gc.unfreeze`` when it shuts an engine down). Building an engine,
    vLLM collects the whole heap several times (its loader, its warm-up, ``freeze_gc_heap``), and each full
    collection walked the 0.6 million objects of vLLM's import again; frozen, they are skipped. Garbage made
    afterwards is collected as before; a garbage cycle frozen with them (the engine's shutdown ended in a full
    collection, so little) waits for the next thaw, at the next engine's shutdown. docs/engines.md has what it
    saved."""
    import gc

    gc.freeze()


def attend_through_cache(case: dict) -> dict:
    """vLLM's CPU attention alone, as ``CPUAttentionBackendImpl`` calls it for one causal prompt: ``key`` and
    ``value`` (``[tokens, kv_heads, head_dim]``, from the safetensors file ``case["tensors"]``) written to a paged
    cache by ``cpu_attn_reshape_and_cache`` with ``k_scale`` / ``v_scale`` and ``kv_cache_dtype``, then
    ``cpu_attention_with_kv_cache`` over that cache for ``query``; the output goes to ``case["out"]``. ``isa``:
    the kernel family (``amx``, ``vec``), as ``cpu_attn._get_attn_isa`` would pick it on this CPU or another."""
    import torch
    from safetensors.torch import load_file, save_file
    from vllm import _custom_ops as ops

    tensors = load_file(case["tensors"])
    query, key, value = tensors["query"], tensors["key"], tensors["value"]
    tokens, kv_heads, head_dim = key.shape
    isa, block_size, kv_dtype = case["isa"], 128, case["kv_cache_dtype"]
    blocks = -(-tokens // block_size)
    cache_dtype = torch.uint8 if kv_dtype.startswith("fp8") else query.dtype
    cache = torch.zeros(blocks, kv_heads, block_size * 2, head_dim, dtype=cache_dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    scales = {"k_scale": case["k_scale"], "v_scale": case["v_scale"], "kv_cache_dtype": kv_dtype}
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(tokens), isa, **scales)
    starts, lengths = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(1, query.shape[1], kv_heads, head_dim, lengths, query.dtype,
                                                   starts, True, -1, isa, False, kv_cache_dtype=kv_dtype)
    output = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, output, starts, lengths, head_dim ** -0.5, True,
                                    None, -1, torch.arange(blocks, dtype=torch.int32)[None], 0, metadata, None,
                                    **scales)
    save_file({"output": output}, case["out"])
    return {"out": case["out"]}


def set_up(asked: dict) -> list[str]:
    """What every run of this process shares, done once: the stand-ins (returned: what each replaced), AMX tiles,
    models inspected in process, the imports frozen. ``stacks_every_s``: every thread's Python stack written to
    stderr at that interval (a stalled run shows where it is)."""
    if asked.get("stacks_every_s"):
        # where a slow run spends its time, without a profiler in the vLLM venv: every thread's stack to stderr
        import faulthandler

        faulthandler.dump_traceback_later(asked["stacks_every_s"], repeat=True, file=sys.stderr)
    stand_ins = install_stand_ins()
    if asked.get("fp8_gemm_in_torch"):  # stand-in 4 (docs/engines.md): the engine tests ask for it, the benchmark not
        stand_ins += filter(None, [project_module("converters/backends/cpu_fp8_gemm.py").install()])
    enable_amx_tiles()
    inspect_models_in_process()
    snapshot_before_processing()
    freeze_what_lives()
    return stand_ins


def answer(asked: dict, stand_ins: list[str]) -> dict:
    """Runs every request of ``{"runs": [...], "attention": [...]}``; a run that raises is reported with its error
    and the next one goes on. ``attention``: cases for :func:`attend_through_cache`, reported as ``"attention"``."""
    runs = asked.get("runs", [])
    attention = [attend_through_cache(case) for case in asked.get("attention", [])]
    results = []
    for index, request in enumerate(runs):
        # which run a stack dump or a slow log belongs to
        print(f"vllm_driver: run {index + 1}/{len(runs)}: {request['model']} kv_cache_dtype="
              f"{request.get('kv_cache_dtype', 'auto')}", file=sys.stderr, flush=True)
        try:
            results.append(run_one(request))
        except Exception as exc:  # noqa: BLE001 (the caller asserts on it: the message is what it needs)
            import traceback

            failed = {"model": request["model"], "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(limit=8)}
            loaded = _snapshot_into[0]
            if loaded:  # it failed after the loaders had filled every parameter: what they filled is still checkable
                save_dump(loaded, request["dump"])
                failed["dump"] = request["dump"]
            results.append(failed)
            # a run that failed while building its engine leaves vLLM's process-wide distributed state behind: the
            # next run's engine would find it half set up ("tensor model parallel group is not initialized")
            release_engine()
    return {"stand_ins": stand_ins, "runs": results, "attention": attention}


def serve() -> None:
    """The path of a request file per line of stdin, the answer to each a line of stdout, until stdin closes: one
    process, so one import of vLLM (most of a minute on a busy 2-core machine), for every request. The first request
    sets the process up (:func:`set_up`); a later one that asks for another set-up is refused. Anything else this
    process prints goes to stderr: stdout carries the answers alone."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    set_up_by: dict | None = None
    stand_ins: list[str] = []
    for line in sys.stdin:
        asked = json.loads(open(line.strip(), encoding="utf-8").read())
        shared = {key: asked.get(key) for key in ("fp8_gemm_in_torch", "stacks_every_s")}
        if set_up_by is None:
            set_up_by, stand_ins = shared, set_up(asked)
        if shared != set_up_by:
            reply = {"error": f"this process was set up for {set_up_by}; the request asks for {shared}"}
        else:
            reply = answer(asked, stand_ins)
        answers.write(json.dumps(reply) + "\n")
        answers.flush()


if __name__ == "__main__":  # vLLM's engine may spawn: the guard keeps a child from re-running the driver
    serve()
