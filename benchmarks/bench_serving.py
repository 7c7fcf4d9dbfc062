"""fp8forge's compressed-tensors static FP8 export beside llm-compressor's `oneshot` FP8: same models, same tokens.

What is measured: for Llama-shaped models of two sizes (about 0.5B and 1B parameters; hidden 2048, intermediate
8192, 16 heads, 8 KV heads, vocab 32000, untied head; only the depth differs, as in bench_scale.py's family),
each tool writes a compressed-tensors `float-quantized` checkpoint with static per-tensor FP8 weights and
activations (llm-compressor's `FP8` scheme) of every decoder Linear, lm_head left in bf16:
  fp8forge   run_conversion(backend "ao", skip_first_last off, exclude lm_head, serving format
             "compressed-tensors-fp8"). Its timed work also writes the ao artifact (a copy of the bf16 weights
             plus the FP8 state) next to the serving export: fp8forge always writes both, so both are counted.
  peer       llm-compressor 0.14.0.1 in its own virtualenv (never a project dependency; the script installs it):
             AutoModelForCausalLM.from_pretrained(dtype=bfloat16), oneshot(QuantizationModifier(targets="Linear",
             scheme="FP8", ignore=["lm_head"])), model.save_pretrained(save_compressed=True). Its default pipeline
             for this recipe is "sequential": every layer runs the calibration batches twice (calibrate, then
             propagate the quantized outputs).
Both calibrate on the same tokens: `--steps` batches of `--batch-size` x `--seq-len` (default 8 x 2 x 128 = 16
samples, 2,048 tokens) built once by converters.calibration.batches.calibration_batches from the built-in corpus'
calibration part with the model's tokenizer and seed 0 (exactly what fp8forge builds inside its job), saved to a
JSON file that the peer turns into a `datasets.Dataset` of input_ids and attention_mask (oneshot batch_size =
`--batch-size`).

Each export is a fresh child process measured by benchmarks/measure.py: the in-process seconds (load +
calibrate + save, after the imports) and the process wall; its peak RSS is printed above the same tool's
import-only baseline (fp8forge: torch, transformers, safetensors, torchao and converters in the project venv;
peer: torch, transformers, datasets and llmcompressor in the peer venv). ru_maxrss also counts file-backed pages
(safetensors files read through mmap, which are page cache), so each child also samples its own memory
(measure.RssSampler) and the table splits the peak into anonymous and file-backed memory, naming the phase
(fp8forge's pipeline stage; the peer's load, oneshot or save) of the anonymous peak. The weights are read once
before anything is timed so that both tools find them in the page cache.

After the smallest size's exports, a check in the project venv loads both with transformers +
compressed-tensors, prints each one's logits cosine to the bf16 original on a fixed batch (not a calibration
batch), compares their scales and FP8 weight bytes layer by layer, and prints how the two quantization_config
blocks and tensor layouts differ. The run starts by naming fp8forge's commit and any uncommitted changes under
converters/, since the numbers are those of the code as it was.

fp8forge's export also runs a second time with `measure: false` (no per-layer SQNR meter), printed as
"fp8forge measure off", so the meter's cost and both figures against the peer's are in the same run
(`--no-unmeasured` skips it, when a run must fit a time limit).

The floor a calibrated job is held to, also measured at every size (`--no-floor` skips it): a copy of the weight
files (plain `shutil.copyfile`) and a plain transformers bf16 forward (`AutoModelForCausalLM.from_pretrained`, then
every calibration batch, `use_cache=False`) over the same tokens, each in a fresh child; "copy + forward" is the sum
of their in-process seconds. Every child also reports its CPU seconds (user + sys of all its threads) over the
timed work, since on a shared machine the wall clock also counts other jobs' time. `--real-smollm` adds the real
SmolLM2-135M (the test suite's copy under ~/.cache/fp8forge-tests; its own tokenizer, so its own tokens).

Targets (printed with the measured ratios; a missed target never changes the exit status):
  time    fp8forge's in-process seconds < the peer's, at every size
  memory  fp8forge's peak RSS above its baseline grows by at most one decoder layer from the smallest to
          the largest model (flat), while the peer's grows (it holds the whole model)
  job     with measurement on, fp8forge's in-process seconds <= PEER_TARGET x the peer's and
          <= FLOOR_TARGET x (copy + forward)

Run:
  .venv/bin/python benchmarks/bench_serving.py                       # 0.5B and 1B, both tools
  .venv/bin/python benchmarks/bench_serving.py --skip-peer           # fp8forge's side alone
  .venv/bin/python benchmarks/bench_serving.py --sizes 0.005,0.01 --hidden 256 --intermediate 1024 --heads 4 \
      --kv-heads 2 --vocab 1024 --steps 2                            # the whole flow in about 1.5 minutes
The first run creates the peer venv (default ~/.cache/fp8forge-bench/llmcompressor-venv, `--peer-venv`):
torch 2.13.0 first (the CPU wheel; a constraints file keeps it when llmcompressor's dependencies resolve),
then llmcompressor; ~1.5 GB and 2 to 3.5 minutes (pip cache warm or cold), reported apart from the
measurements. Later runs reuse it; delete the directory to reinstall.

Disk and time: the 1B size needs ~6.5 GB at once (model, fp8forge's artifact with its serving export, the
peer's export; each deleted after its size unless `--keep`). On a 2-core CPU-only machine the default run
takes about 20 minutes (measured: 1,179 s, and 1,242 s including a 102 s peer install), most of it in the
forward passes: the peer's runs every layer twice, fp8forge's once. On a shared machine the same
measurement varied by up to 1.7x between runs; each one's progress line shows the load average after it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench_scale import (
    GIB,
    MIB,
    Calibration,
    ModelPlan,
    Width,
    add_width_arguments,
    layers_for,
    plan_model,
    read_through,
    real_smollm_plan,
    weight_files,
    write_model,
)
from measure import RssSampler, child_peak_rss

SERVING_FORMAT = "compressed-tensors-fp8"
PEER_TORCH = "torch==2.13.0"  # the local CPU wheel; an unpinned torch would pull a multi-GB CUDA build
PEER_PACKAGE = "llmcompressor==0.14.0.1"
DEFAULT_PEER_VENV = Path.home() / ".cache" / "fp8forge-bench" / "llmcompressor-venv"
FLAT_TARGET_LAYERS = 1
FP8FORGE, PEER = "fp8forge", "llm-compressor"
UNMEASURED = "fp8forge measure off"  #: the same fp8forge export with measure: false (no per-layer SQNR meter)
COPY, FORWARD = "copy", "forward"  #: the floor's two children: the weight files copied, a plain bf16 forward
PEER_TARGET = 0.6  #: a calibrated job (measurement on) within this share of the peer's time
FLOOR_TARGET = 1.3  #: ... and within this multiple of a copy of the weights plus a plain forward over the tokens


@dataclass(frozen=True)
class ToolRun:
    """One measured export: in-process seconds of the work, process wall, peak RSS, and what the child said."""

    tool: str
    seconds: float
    wall: float
    peak_rss: int
    details: dict


@dataclass(frozen=True)
class SizeResult:
    plan: ModelPlan
    runs: dict[str, ToolRun]  # tool name -> its run


# The child's sampler of its own memory (see measure.RssSampler); the work names its phases on it.
_sampler: RssSampler | None = None


def set_phase(name: str) -> None:
    if _sampler is not None:
        _sampler.phase = name


def cpu_seconds() -> float:
    """This process's user + system CPU seconds so far, every thread counted."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---- the peer's virtualenv ---------------------------------------------------------------------------------


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def peer_versions(venv: Path) -> dict | None:
    """The peer venv's package versions, or None when it cannot import llmcompressor (absent or broken)."""
    python = venv_python(venv)
    if not python.exists():
        return None
    probe = ("import json, torch, transformers, compressed_tensors, datasets, llmcompressor; print(json.dumps({"
             "'torch': torch.__version__, 'cuda': torch.version.cuda, 'transformers': transformers.__version__, "
             "'compressed-tensors': compressed_tensors.__version__, 'datasets': datasets.__version__, "
             "'llmcompressor': llmcompressor.__version__}))")
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else None


