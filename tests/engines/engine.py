"""vLLM's CPU build as a reader of fp8forge's exports: run it (in its own venv, through vllm_driver.py) and compare
what it loaded with the files and with the source.

Shared by tests/engines/ and benchmarks/bench_engine.py. The vLLM venv is never a project dependency:
``make vllm-venv`` builds it at .venv-vllm (VLLM_VENV overrides the path).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

__all__ = ["ROOT", "AMX", "KV_CACHE", "VLLM_VENV", "VLLM_PYTHON", "DRIVER", "vllm_missing", "run_vllm",
           "attend_in_vllm", "one_driver", "EngineRun", "load_problems", "fidelity_problems"]

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / os.environ.get("VLLM_VENV", ".venv-vllm")  # a relative path is the repository's
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
DRIVER = Path(__file__).with_name("vllm_driver.py")
#: the KV cache an export with KV scales runs with: vLLM's CPU attention stores an FP8 cache only on x86 with AVX-512
#: or AMX (``cpu_attn._get_attn_isa``: "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"; its AVX2 kernels have
#: no FP8 cache case). On an AVX2-only CPU the exports run with a bf16 cache: their KV scales are loaded, unused.
KV_CACHE = "fp8" if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported() else "bfloat16"
#: vLLM's CPU build has FP8 block kernels only with AMX tiles (``CPUFp8BlockScaledMMKernel``, W8A16: "requires AMX tile
#: support (Sapphire Rapids or newer)"; its W8A8 sibling also needs AMX-FP8): fp8-block runs in it on such a CPU alone
AMX = torch.cpu._is_amx_tile_supported()
#: vLLM's Llama-family fused layers: checkpoint projection -> (vLLM's fused module, shard index)
PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
#: a routed expert's projection in a checkpoint -> (the stacked parameter vLLM's FusedMoE holds every expert of the
#: layer in, ``[experts, rows, ...]``, and the projection's shard of it): gate and up stacked as w13
EXPERT_SHARDS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0),
                 "w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}
_EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>\w+)\.(?P<rest>\w+)$")
_STACKED = re.compile(r"^(?P<experts>.+\.experts)(\.\w+)*\.(?P<kind>w13|w2)_weight$")
#: vLLM's Qwen2-MoE registers its shared expert twice: as ``mlp.shared_expert`` (the checkpoint's name, checked) and
#: inside its fused MoE as ``mlp.experts._shared_experts._layer`` (the same module, no checkpoint name of its own)
VLLM_ALIAS = "._shared_experts._layer."
#: KV-cache scale names in a checkpoint (compressed-tensors', then ModelOpt's) -> vLLM's attention parameter
KV_NAMES = {".self_attn.k_scale": ".self_attn.attn.k_scale", ".self_attn.v_scale": ".self_attn.attn.v_scale",
            ".self_attn.k_proj.k_scale": ".self_attn.attn.k_scale",
            ".self_attn.v_proj.v_scale": ".self_attn.attn.v_scale"}
#: the largest relative (Frobenius) error of a weight as vLLM multiplies it (FP8 values x scales) against the
#: source's: E4M3 rounds to 3 mantissa bits (relative step 2^-4 at most, ~2-3% RMS on real and random weights);
#: a scale off by 2x is 100%
MAX_WEIGHT_ERROR = 0.08
MX_BLOCK = 32  #: elements per MXFP8 scale


def vllm_missing() -> str | None:
    """Why the engine cannot run here, or None."""
    # the Makefile's stamp, written once `import vllm` worked: a build that failed half-way leaves bin/python
    if not VLLM_PYTHON.exists() or not any(VLLM_VENV.glob(".installed-*")):
        log = os.environ.get("VLLM_BUILD_LOG")
        built = f"its build failed: see {log}" if log else "`make vllm-venv` builds it"
        return f"vLLM's CPU build is not installed at {VLLM_VENV}: {built}"
    return None


@dataclass
class EngineRun:
    """What one vLLM run did (vllm_driver.py's JSON for it)."""

    raw: dict[str, Any]

    @property
    def error(self) -> str | None:
        return self.raw.get("error")

    @property
    def perplexity(self) -> float:
        return self.raw["perplexity"]

    @property
    def kernels(self) -> dict[str, int]:
        """The linear kernel class each quantized layer selected (class name -> layers)."""
        return self.raw["kernels"]

    @property
    def generated(self) -> list[list[int]]:
        return self.raw["generated"]

    @property
    def attention(self) -> dict[str, dict[str, Any]]:
        return self.raw["attention"]

    def loaded(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer as vLLM's loader filled them (before process_weights_after_loading)."""
        with safe_open(self.raw["dump"], "pt") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}


@dataclass
class EngineRequest:
    model: Path
    kv_cache_dtype: str = "auto"
    generate: list[list[int]] = field(default_factory=list)
    max_tokens: int = 8
    score: list[list[int]] = field(default_factory=list)
    dump: bool = True


def run_vllm(requests: list[EngineRequest], work: Path, *, timeout: float = 1800) -> list[EngineRun]:
    """Run every request in one vLLM process (its import dominates a small run); raises with vLLM's stderr when
    the process itself fails (a run that raises is reported in its EngineRun.error instead)."""
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    for index, request in enumerate(requests):
        run: dict[str, Any] = {"model": str(request.model), "kv_cache_dtype": request.kv_cache_dtype}
        if request.generate:
            run["generate"] = {"prompt_token_ids": request.generate, "max_tokens": request.max_tokens}
        if request.score:
            run["score"] = request.score
        if request.dump:
            run["dump"] = str(work / f"loaded-{index}.safetensors")
        runs.append(run)
    return [EngineRun(raw) for raw in _drive({"runs": runs}, work, timeout)["runs"]]


def attend_in_vllm(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                   cases: dict[str, tuple[float, float, tuple[str, ...]]], work: Path, kv_cache_dtype: str = "fp8"
                   ) -> dict[tuple[str, str], torch.Tensor]:
    """vLLM's CPU attention kernels over one causal prompt whose keys and values went through its KV cache
    (``vllm_driver.attend_through_cache``), every case in one vLLM process (its import is most of the cost):
    ``cases``: name -> (k_scale, v_scale, the kernel families to run); returns (name, isa) -> output. Tensors are
    ``[tokens, heads, head_dim]``."""
    from safetensors.torch import load_file, save_file

    work.mkdir(parents=True, exist_ok=True)
    inputs = work / "attention-in.safetensors"
    save_file({"query": query.contiguous(), "key": key.contiguous(), "value": value.contiguous()}, inputs)
    runs = {(name, isa): {"tensors": str(inputs), "out": str(work / f"attention-{name}-{isa}.safetensors"), "isa": isa,
                          "k_scale": k_scale, "v_scale": v_scale, "kv_cache_dtype": kv_cache_dtype}
            for name, (k_scale, v_scale, isas) in cases.items() for isa in isas}
    _drive({"attention": list(runs.values())}, work, 600)
    return {key: load_file(run["out"])["output"] for key, run in runs.items()}


def _drive(payload: dict, work: Path, timeout: float) -> dict:
    """:func:`ask_vllm` as the engine tests ask: with torch's FP8 GEMM (stand-in 4, docs/engines.md). Raises with
    vLLM's stderr when the process fails or refuses the request."""
    # fp8_gemm_in_torch: an FP8 GEMM's result, not oneDNN's reference kernel (converters/backends/cpu_fp8_gemm.py)
    replied = json.loads(ask_vllm({**payload, "fp8_gemm_in_torch": True}, work, timeout))
    if "error" in replied:  # the whole request refused (a run's own failure is in its run)
        raise RuntimeError(f"vllm_driver.py refused the request: {replied['error']}")
    return replied


def ask_vllm(payload: dict, work: Path, timeout: float | None) -> str:
    """vllm_driver.py's JSON answer to ``payload``: from the process :func:`one_driver` keeps, inside one, else from
    a process started for it (the benchmarks' way). Raises with vLLM's stderr when the process fails; its stderr for
    this payload is left in ``work/vllm.log``, its answer in ``work/answer.json``."""
    if not _kept:
        with one_driver(work / "vllm-driver.log"):
            return ask_vllm(payload, work, timeout)
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=work, delete=False) as handle:
        json.dump(payload, handle)
    answer = _kept[0].ask(Path(handle.name), work / "vllm.log", timeout)
    (work / "answer.json").write_text(answer)  # what the engine said, kept beside its log for a failed assertion
    return answer