#: the project's one installer: uv with pip's configuration, pip where uv cannot honour it (the Makefile's too)
VENV_INSTALL = Path(__file__).resolve().parents[1] / "tools" / "venv_install.py"


def pip_install(venv: Path, constraints: Path, requirement: str, log: Path) -> None:
    # not byte-compiled: the peers' processes compile what they import on first use, a small part of the install
    with open(log, "a") as handle:
        code = subprocess.run([sys.executable, str(VENV_INSTALL), str(venv), "-c", str(constraints), requirement],
                              stdout=handle, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"installing {requirement} into {venv} failed; see {log}")


def ensure_peer_venv(venv: Path) -> tuple[dict, float | None]:
    """The peer's versions and its install seconds (None when an existing venv was reused)."""
    versions = peer_versions(venv)
    if versions is not None:
        return versions, None
    started = time.perf_counter()
    print(f"installing {PEER_PACKAGE} into {venv} (log: {venv / 'install.log'})", flush=True)
    if not venv_python(venv).exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # torch first and pinned for every later resolution, so llmcompressor's dependencies keep the CPU wheel.
    constraints = venv / "fp8forge-bench-constraints.txt"
    constraints.write_text(PEER_TORCH + "\n")
    log = venv / "install.log"
    pip_install(venv, constraints, PEER_TORCH, log)
    pip_install(venv, constraints, PEER_PACKAGE, log)
    versions = peer_versions(venv)
    if versions is None:
        raise SystemExit(f"{venv} still cannot import llmcompressor after the install; see {log}")
    return versions, time.perf_counter() - started


# ---- calibration tokens, shared by both tools -------------------------------------------------------------


def write_calibration_tokens(model_dir: Path, vocab_size: int, calibration: Calibration, path: Path) -> str:
    """Build the batches as fp8forge's job does (its tokenizer, the built-in corpus' calibration part, seed 0) and
    save their rows. The job reads the corpus less its held-out part (stages._calibration_batches); rows from the
    whole corpus were other windows than the job's, so the two tools' static input scales were calibrated on
    different tokens (docs/benchmarks/nvfp4-2026-12-03.md)."""
    from transformers import AutoTokenizer

    from converters.calibration.batches import calibration_batches
    from converters.quality.held_out import calibration_part

    batches, source = calibration_batches(
        AutoTokenizer.from_pretrained(model_dir), vocab_size=vocab_size, texts=calibration_part(),
        steps=calibration.steps, batch_size=calibration.batch_size, seq_len=calibration.seq_len,
    )
    rows = {key: [row for batch in batches for row in batch[key].tolist()] for key in ("input_ids", "attention_mask")}
    path.write_text(json.dumps(rows))
    return source


# ---- the measured child processes (run as `bench_serving.py --child ROLE JSON`, in either venv) -----------


def import_fp8forge() -> None:
    """What fp8forge's baseline loads; its export child loads the same before its clock starts."""
    import torchao.float8  # noqa: F401  (the ao backend's library)
    from bench_scale import import_libraries

    import converters.serving  # noqa: F401

    import_libraries()


def import_peer() -> None:
    """What the peer's baseline loads; its export child loads the same before its clock starts."""
    import datasets  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from llmcompressor import oneshot  # noqa: F401
    from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401


def child_fp8forge_imports(_: dict) -> dict:
    import_fp8forge()
    return {"seconds": 0.0}


def child_peer_imports(_: dict) -> dict:
    import_peer()
    return {"seconds": 0.0}


def child_fp8forge_export(params: dict) -> dict:
    from converters.model.sources import ModelSourceOptions
    from converters.pipeline.driver import NullSink, run_conversion
    from converters.pipeline.request import CalibrationSettings, ConversionRequest

    class PhaseSink(NullSink):
        """Names each pipeline stage on the memory sampler, so the peak is attributed to a stage."""

        def stage(self, name: str) -> None:
            set_phase(name)

    # skip_first_last off and lm_head excluded: the same Linears as the peer's ignore=["lm_head"]. The serving
    # format and kv_cache default to this script's; bench_serving_formats.py asks for others.
    request = ConversionRequest(
        model=params["model_dir"], recipe={"backend": "ao"}, skip_first_last=False, exclude=("lm_head",),
        calibration=CalibrationSettings(steps=params["steps"], batch_size=params["batch_size"],
                                        seq_len=params["seq_len"]),
        serving_formats=(params.get("serving_format", SERVING_FORMAT),), kv_cache=params.get("kv_cache"),
        measure=params.get("measure", True),
    )
    sources = ModelSourceOptions(allowed_roots=(Path(params["root"]),))
    import_fp8forge()
    start, cpu = time.perf_counter(), cpu_seconds()
    run_conversion(request, Path(params["out_dir"]), sources, PhaseSink())
    return {"seconds": time.perf_counter() - start, "cpu": cpu_seconds() - cpu}


def child_peer_export(params: dict) -> dict:
    import_peer()
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    rows = json.loads(Path(params["tokens"]).read_text())
    # QuantizationModifier's arguments besides targets and ignore: this script's FP8 unless the caller names
    # others (bench_serving_formats.py: NVFP4, or FP8 with a kv_cache_scheme).
    recipe = params.get("recipe", {"scheme": "FP8"})
    start, cpu = time.perf_counter(), cpu_seconds()
    set_phase("load")
    model = AutoModelForCausalLM.from_pretrained(params["model_dir"], dtype=torch.bfloat16)
    loaded = time.perf_counter()
    set_phase("oneshot")
    # Already tokenized (an input_ids column), so oneshot uses the rows as they are; the processor it loads
    # from the model directory only matters for text datasets.
    dataset = Dataset.from_dict(rows)
    oneshot(model=model, dataset=dataset,
            recipe=QuantizationModifier(targets="Linear", ignore=["lm_head"], **recipe),
            num_calibration_samples=len(rows["input_ids"]), max_seq_length=params["seq_len"],
            batch_size=params["batch_size"])
    calibrated = time.perf_counter()
    set_phase("save")
    model.save_pretrained(params["out_dir"], save_compressed=True)
    end = time.perf_counter()
    return {"seconds": end - start, "cpu": cpu_seconds() - cpu, "load": loaded - start, "oneshot": calibrated - loaded,
            "save": end - calibrated}


def child_nothing(_: dict) -> dict:
    """The copy's baseline: a Python process that imports nothing more."""
    return {"seconds": 0.0}


def child_forward_imports(_: dict) -> dict:
    """The forward's baseline: what it imports before it loads the model."""
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    return {"seconds": 0.0}


def child_copy(params: dict) -> dict:
    """The weight files copied as they are: the floor of a job that writes a copy of the weights."""
    source, target = Path(params["model_dir"]), Path(params["out_dir"])
    target.mkdir()
    start, cpu = time.perf_counter(), cpu_seconds()
    for path in weight_files(source):
        shutil.copyfile(path, target / path.name)
    return {"seconds": time.perf_counter() - start, "cpu": cpu_seconds() - cpu}


def child_forward(params: dict) -> dict:
    """A plain transformers bf16 forward over the calibration tokens both tools use (the model's load timed
    apart): the floor of a job that runs the model once over them."""
    import torch
    from transformers import AutoModelForCausalLM

    rows = json.loads(Path(params["tokens"]).read_text())
    size = params["batch_size"]
    batches = [{key: torch.tensor(rows[key][first:first + size]) for key in ("input_ids", "attention_mask")}
               for first in range(0, len(rows["input_ids"]), size)]
    loading = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(params["model_dir"], dtype=torch.bfloat16).eval()
    start, cpu = time.perf_counter(), cpu_seconds()
    with torch.no_grad():
        for batch in batches:
            model(**batch, use_cache=False)
    return {"seconds": time.perf_counter() - start, "cpu": cpu_seconds() - cpu, "load": start - loading}


CHILD_ROLES = {
    "fp8forge-imports": child_fp8forge_imports,
    "peer-imports": child_peer_imports,
    "fp8forge-export": child_fp8forge_export,
    "peer-export": child_peer_export,
    "copy": child_copy,
    "forward": child_forward,
    "nothing": child_nothing,
    "forward-imports": child_forward_imports,
}