class _Driver:
    """``vllm_driver.py``: one vLLM process answering request after request, started at the first (a
    session that skips every engine test starts none) and again after one ended; its stderr goes to ``log``."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.process: subprocess.Popen | None = None

    def ask(self, request: Path, log: Path, timeout: float | None) -> str:
        """The answer to the request file ``request``; what the process wrote to stderr meanwhile is copied to
        ``log``. A process that ends or overruns ``timeout`` (None: no limit) raises (and is gone: the next ask starts
        another)."""
        if self.process is None or self.process.poll() is not None:
            with self.log.open("ab") as stderr:
                self.process = subprocess.Popen([str(VLLM_PYTHON), str(DRIVER)], stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=self.log.parent)
        start, timed_out, answer = self.log.stat().st_size, False, ""
        try:
            self.process.stdin.write(f"{request}\n")
            self.process.stdin.flush()
            timed_out = not select.select([self.process.stdout], [], [], timeout)[0]
            answer = "" if timed_out else self.process.stdout.readline()
        except BrokenPipeError:  # it had ended
            pass
        if not answer:
            self.close(kill=timed_out)
        with self.log.open("rb") as whole:
            whole.seek(start)
            log.write_bytes(whole.read())
        if not answer:
            ended = f"did not answer within {timeout:.0f} s" if timed_out else f"exited {self.process.returncode}"
            raise RuntimeError(f"vllm_driver.py {ended}; its log: {log}\n{log.read_text()[-4000:]}")
        return answer

    def close(self, *, kill: bool = False) -> None:
        """End the process: its loop ends with its stdin (``kill``: at once); one still running a minute later is
        killed."""
        if self.process is None or self.process.poll() is not None:
            return
        if kill:
            self.process.kill()
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_kept: list[_Driver] = []


@contextlib.contextmanager
def one_driver(log: Path) -> Iterator[None]:
    """Inside it, every request goes to one vllm_driver.py process (:class:`_Driver`), ended with the context:
    vLLM's import, most of a small module's engine time, once for all of them. Its stderr goes to ``log``."""
    _kept.append(_Driver(log))
    try:
        yield
    finally:
        _kept.pop().close()


def file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's safetensors files, by name."""
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def _same(loaded: torch.Tensor, written: torch.Tensor, *, bf16_rounding: bool = False) -> bool:
    """Equal values (FP8 compared bit for bit); ``bf16_rounding``: a float32 value held in bf16 counts as equal."""
    if loaded.dtype == torch.float8_e4m3fn or written.dtype == torch.float8_e4m3fn:
        return loaded.dtype == written.dtype and torch.equal(loaded.view(torch.uint8), written.view(torch.uint8))
    loaded, written = loaded.float().reshape(-1), written.float().reshape(-1)
    if loaded.shape != written.shape:
        return False
    return torch.equal(loaded, written) or (bf16_rounding and torch.equal(loaded, written.bfloat16().float()))