def last_json_line(stdout: str) -> dict:
    """The child's result: its last stdout line (libraries may print before it)."""
    return json.loads([line for line in stdout.splitlines() if line.strip()][-1])


def run_child(python: Path | str, role: str, script: str = __file__, **params) -> tuple[float, int, dict]:
    """Run ``script --child role`` (this file unless another script that shares its roles is named)."""
    wall, peak_rss, stdout = child_peak_rss([str(python), script, "--child", role, json.dumps(params)])
    os.sync()  # this process's dirty pages must not be written back while the next one is timed
    details = last_json_line(stdout)
    details["load_average"] = os.getloadavg()[0]  # shows when another job slowed a measurement down
    return wall, peak_rss, details


def measure_tool(tool: str, python: Path | str, role: str, script: str = __file__, **params) -> ToolRun:
    wall, peak_rss, details = run_child(python, role, script, **params)
    return ToolRun(tool=tool, seconds=details.pop("seconds"), wall=wall, peak_rss=peak_rss, details=details)


# ---- the sanity check of both exports (smallest size; project venv, not measured) -------------------------


def child_check(params: dict) -> dict:
    """Load the original and both exports with transformers + compressed-tensors; logits cosine on one batch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from converters.calibration.batches import calibration_batches

    batches, _ = calibration_batches(AutoTokenizer.from_pretrained(params["model_dir"]), vocab_size=params["vocab"],
                                     steps=1, batch_size=2, seq_len=params["seq_len"], seed=1)
    batch = batches[0]  # seed 1: other windows than the calibration's (seed 0)

    def logits(directory: str) -> tuple[torch.Tensor, dict]:
        model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
        with torch.no_grad():
            out = model.eval()(**batch, use_cache=False).logits.float()
        linear_classes = sorted({type(m).__name__ for name, m in model.named_modules() if name.endswith("q_proj")})
        problems = {kind: sorted(info[kind])[:5] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
                    if info[kind]}
        return out, {"loading_problems": problems, "q_proj_class": linear_classes,
                     "dtype": str(next(model.parameters()).dtype)}

    reference, _ = logits(params["model_dir"])
    result = {}
    for tool, directory in params["exports"].items():
        served, info = logits(directory)
        cosine = torch.nn.functional.cosine_similarity(served.flatten(), reference.flatten(), dim=0)
        result[tool] = {"cosine": float(cosine), **info}
    result["tensors"] = compare_exports(params["exports"][FP8FORGE], params["exports"][PEER])
    return result


def tensor_files(directory: str) -> dict[str, Path]:
    """Each tensor's safetensors file in an export."""
    from safetensors import safe_open

    files = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            files.update({name: path for name in handle.keys()})
    return files


def compare_exports(first: str, second: str) -> dict:
    """Per quantized Linear: relative differences of weight_scale and input_scale, and how many FP8 bytes agree.

    Reads one tensor at a time from each export, so the check holds two weights at most.
    """
    import torch
    from safetensors import safe_open

    ours, theirs = tensor_files(first), tensor_files(second)

    def read(files: dict[str, Path], name: str) -> torch.Tensor:
        with safe_open(files[name], framework="pt") as handle:
            return handle.get_tensor(name)

    weights = sorted(name.removesuffix("_scale") for name in ours
                     if name.endswith(".weight_scale") and name in theirs)
    relative: dict[str, list[tuple[float, str]]] = {"weight_scale": [], "input_scale": []}
    equal_bytes = total_bytes = identical_tensors = 0
    for weight in weights:
        for kind in relative:
            name = weight.removesuffix("weight") + kind
            if name in ours and name in theirs:
                a, b = read(ours, name).float(), read(theirs, name).float()
                relative[kind].append((float((a - b).abs().max() / b.abs().max()), name))
        a, b = read(ours, weight).view(torch.uint8), read(theirs, weight).view(torch.uint8)
        same = int((a == b).sum()) if a.shape == b.shape else 0
        equal_bytes, total_bytes = equal_bytes + same, total_bytes + a.numel()
        identical_tensors += same == a.numel()
    result = {}
    for kind, values in relative.items():
        if values:
            diffs = torch.tensor([value for value, _ in values])
            result[kind] = {"layers": len(values), "max_relative_diff": float(diffs.max()),
                            "median_relative_diff": float(diffs.median()), "worst": max(values)[1]}
    result["fp8_weights"] = {"tensors": len(weights), "identical_tensors": identical_tensors,
                             "equal_byte_fraction": equal_bytes / max(1, total_bytes)}
    return result


CHILD_ROLES["check"] = child_check


# ---- comparing the two exports' files (in this process; headers and config only) --------------------------


def flatten(value, prefix: str = "") -> dict:
    """Nested dicts as {dotted.key: leaf}; lists stay leaves."""
    if isinstance(value, dict):
        flat = {}
        for key, inner in value.items():
            flat.update(flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: value}


def config_differences(ours: Path, theirs: Path, peer: str = PEER) -> list[str]:
    """quantization_config keys and values that differ between the two config.json files."""
    first = flatten(json.loads((ours / "config.json").read_text()).get("quantization_config", {}))
    second = flatten(json.loads((theirs / "config.json").read_text()).get("quantization_config", {}))
    lines = []
    for key in sorted(set(first) | set(second)):
        a, b = first.get(key, "<absent>"), second.get(key, "<absent>")
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list):
            lines.append(f"  {key}: only {FP8FORGE} {sorted(set(map(str, a)) - set(map(str, b)))}, "
                         f"only {peer} {sorted(set(map(str, b)) - set(map(str, a)))}")
        else:
            lines.append(f"  {key}: {FP8FORGE} {json.dumps(a)} | {peer} {json.dumps(b)}")
    return lines or ["  (none)"]