def _target(name: str, written: dict[str, torch.Tensor]) -> tuple[str, int | None, slice | None]:
    """The vLLM parameter a checkpoint tensor loads into: (name, per-tensor shard index, row slice)."""
    for suffix, vllm_suffix in KV_NAMES.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix) + vllm_suffix, None, None
    prefix, _, rest = name.rpartition(".")
    module_prefix, _, projection = prefix.rpartition(".")
    if projection not in PACKED:
        return name, None, None
    fused, shard = PACKED[projection]
    tensor = written[name]
    target = f"{module_prefix}.{fused}.{rest}"
    if tensor.numel() == 1:  # a per-tensor scale: one element per shard
        return target, shard, None
    # the shards' rows of this tensor, stacked: output features for weights (packed NVFP4 included) and per-channel
    # or MX scales, blocks of output features for block scales (weight_scale_inv)
    rows = [written[f"{module_prefix}.{sibling}.{rest}"].shape[0] for sibling in SHARDS[fused]]
    start = sum(rows[:shard])
    return target, None, slice(start, start + rows[shard])


def _loaded_part(name: str, written: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]
                 ) -> tuple[str, torch.Tensor | None]:
    """The vLLM parameter the checkpoint tensor ``name`` loads into, and the part of it that holds the tensor (None:
    no such parameter)."""
    expert = _EXPERT_TENSOR.match(name)
    if expert and expert["projection"] in EXPERT_SHARDS:
        return _expert_part(name, expert, written, loaded)
    target, shard, rows = _target(name, written)
    if target not in loaded:
        return target, None
    value = loaded[target]
    if shard is not None:
        return target, value.reshape(-1)[shard]
    return target, value if rows is None else value[rows]