def tensor_layout(directory: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor's dtype and shape, from the safetensors headers (8-byte length, then JSON)."""
    layout = {}
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        layout.update({name: (entry["dtype"], tuple(entry["shape"])) for name, entry in header.items()
                       if name != "__metadata__"})
    return layout


def layer_pattern(name: str) -> str:
    return re.sub(r"\.layers\.\d+\.", ".layers.N.", name)


def layout_differences(ours: Path, theirs: Path, peer: str = PEER) -> list[str]:
    """Tensors present in one export only, or with another dtype/shape, collapsed over the layer index."""
    first, second = tensor_layout(ours), tensor_layout(theirs)
    counts: dict[str, int] = {}
    for name in sorted(set(first) | set(second)):
        a, b = first.get(name), second.get(name)
        if a == b:
            continue
        describe = lambda entry: "absent" if entry is None else f"{entry[0]} {list(entry[1])}"  # noqa: E731
        line = f"  {layer_pattern(name)}: {FP8FORGE} {describe(a)} | {peer} {describe(b)}"
        counts[line] = counts.get(line, 0) + 1
    summary = [f"  tensors: {FP8FORGE} {len(first)}, {peer} {len(second)}; "
               f"F8_E4M3 tensors: {sum(dtype == 'F8_E4M3' for dtype, _ in first.values())} / "
               f"{sum(dtype == 'F8_E4M3' for dtype, _ in second.values())}"]
    return summary + [f"{line} (x{count})" for line, count in counts.items()]


def directory_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


# ---- one size ---------------------------------------------------------------------------------------------


def fp8forge_details(out_dir: Path) -> dict:
    """Stage seconds and pipeline mode from fp8forge's report, and the sizes of what it wrote."""
    report = json.loads((out_dir / "fp8_report.json").read_text())
    serving_dir = out_dir / "serving" / SERVING_FORMAT
    quantized = report.get("serving", {}).get(SERVING_FORMAT, {}).get("quantized", [])
    return {"stages": report.get("stage_seconds", {}), "mode": report.get("pipeline", {}).get("mode"),
            "quantized": len(quantized), "artifact_bytes": directory_bytes(out_dir) - directory_bytes(serving_dir),
            "serving_bytes": directory_bytes(serving_dir)}


def sampled(run: ToolRun, kind: str) -> int | None:
    """The child's own sampled peak of ``kind`` ("anon", "file", "total"; see measure.RssSampler), if any."""
    peak = run.details.get("rss", {}).get(kind)
    return None if peak is None else peak["bytes"]


def above(run: ToolRun, baseline: ToolRun, kind: str = "maxrss") -> int | None:
    """Peak memory above the same tool's import-only baseline: ru_maxrss, or a sampled kind."""
    if kind == "maxrss":
        return run.peak_rss - baseline.peak_rss
    ours, base = sampled(run, kind), sampled(baseline, kind)
    return None if ours is None or base is None else ours - base


def _mib(value: int | None, signed: bool = False) -> str:
    return "n/a" if value is None else f"{value / MIB:{'+' if signed else ''},.0f}"


def print_run(name: str, run: ToolRun, baseline: ToolRun) -> None:
    details = {key: value for key, value in run.details.items() if key not in ("rss", "load_average")}
    extra = ", ".join(f"{key} {value:.1f} s" if isinstance(value, float) else f"{key} {value}"
                      for key, value in details.items() if not key.endswith("_bytes"))
    phase = {kind: run.details.get("rss", {}).get(kind, {}).get("phase", "n/a") for kind in ("anon", "file")}
    print(f"[{name}] {run.tool}: {run.seconds:.1f} s in process, {run.wall:.1f} s wall, peak RSS "
          f"{run.peak_rss / MIB:,.0f} MiB ({_mib(above(run, baseline), True)} above baseline; anonymous "
          f"{_mib(above(run, baseline, 'anon'), True)} at its peak in {phase['anon']}, file-backed "
          f"{_mib(above(run, baseline, 'file'), True)} at its peak in {phase['file']}), "
          f"load average {run.details['load_average']:.1f}; {extra}", flush=True)


def measure_size(plan: ModelPlan, root: Path, calibration: Calibration, peer_venv: Path | None,
                 baselines: dict[str, ToolRun], check: bool, keep: bool, floor: bool = True,
                 unmeasured: bool = True) -> SizeResult:
    model_dir = root / plan.name
    started = time.perf_counter()
    if plan.source is None:
        write_model(plan, model_dir)
    else:  # a real checkpoint, copied in so that every tool reads it from the run's directory
        shutil.copytree(plan.source, model_dir)
    os.sync()
    read_through(weight_files(model_dir))
    print(f"[{plan.name}] {'wrote' if plan.source is None else 'copied'} {plan.layers} layers, "
          f"{plan.parameters:,} parameters ({plan.weight_bytes / GIB:.2f} GiB) in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    sizes = {"steps": calibration.steps, "batch_size": calibration.batch_size, "seq_len": calibration.seq_len}
    tokens = root / f"{plan.name}-calibration-tokens.json"  # per model: a real model has its own tokenizer
    if peer_venv is not None or floor:
        source = write_calibration_tokens(model_dir, plan.width.vocab_size, calibration, tokens)
        print(f"[{plan.name}] calibration tokens for every tool: {source}", flush=True)

    ours_dir = root / f"{plan.name}-fp8forge"
    ours = measure_tool(FP8FORGE, sys.executable, "fp8forge-export", model_dir=str(model_dir),
                        out_dir=str(ours_dir), root=str(root), **sizes)
    ours.details.update(fp8forge_details(ours_dir))
    print_run(plan.name, ours, baselines[FP8FORGE])
    print(f"[{plan.name}] {FP8FORGE} wrote {ours.details['artifact_bytes'] / GIB:.2f} GiB of ao artifact and "
          f"{ours.details['serving_bytes'] / GIB:.2f} GiB of serving export", flush=True)
    runs = {FP8FORGE: ours}
    if unmeasured:  # the same export with measure false: what the per-layer SQNR meter costs
        off_dir = root / f"{plan.name}-fp8forge-unmeasured"
        off = measure_tool(FP8FORGE, sys.executable, "fp8forge-export", model_dir=str(model_dir),
                           out_dir=str(off_dir), root=str(root), measure=False, **sizes)
        runs[UNMEASURED] = replace(off, tool=UNMEASURED)
        baselines.setdefault(UNMEASURED, baselines[FP8FORGE])
        print_run(plan.name, runs[UNMEASURED], baselines[UNMEASURED])
        shutil.rmtree(off_dir, ignore_errors=True)

    if floor:
        copy_dir = root / f"{plan.name}-copy"
        runs[COPY] = measure_tool(COPY, sys.executable, "copy", model_dir=str(model_dir), out_dir=str(copy_dir))
        shutil.rmtree(copy_dir, ignore_errors=True)
        runs[FORWARD] = measure_tool(FORWARD, sys.executable, "forward", model_dir=str(model_dir), tokens=str(tokens),
                                     **sizes)
        for tool, role in ((COPY, "nothing"), (FORWARD, "forward-imports")):  # each against its own imports
            if tool not in baselines:
                baselines[tool] = measure_tool(tool, sys.executable, role)
            print_run(plan.name, runs[tool], baselines[tool])

    theirs_dir = root / f"{plan.name}-peer"
    if peer_venv is not None:
        theirs = measure_tool(PEER, venv_python(peer_venv), "peer-export", model_dir=str(model_dir),
                              out_dir=str(theirs_dir), tokens=str(tokens), **sizes)
        print_run(plan.name, theirs, baselines[PEER])
        print(f"[{plan.name}] {PEER} wrote {directory_bytes(theirs_dir) / GIB:.2f} GiB", flush=True)
        runs[PEER] = theirs
        if check:
            check_exports(plan, model_dir, ours_dir / "serving" / SERVING_FORMAT, theirs_dir, calibration)
    if not keep:
        for directory in (model_dir, ours_dir, theirs_dir):
            shutil.rmtree(directory, ignore_errors=True)
    return SizeResult(plan=plan, runs=runs)


def check_exports(plan: ModelPlan, model_dir: Path, ours: Path, theirs: Path, calibration: Calibration) -> None:
    started = time.perf_counter()
    params = {"model_dir": str(model_dir), "vocab": plan.width.vocab_size, "seq_len": calibration.seq_len,
              "exports": {FP8FORGE: str(ours), PEER: str(theirs)}}
    checked = subprocess.run([sys.executable, __file__, "--child", "check", json.dumps(params)],
                             capture_output=True, text=True)
    if checked.returncode:
        raise SystemExit(f"the check of both exports failed:\n{checked.stderr[-3000:]}")
    result = last_json_line(checked.stdout)
    print(f"\n[{plan.name}] check in the project venv (transformers + compressed-tensors, "
          f"{time.perf_counter() - started:.0f} s): logits cosine to the bf16 original on 2 x {calibration.seq_len} "
          "tokens drawn with seed 1 (the calibration's with seed 0)")
    for tool in (FP8FORGE, PEER):
        info = result[tool]
        print(f"  {tool}: cosine {info['cosine']:.5f}; loads as {info['q_proj_class']} ({info['dtype']}); "
              f"loading problems: {info['loading_problems'] or 'none'}")
    print(f"  quantized tensors, {FP8FORGE} vs {PEER} (same names in both):")
    for key, value in result["tensors"].items():
        print(f"    {key}: {json.dumps(value)}")
    print(f"  quantization_config differences ({FP8FORGE} | {PEER}):")
    print("\n".join(config_differences(ours, theirs)))
    print("  tensor layout differences (dtype [shape]):")
    print("\n".join(layout_differences(ours, theirs)), flush=True)


# ---- the report -------------------------------------------------------------------------------------------


def print_table(results: list[SizeResult], baselines: dict[str, ToolRun]) -> None:
    header = ("size", "layers", "parameters", "tool", "in-process s", "its CPU s", "process wall s",
              "peak RSS above base MiB", "of it: anon / file-backed MiB")
    rows = [(r.plan.name, str(r.plan.layers), f"{r.plan.parameters:,}", run.tool, f"{run.seconds:.1f}",
             _cpu(run), f"{run.wall:.1f}", _mib(above(run, baselines[run.tool])),
             f"{_mib(above(run, baselines[run.tool], 'anon'))} / {_mib(above(run, baselines[run.tool], 'file'))}")
            for r in results for run in r.runs.values()]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print()
    for row in [header, *rows]:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
    print("(anon and file-backed are the child's own samples every 50 ms, each at its own peak; file-backed pages "
          "are mmap'd files, e.g. safetensors read through the page cache, which the kernel can drop)")


def _verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def _cpu(run: ToolRun) -> str:
    cpu = run.details.get("cpu")
    return "n/a" if cpu is None else f"{cpu:.1f}"


def print_job_targets(results: list[SizeResult]) -> None:
    """The calibrated job (measurement on) against the peer and against copy + forward, wall and CPU."""
    print("calibrated job (measurement on), in-process time and CPU time (user + sys):")
    for r in results:
        ours = r.runs[FP8FORGE]
        theirs, copy, forward = r.runs.get(PEER), r.runs.get(COPY), r.runs.get(FORWARD)
        parts = []
        if theirs is not None:
            ratio = ours.seconds / theirs.seconds
            cpu = ours.details["cpu"] / theirs.details["cpu"]
            parts.append(f"/ {PEER} {ratio:.2f} (CPU {cpu:.2f}; target <= {PEER_TARGET}: "
                         f"{_verdict(ratio <= PEER_TARGET)})")
        if copy is not None and forward is not None:
            floor = copy.seconds + forward.seconds
            ratio = ours.seconds / floor
            cpu = ours.details["cpu"] / (copy.details["cpu"] + forward.details["cpu"])
            parts.append(f"/ (copy + forward, {copy.seconds:.1f} + {forward.seconds:.1f} s) {ratio:.2f} "
                         f"(CPU {cpu:.2f}; target <= {FLOOR_TARGET}: {_verdict(ratio <= FLOOR_TARGET)})")
        print(f"  {r.plan.name}: {ours.seconds:.1f} s, CPU {ours.details['cpu']:.1f} s " + "; ".join(parts))


def growth(results: list[SizeResult], tool: str, baseline: ToolRun, kind: str) -> tuple[int, str] | None:
    """Growth of ``tool``'s peak (``kind`` as in :func:`above`) from the shallowest to the deepest model."""
    measured = [r for r in results if tool in r.runs]
    if len(measured) < 2:
        return None
    shallow, deep = min(measured, key=lambda r: r.plan.layers), max(measured, key=lambda r: r.plan.layers)
    first, last = above(shallow.runs[tool], baseline, kind), above(deep.runs[tool], baseline, kind)
    if first is None or last is None:
        return None
    grown = last - first
    layers = max(1, deep.plan.layers - shallow.plan.layers)
    return grown, (f"{_mib(first)} -> {_mib(last)} MiB from {shallow.plan.name} to {deep.plan.name}: "
                   f"{_mib(grown, True)} MiB ({grown / layers / MIB:+.1f} MiB per added decoder layer)")


def print_ratios(results: list[SizeResult], baselines: dict[str, ToolRun]) -> None:
    compared = [r for r in results if PEER in r.runs]
    if compared:
        print(f"ratios {FP8FORGE} / {PEER}:")
    for r in compared:
        ours, theirs = r.runs[FP8FORGE], r.runs[PEER]
        memory = above(ours, baselines[FP8FORGE]) / max(1, above(theirs, baselines[PEER]))
        time_ratio = ours.seconds / theirs.seconds
        print(f"  {r.plan.name}: time in process {time_ratio:.2f} (target < 1: {_verdict(time_ratio < 1)}; "
              f"<= 0.5: {_verdict(time_ratio <= 0.5)}), process wall {ours.wall / theirs.wall:.2f}; peak RSS above "
              f"baseline {memory:.2f} (<= 0.5: {_verdict(memory <= 0.5)})")
        off = r.runs.get(UNMEASURED)
        if off is not None:
            print(f"  {r.plan.name}: with measure false: time {off.seconds / theirs.seconds:.2f} of {PEER}'s; "
                  f"the SQNR meter costs {ours.seconds / off.seconds:.2f}x (target <= 1.15: "
                  f"{_verdict(ours.seconds / off.seconds <= 1.15)})")


def print_growth(results: list[SizeResult], baselines: dict[str, ToolRun]) -> None:
    results = [r for r in results if r.plan.source is None]  # one width: the random family's, not SmolLM2's
    if not results:
        return
    deepest = max(results, key=lambda r: r.plan.layers).plan
    layer = deepest.decoder_layer_bytes
    print(f"memory growth (one decoder layer is {layer / MIB:,.0f} MiB of bf16 weights; the model grows by "
          f"{(deepest.weight_bytes - min(r.plan.weight_bytes for r in results)) / MIB:,.0f} MiB):")
    for kind, label in (("maxrss", "peak RSS above baseline"), ("anon", "anonymous peak above baseline")):
        grown = {tool: growth(results, tool, baselines[tool], kind) for tool in baselines}
        for tool, value in grown.items():
            print(f"  {tool} {label}: {value[1] if value else 'n/a'}")
        ours, theirs = grown.get(FP8FORGE), grown.get(PEER)
        if ours:
            peer_text = "" if not theirs else f"; {PEER} grows by more: {'yes' if theirs[0] > ours[0] else 'no'}"
            target = "target" if kind == "maxrss" else "for comparison"
            print(f"    {target}: {FP8FORGE} grows by <= {FLAT_TARGET_LAYERS} decoder layer: "
                  f"{_verdict(ours[0] <= FLAT_TARGET_LAYERS * layer)}{peer_text}")


def print_targets(results: list[SizeResult], baselines: dict[str, ToolRun]) -> None:
    print("\nbaselines (import-only peak RSS, subtracted above): " + ", ".join(
        f"{tool} {run.peak_rss / MIB:,.0f} MiB (anonymous {_mib(sampled(run, 'anon'))}, file-backed "
        f"{_mib(sampled(run, 'file'))})" for tool, run in baselines.items()))
    print_ratios(results, baselines)
    print_job_targets(results)
    print_growth(results, baselines)


# ---- command line -----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.5,1", help="target sizes in billions of parameters (0.5,1)")
    parser.add_argument("--steps", type=int, default=8, help="calibration batches (8)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--workdir", type=Path, help="where the run's temporary directory goes (system temp)")
    parser.add_argument("--keep", action="store_true", help="keep the models, the exports and the run's directory")
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_PEER_VENV,
                        help=f"llm-compressor's virtualenv, created when missing ({DEFAULT_PEER_VENV})")
    parser.add_argument("--skip-peer", action="store_true", help="measure fp8forge only")
    parser.add_argument("--no-floor", action="store_true", help="skip the copy + plain forward children")
    parser.add_argument("--no-unmeasured", action="store_true",
                        help="skip the second fp8forge export with measure: false")
    parser.add_argument("--real-smollm", action="store_true", help="also the real SmolLM2-135M (after the sizes)")
    add_width_arguments(parser)
    return parser.parse_args()


def model_plans(args: argparse.Namespace) -> list[ModelPlan]:
    width = Width(hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=args.heads,
                  num_key_value_heads=args.kv_heads, vocab_size=args.vocab)
    sizes = sorted(float(size) for size in args.sizes.split(",") if size)
    plans = [plan_model(f"{size:g}B", width, layers_for(width, size)) for size in sizes]
    return plans + ([real_smollm_plan()] if getattr(args, "real_smollm", False) else [])


def fp8forge_source_state() -> str:
    """The commit and the uncommitted files under converters/: what the fp8forge numbers belong to."""
    repo = Path(__file__).resolve().parent.parent

    def git(*argv: str) -> str:
        result = subprocess.run(["git", "-C", str(repo), *argv], capture_output=True, text=True)
        return result.stdout.rstrip() if result.returncode == 0 else ""  # a porcelain line starts with a space

    head = git("rev-parse", "--short", "HEAD") or "unknown commit"
    changed = [line[3:] for line in git("status", "--porcelain", "--", "converters").splitlines()]
    return f"{head}" + (f" with uncommitted changes in {', '.join(changed)}" if changed else " (converters/ clean)")


def measure_baselines(peer_venv: Path | None) -> dict[str, ToolRun]:
    baselines = {FP8FORGE: measure_tool(FP8FORGE, sys.executable, "fp8forge-imports")}
    if peer_venv is not None:
        baselines[PEER] = measure_tool(PEER, venv_python(peer_venv), "peer-imports")
    return baselines


def run(args: argparse.Namespace, root: Path) -> None:
    calibration = Calibration(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len)
    peer_venv = None if args.skip_peer else args.peer_venv.expanduser().resolve()
    if peer_venv is not None:
        versions, install_seconds = ensure_peer_venv(peer_venv)
        how = "reused" if install_seconds is None else f"installed in {install_seconds:.0f} s (not measured below)"
        print(f"peer venv {peer_venv} {how}: {json.dumps(versions)}", flush=True)
    print(f"fp8forge: {fp8forge_source_state()}", flush=True)
    plans = model_plans(args)
    baselines = measure_baselines(peer_venv)
    print(f"calibration: {calibration.steps} steps x {calibration.batch_size} x {calibration.seq_len} tokens = "
          f"{calibration.steps * calibration.batch_size} samples, "
          f"{calibration.steps * calibration.batch_size * calibration.seq_len:,} tokens; "
          f"work directory {root}", flush=True)
    results = [measure_size(plan, root, calibration, peer_venv, baselines, check=index == 0, keep=args.keep,
                            floor=not args.no_floor, unmeasured=not args.no_unmeasured)
               for index, plan in enumerate(plans)]
    print_table(results, baselines)
    print_targets(results, baselines)


def run_as_child(role: str, params: dict) -> None:
    global _sampler
    with RssSampler() as sampler:
        _sampler = sampler
        set_phase("imports")
        result = CHILD_ROLES[role](params)
    print(json.dumps({**result, "rss": sampler.peaks()}))


def main(run_benchmark=None, parse=None, prefix: str = "bench_serving-", roles: dict | None = None) -> None:
    """Run as a child (``--child ROLE JSON``, with ``roles`` added to this script's) or run the benchmark in a
    fresh temporary directory; bench_serving_formats.py runs through here with its own run, arguments and roles."""
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        CHILD_ROLES.update(roles or {})
        run_as_child(sys.argv[2], json.loads(sys.argv[3]))
        return
    args = (parse or parse_args)()
    os.environ["TORCHAO_FORCE_SKIP_LOADING_SO_FILES"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    # Every child under one OpenMP wait policy, the one fp8forge's CLI and service set (passive): with libgomp's
    # default its threads spin at each op's barrier, and on cores another job shares that spinning multiplies a
    # job's CPU time and stretches its wall time, a tool with many small ops most. The same policy for all tools
    # compares their work, not their exposure to other jobs; OMP_WAIT_POLICY=ACTIVE in the environment runs all
    # of them with spinning instead.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    print(f"OpenMP wait policy of every child: {os.environ['OMP_WAIT_POLICY']}", flush=True)
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=args.workdir)).resolve()
    started = time.perf_counter()
    try:
        (run_benchmark or run)(args, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