def _expert_part(name: str, expert: re.Match, written: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]
                 ) -> tuple[str, torch.Tensor | None]:
    """A routed expert's tensor in vLLM's stacked parameter: its expert's slice, then its shard's rows (a weight,
    per-channel or MX scales) or element (a per-tensor weight scale). vLLM keeps one input scale per expert for gate
    and up together (its loader refuses two that differ), so a per-tensor input scale is that expert's one."""
    kind, shard = EXPERT_SHARDS[expert["projection"]]
    suffix = f".{kind}_{expert['rest']}"
    target = next((key for key in loaded if key.startswith(f"{expert['experts']}.") and key.endswith(suffix)),
                  expert["experts"] + suffix)
    if target not in loaded:
        return target, None
    value = loaded[target][int(expert["expert"])]
    if written[name].numel() == 1:
        return target, value.reshape(-1)[shard] if value.numel() > 1 else value
    prefix = name.removesuffix(f"{expert['projection']}.{expert['rest']}")
    rows = {index: written[f"{prefix}{projection}.{expert['rest']}"].shape[0]
            for projection, (stacked, index) in EXPERT_SHARDS.items()
            if stacked == kind and f"{prefix}{projection}.{expert['rest']}" in written}
    start = sum(rows[index] for index in range(shard))
    return target, value[start:start + rows[shard]]


def load_problems(directory: Path, run: EngineRun) -> list[str]:
    """What vLLM did not load as written: a checkpoint tensor that reached no parameter or a different value, and,
    with an FP8 KV cache, an attention layer whose scales did not come from the file. A run that stopped after
    vLLM's loaders had filled the model (no CPU kernel for the scheme) is checked on what they filled, its KV
    scales as its attention layers' parameters."""
    if run.error and "dump" not in run.raw:
        return [f"vLLM failed to run {directory.name}: {run.error}"]
    written, loaded = file_tensors(directory), run.loaded()
    problems = []
    kv_written: dict[str, float] = {}
    for name, tensor in written.items():
        target, value = _loaded_part(name, written, loaded)
        if value is None:
            problems.append(f"{name} reaches no vLLM parameter ({target} does not exist): vLLM drops it")
            continue
        kv = target.endswith((".attn.k_scale", ".attn.v_scale"))
        if kv:
            kv_written[target] = float(tensor.float().reshape(-1)[0])
        # vLLM holds KV scales in float32; ModelOpt writes float32 ones and vLLM may round them through bf16
        if not _same(value, tensor, bf16_rounding=kv):
            problems.append(f"{name}: vLLM's {target} holds other values than the file")
    if run.raw.get("kv_cache_dtype") == "fp8" and not run.error:
        for layer, scales in run.attention.items():
            for kind in ("k_scale", "v_scale"):
                expected = kv_written.get(f"{layer}.{kind}")
                if expected is None:
                    problems.append(f"{layer} runs its FP8 KV cache with {kind} {scales[kind]} that no tensor of the "
                                    "file gave it")
                elif scales[kind] not in (expected, float(torch.tensor(expected).bfloat16())):
                    problems.append(f"{layer} runs its FP8 KV cache with {kind} {scales[kind]}, the file says "
                                    f"{expected}")
    return problems


def _shard_scale(scale: torch.Tensor, shards: int, index: int, start: int, rows: int,
                 block: tuple[int, int] | None = None) -> torch.Tensor:
    """One shard's scale, broadcastable over its [rows, in] FP8 values: per tensor (one per shard, or one for the
    layer), per channel ([out, 1]), MX blocks of 32 (uint8 E8M0 exponents, [out, in/32], expanded) or, with
    ``block`` (rows, columns), FP8 blocks ([ceil(out / rows), ceil(in / columns)], expanded)."""
    if block is not None:
        expanded = scale.float().repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
        return expanded[start:start + rows]
    if scale.dtype == torch.uint8:
        return torch.exp2(scale[start:start + rows].float() - 127).repeat_interleave(MX_BLOCK, dim=1)
    scale = scale.float()
    if scale.numel() == shards:
        return scale.reshape(-1)[index]
    if scale.numel() == 1:
        return scale.reshape(-1)[0]
    return scale.reshape(-1, 1)[start:start + rows]


def fidelity_problems(source: Path, run: EngineRun) -> list[str]:
    """Each FP8 weight as vLLM multiplies it (its loaded FP8 values times its loaded scale) against the source's
    bf16 weight: a relative error above MAX_WEIGHT_ERROR is a wrong scale or wrong values. FP4 (packed uint8)
    weights are not dequantized here: their load check alone covers them."""
    if run.error and "dump" not in run.raw:
        return [f"vLLM failed to run: {run.error}"]
    original, loaded = file_tensors(source), run.loaded()
    config = json.loads((Path(run.raw["model"]) / "config.json").read_text())
    block = config.get("quantization_config", {}).get("weight_block_size")  # fp8-block: scales per block
    problems = []
    for name, weight in loaded.items():
        stacked = _STACKED.match(name)
        if weight.dtype == torch.float8_e4m3fn and stacked:
            problems += _expert_fidelity(stacked, weight, loaded, original)
        if weight.dtype != torch.float8_e4m3fn or not name.endswith(".weight") or VLLM_ALIAS in name:
            continue
        module = name.removesuffix(".weight")
        prefix, _, fused = module.rpartition(".")
        shards = SHARDS.get(fused, (fused,))
        scale = loaded[f"{module}.weight_scale_inv" if block else f"{module}.weight_scale"]
        start = 0
        for index, shard in enumerate(shards):
            expected = original[f"{prefix}.{shard}.weight"].float()
            rows = expected.shape[0]
            values = weight[start:start + rows].float()
            shard_scale = _shard_scale(scale, len(shards), index, start, rows, tuple(block) if block else None)
            if block:
                shard_scale = shard_scale[:, :values.shape[1]]
            error = float((values * shard_scale - expected).norm() / expected.norm().clamp(min=1e-12))
            if error > MAX_WEIGHT_ERROR:
                problems.append(f"{prefix}.{shard}: the weight vLLM multiplies is {error:.0%} off the source's")
            start += rows
    return problems


def _expert_fidelity(stacked: re.Match, weight: torch.Tensor, loaded: dict[str, torch.Tensor],
                     original: dict[str, torch.Tensor]) -> list[str]:
    """:func:`fidelity_problems` for one of vLLM's stacked expert weights (``[experts, rows, in]``, gate and up
    stacked in w13): each expert's shards against the source's per-expert weights."""
    experts, kind = stacked["experts"], stacked["kind"]
    scales = loaded[stacked.string.removesuffix("weight") + "weight_scale"]
    problems = []
    for expert in range(weight.shape[0]):
        shards = [projection for index in (0, 1) for projection, (into, at) in EXPERT_SHARDS.items()
                  if into == kind and at == index and f"{experts}.{expert}.{projection}.weight" in original]
        if len(shards) != (2 if kind == "w13" else 1):
            problems.append(f"{experts}.{expert}: the source has no {kind} weights of that expert to compare")
            continue
        start = 0
        for index, shard in enumerate(shards):
            expected = original[f"{experts}.{expert}.{shard}.weight"].float()
            rows = expected.shape[0]
            values = weight[expert, start:start + rows].float()
            scale = _shard_scale(scales[expert], len(shards), index, start, rows)
            error = float((values * scale - expected).norm() / expected.norm().clamp(min=1e-12))
            if error > MAX_WEIGHT_ERROR:
                problems.append(f"{experts}.{expert}.{shard}: the weight vLLM multiplies is {error:.0%} off the "
                                "source's")
            start += rows
    return problems
