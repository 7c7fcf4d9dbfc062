"""Peak memory and wall time of a TE conversion as Llama-shaped models grow deeper: does memory stay flat?

Models: random bf16 weights in ~2 GiB safetensors shards with `model.safetensors.index.json`, a config and
the project's demo tokenizer. The width is fixed (hidden 2048, intermediate 8192, 16 heads, 8 KV heads,
vocab 32000, untied head) and only the number of decoder layers changes, chosen to give about 0.5B, 1B
and 3B parameters (the exact count is printed). The weights are written shard by shard from the shapes of
a meta-device model, so the benchmark itself never holds a whole model.

For each size, each measurement is a fresh process (peak RSS is its own, see benchmarks/measure.py):
  import-only   imports torch, transformers, safetensors and converters.pipeline.driver; its peak RSS is the
                baseline subtracted from every other peak (once per run)
  copy-only     copies the shards and the index with shutil.copyfile
  convert       run_conversion(backend "te", `--steps` calibration batches of `--batch-size` x `--seq-len`)
  forward-only  loads the model with from_pretrained and runs the same calibration batches (built by
                converters.calibration.batches.calibration_batches) through it under no_grad; only the forward
                passes are timed. Its peak RSS is what holding the whole model costs.
Times are measured inside each process around the work alone (imports and start-up excluded); the
process wall times are printed too. The page cache cannot be dropped without root, so every weight file
is read once before anything is timed and `os.sync()` runs between measurements: all of them see the
model in a warm page cache and none pays for another's writeback.

Targets (printed with the measured ratios; a missed target never changes the exit status):
  memory   convert peak RSS above the baseline <= 3 x largest layer + activations, where "largest layer" is
           (a) the largest of one decoder layer, the input embedding and the lm_head (every tensor a
               layer-by-layer pipeline must hold at once; the target as the issue states it), and
           (b) one decoder layer only (stricter: shows how far the embedding and head dominate).
           Activations = 8 x steps x batch x seq x hidden x 2 bytes: a layer-by-layer pipeline keeps the
           bf16 hidden states entering the current layer for every calibration batch and those leaving it
           (x2); the other x6 is an allowance for the transient tensors of the batch in flight (MLP
           gate/up/product at 4x the hidden width, attention, logits). It is a few percent of the layer
           term at these sizes, so the constant barely moves the ratio.
  flat     convert peak RSS above the baseline grows by at most one decoder layer's bytes from the
           shallowest to the deepest model (a pipeline holding the whole model grows by every layer);
           the growth per added decoder layer is printed as well
  measure  convert seconds with the SQNR meter on <= 1.15 x the same convert with `measure: false` (both run)
  time     convert seconds <= 1.3 x (copy seconds + forward seconds). The forward-only passes compute the
           logits; a layer-by-layer conversion skips the lm_head when no Linear outside the layers is
           calibrated (the default first/last rule), which is ~13% of the 0.5B model's forward FLOPs and ~2% of
           the 3B's, so the ratio flatters the smaller sizes a little.

Run:
  .venv/bin/python benchmarks/bench_scale.py                      # 0.5B, 1B, 3B; 4 calibration steps
  .venv/bin/python benchmarks/bench_scale.py --sizes 0.5 --steps 2
  .venv/bin/python benchmarks/bench_scale.py --llama3-8b          # only a Llama-3-8B-shaped model
  .venv/bin/python benchmarks/bench_scale.py --sizes 0.5,1 --real-smollm --steps 16   # + the real SmolLM2-135M
  .venv/bin/python benchmarks/bench_scale.py --sizes '' --real-smollm --steps 16 --repeat 3  # fastest of 3, interleaved
`--real-smollm` adds the real SmolLM2-135M (trained weights, hidden 576, 30 layers, vocab 49152, tied head;
tests/converters/quality/smollm.py builds it once) after the --sizes models (`--sizes ''` runs it alone).
Every convert runs the job's end-to-end quality pass too (measure on); the report's `quality.seconds` is
printed, and the ratios are also given without it (the SQNR meter's own cost: (on - quality) / off).
The `--llama3-8b` run converts one model with hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV
heads, vocab 128256 and an untied head (~16 GB on disk, 1 calibration step unless `--steps` says
otherwise) and skips the forward-only baseline (the whole model would barely fit in memory).
`--hidden`, `--intermediate`, `--heads`, `--kv-heads` and `--vocab` change the width, e.g. for a quick
check of the whole flow: `--sizes 0.005,0.01 --hidden 256 --intermediate 1024 --heads 4 --kv-heads 2
--vocab 1024 --steps 2`.

Disk and time: the default run needs ~6 GB for the 3B model, as much for its copy and again for the
converted output (each deleted after its size; `--keep` keeps the models and the work directory). On a
2-core CPU-only machine (AVX2, no bf16 matmul units) it takes 20 to 25 minutes, 12 of them in the 3B model's
convert and forward-only runs: bf16 forward passes run at ~20 GFLOP/s there. The `--llama3-8b` run writes
~16 GB and copies it; expect roughly 10 minutes there (an estimate, not measured). Timings are only as good as
the machine is quiet; each measurement's progress line shows the load average after it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from measure import child_peak_rss

MIB = 2**20
GIB = 2**30
BF16_BYTES = 2
MAX_SHARD_BYTES = 2 * GIB
LAYER_PREFIX = re.compile(r"^model\.layers\.(\d+)\.")
EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"

MEMORY_TARGET_LAYERS = 3
ACTIVATION_FACTOR = 8  # see the module docstring: hidden states in and out (x2) plus transient tensors
FLAT_TARGET_LAYERS = 1
WALL_TARGET = 1.3
MEASURE_TARGET = 1.15  #: convert with the SQNR meter on <= this x convert with it off (measure: false)


@dataclass(frozen=True)
class Width:
    """Everything about a Llama config except its depth."""

    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    vocab_size: int = 32000
    max_position_embeddings: int = 2048

    def config(self, layers: int):
        import torch
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            num_hidden_layers=layers,
            tie_word_embeddings=False,
            dtype=torch.bfloat16,
        )


LLAMA3_8B_WIDTH = Width(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                        vocab_size=128256, max_position_embeddings=8192)
LLAMA3_8B_LAYERS = 32


@dataclass(frozen=True)
class Calibration:
    steps: int
    batch_size: int
    seq_len: int


@dataclass(frozen=True)
class ModelPlan:
    """One model to write: its name, config and the shape of every tensor in its state dict."""

    name: str
    width: Width
    layers: int
    tensor_shapes: dict[str, tuple[int, ...]]
    source: Path | None = None  #: a real checkpoint directory, copied in instead of writing random weights

    @property
    def parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.tensor_shapes.values())

    @property
    def weight_bytes(self) -> int:
        return self.parameters * BF16_BYTES

    @property
    def decoder_layer_bytes(self) -> int:
        per_layer: dict[str, int] = {}
        for name, shape in self.tensor_shapes.items():
            if match := LAYER_PREFIX.match(name):
                per_layer[match.group(1)] = per_layer.get(match.group(1), 0) + math.prod(shape) * BF16_BYTES
        return max(per_layer.values())

    @property
    def embedding_bytes(self) -> int:
        return math.prod(self.tensor_shapes[EMBEDDING]) * BF16_BYTES

    @property
    def lm_head_bytes(self) -> int:
        # a tied head (the real SmolLM2) stores no tensor of its own: it is the embedding
        return math.prod(self.tensor_shapes.get(LM_HEAD, self.tensor_shapes[EMBEDDING])) * BF16_BYTES

    def activation_bytes(self, calibration: Calibration) -> int:
        hidden_states = calibration.steps * calibration.batch_size * calibration.seq_len * self.width.hidden_size
        return ACTIVATION_FACTOR * hidden_states * BF16_BYTES


@dataclass(frozen=True)
class ChildRun:
    """One measured process: wall and peak RSS of the whole process, seconds of the timed work inside it."""

    wall: float
    peak_rss: int
    seconds: float
    details: dict


@dataclass(frozen=True)
class SizeResult:
    plan: ModelPlan
    copy: ChildRun
    convert: ChildRun
    forward: ChildRun | None
    unmeasured: ChildRun | None = None  #: the same convert with measure: false (no SQNR meter)


# ---- planning and writing the models ----------------------------------------------------------------------


def meta_tensor_shapes(width: Width, layers: int) -> dict[str, tuple[int, ...]]:
    """State-dict names and shapes of the Llama model, from a meta-device instance (no memory)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(width.config(layers))
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def layers_for(width: Width, billions: float) -> int:
    """The decoder-layer count whose model comes closest to ``billions`` parameters (at least one)."""
    shapes = meta_tensor_shapes(width, 1)
    per_layer = sum(math.prod(shape) for name, shape in shapes.items() if LAYER_PREFIX.match(name))
    outside_layers = sum(math.prod(shape) for shape in shapes.values()) - per_layer
    return max(1, round((billions * 1e9 - outside_layers) / per_layer))


def plan_model(name: str, width: Width, layers: int) -> ModelPlan:
    return ModelPlan(name=name, width=width, layers=layers, tensor_shapes=meta_tensor_shapes(width, layers))


def plan_shards(tensor_shapes: dict[str, tuple[int, ...]], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped in state-dict order into shards of at most ``max_bytes`` (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in tensor_shapes.items():
        nbytes = math.prod(shape) * BF16_BYTES
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def random_weight(name: str, shape: tuple[int, ...]):
    import torch

    if name.endswith("norm.weight"):  # RMSNorm scales: ones, as a freshly initialised model has them
        return torch.ones(shape, dtype=torch.bfloat16)
    return torch.empty(shape, dtype=torch.bfloat16).normal_(std=0.02)


def write_model(plan: ModelPlan, directory: Path) -> None:
    """Write the model shard by shard, so that at most one shard of weights is in memory."""
    import torch
    from safetensors.torch import save_file

    from converters.model.demo import build_demo_tokenizer

    torch.manual_seed(0)
    directory.mkdir(parents=True)
    shards = plan_shards(plan.tensor_shapes, MAX_SHARD_BYTES)
    weight_map = {}
    for index, names in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_weight(name, plan.tensor_shapes[name]) for name in names}
        save_file(tensors, directory / file_name, metadata={"format": "pt"})
        del tensors
        weight_map.update({name: file_name for name in names})
    index_json = {"metadata": {"total_size": plan.weight_bytes}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    plan.width.config(plan.layers).save_pretrained(directory)
    build_demo_tokenizer().save_pretrained(directory)  # ids < 320: valid for any vocabulary used here


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files and the index (a one-file checkpoint has ``model.safetensors`` and no index)."""
    files = sorted(directory.glob("model*.safetensors"))
    index = directory / "model.safetensors.index.json"
    return files + ([index] if index.exists() else [])


def real_smollm_plan() -> ModelPlan:
    """The real SmolLM2-135M (tests/converters/quality/smollm.py builds it once per machine): 30 layers, hidden 576,
    vocab 49152, tied head; the plan's shapes are read from its safetensors header."""
    from safetensors import safe_open
    from transformers import AutoConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.converters.quality.smollm import smollm_dir

    directory = smollm_dir()
    config = AutoConfig.from_pretrained(directory)
    width = Width(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                  num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                  vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings)
    with safe_open(directory / "model.safetensors", "pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    return ModelPlan(name="smollm2-135m", width=width, layers=config.num_hidden_layers, tensor_shapes=shapes,
                     source=directory)


def read_through(files: list[Path], chunk_bytes: int = 16 * MIB) -> None:
    """Read every file once so that the measurements after this one all find it in the page cache."""
    for path in files:
        with open(path, "rb") as handle:
            while handle.read(chunk_bytes):
                pass


# ---- the measured child processes (run as `bench_scale.py --child ROLE JSON`) ------------------------------


def import_libraries() -> None:
    """What the import-only baseline loads; the convert child loads it too before its clock starts."""
    import safetensors  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    import converters.pipeline.driver  # noqa: F401


def child_imports(_: dict) -> dict:
    import_libraries()
    return {"seconds": 0.0}


def child_copy(params: dict) -> dict:
    source, target = Path(params["model_dir"]), Path(params["copy_dir"])
    target.mkdir()
    start = time.perf_counter()
    for path in weight_files(source):
        shutil.copyfile(path, target / path.name)
    return {"seconds": time.perf_counter() - start}


def child_convert(params: dict) -> dict:
    from converters.model.sources import ModelSourceOptions
    from converters.pipeline.driver import run_conversion
    from converters.pipeline.request import CalibrationSettings, ConversionRequest

    request = ConversionRequest(
        model=params["model_dir"],
        recipe={"backend": "te"},
        calibration=CalibrationSettings(steps=params["steps"], batch_size=params["batch_size"],
                                        seq_len=params["seq_len"]),
        measure=params.get("measure", True),
    )
    sources = ModelSourceOptions(allowed_roots=(Path(params["root"]),))
    # transformers imports a model's module lazily, on first use: without this, seconds of importing
    # would count as conversion, while the forward-only child imports it before its clock starts.
    import_libraries()
    start = time.perf_counter()
    run_conversion(request, Path(params["out_dir"]), sources)
    return {"seconds": time.perf_counter() - start}


def child_forward(params: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from converters.calibration.batches import calibration_batches

    model = AutoModelForCausalLM.from_pretrained(params["model_dir"], dtype=torch.bfloat16)
    model.eval()
    batches, _ = calibration_batches(
        AutoTokenizer.from_pretrained(params["model_dir"]), vocab_size=model.config.vocab_size,
        steps=params["steps"], batch_size=params["batch_size"], seq_len=params["seq_len"],
    )
    start = time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            model(**batch, use_cache=False)
    return {"seconds": time.perf_counter() - start}


CHILD_ROLES = {"imports": child_imports, "copy": child_copy, "convert": child_convert, "forward": child_forward}


def run_child(role: str, **params) -> ChildRun:
    wall, peak_rss, stdout = child_peak_rss([sys.executable, __file__, "--child", role, json.dumps(params)])
    os.sync()  # this process's dirty pages must not be written back while the next one is timed
    lines = [line for line in stdout.splitlines() if line.strip()]
    details = json.loads(lines[-1])
    # On a shared machine another job can slow a measurement down; the load average shows when it did.
    details["load_average"] = os.getloadavg()[0]
    return ChildRun(wall=wall, peak_rss=peak_rss, seconds=details.pop("seconds"), details=details)


# ---- one size ---------------------------------------------------------------------------------------------


def report_details(out_dir: Path) -> dict:
    """The report's ``pipeline`` block (``mode``, ``reason``; older pipelines write none) and stage timings."""
    report = json.loads((out_dir / "fp8_report.json").read_text())
    pipeline = report.get("pipeline", {})
    quality = report.get("quality") or {}
    return {"mode": pipeline.get("mode", "not reported"), "reason": pipeline.get("reason"),
            "stages": report.get("stage_seconds", {}), "quality_seconds": quality.get("seconds", 0.0),
            "forward": (report.get("calibration") or {}).get("forward")}


def fastest(runs: list[ChildRun]) -> ChildRun:
    """The fastest of repeated runs (the least disturbed by the rest of the machine), with the highest peak RSS
    of them all (memory does not get quieter)."""
    best = min(runs, key=lambda run: run.seconds)
    return dataclasses.replace(best, peak_rss=max(run.peak_rss for run in runs))


def measure_size(plan: ModelPlan, root: Path, calibration: Calibration, with_forward: bool, keep: bool,
                 repeat: int = 1) -> SizeResult:
    model_dir = root / plan.name
    started = time.perf_counter()
    if plan.source is None:
        write_model(plan, model_dir)
    else:  # a copy inside the run's directory: the only root the convert child may read from
        shutil.copytree(plan.source, model_dir)
    os.sync()
    read_through(weight_files(model_dir))
    print(f"[{plan.name}] {'wrote' if plan.source is None else 'copied'} {plan.layers} layers, "
          f"{plan.parameters:,} parameters in {time.perf_counter() - started:.0f} s", flush=True)
    calibration_params = {"steps": calibration.steps, "batch_size": calibration.batch_size,
                          "seq_len": calibration.seq_len}

    copy_dir = root / f"{plan.name}-copy"
    copy = run_child("copy", model_dir=str(model_dir), copy_dir=str(copy_dir))
    shutil.rmtree(copy_dir)
    print(f"[{plan.name}] copy-only {copy.seconds:.1f} s, load average {copy.details['load_average']:.1f}",
          flush=True)

    out_dir = root / f"{plan.name}-fp8"
    runs: dict[str, list[ChildRun]] = {"convert": [], "unmeasured": [], "forward": []}
    for round_ in range(repeat):  # interleaved, so that a slow spell of the machine hits every kind alike
        tag = f" (round {round_ + 1} of {repeat})" if repeat > 1 else ""
        convert = run_child("convert", model_dir=str(model_dir), out_dir=str(out_dir), root=str(root),
                            **calibration_params)
        convert.details.update(report_details(out_dir))
        shutil.rmtree(out_dir)
        reason = f" ({convert.details['reason']})" if convert.details["reason"] else ""
        print(f"[{plan.name}] convert {convert.seconds:.1f} s, peak RSS {convert.peak_rss / MIB:.0f} MiB, "
              f"load average {convert.details['load_average']:.1f}, pipeline mode: {convert.details['mode']}{reason}, "
              f"stages {convert.details['stages']}{tag}", flush=True)
        runs["convert"].append(convert)

        unmeasured = run_child("convert", model_dir=str(model_dir), out_dir=str(out_dir), root=str(root),
                               measure=False, **calibration_params)
        unmeasured.details.update(report_details(out_dir))
        shutil.rmtree(out_dir)
        print(f"[{plan.name}] convert with measure false {unmeasured.seconds:.1f} s, peak RSS "
              f"{unmeasured.peak_rss / MIB:.0f} MiB, load average {unmeasured.details['load_average']:.1f}, "
              f"stages {unmeasured.details['stages']}{tag}", flush=True)
        runs["unmeasured"].append(unmeasured)

        if with_forward:
            forward = run_child("forward", model_dir=str(model_dir), **calibration_params)
            print(f"[{plan.name}] forward-only {forward.seconds:.1f} s, peak RSS {forward.peak_rss / MIB:.0f} MiB, "
                  f"load average {forward.details['load_average']:.1f}{tag}", flush=True)
            runs["forward"].append(forward)
    convert, unmeasured = fastest(runs["convert"]), fastest(runs["unmeasured"])
    forward = fastest(runs["forward"]) if runs["forward"] else None
    if not keep:
        shutil.rmtree(model_dir)
    return SizeResult(plan=plan, copy=copy, convert=convert, forward=forward, unmeasured=unmeasured)


# ---- the report -------------------------------------------------------------------------------------------


def memory_ratio(result: SizeResult, baseline: int, calibration: Calibration, *, decoder_only: bool) -> float:
    plan = result.plan
    layer = plan.decoder_layer_bytes
    if not decoder_only:
        layer = max(layer, plan.embedding_bytes, plan.lm_head_bytes)
    allowed = MEMORY_TARGET_LAYERS * layer + plan.activation_bytes(calibration)
    return (result.convert.peak_rss - baseline) / allowed


def wall_ratio(result: SizeResult, run: ChildRun | None = None) -> float | None:
    if result.forward is None:
        return None
    return (run or result.convert).seconds / (result.copy.seconds + result.forward.seconds)


def measure_ratio(result: SizeResult, *, meter_only: bool = False) -> float | None:
    """Convert with measurement on over convert with ``measure: false`` (which skips the SQNR meter and the
    end-to-end quality pass); ``meter_only`` takes the quality pass's own seconds (the report's
    ``quality.seconds``) out of the measured convert, leaving the SQNR meter's cost."""
    if result.unmeasured is None:
        return None
    seconds = result.convert.seconds - (quality_seconds(result) if meter_only else 0.0)
    return seconds / result.unmeasured.seconds


def quality_seconds(result: SizeResult) -> float:
    return float(result.convert.details.get("quality_seconds") or 0.0)


def wall_ratio_without_quality(result: SizeResult) -> float | None:
    if result.forward is None:
        return None
    return (result.convert.seconds - quality_seconds(result)) / (result.copy.seconds + result.forward.seconds)


def _mib(value: float) -> str:
    # Whole MiB at the real sizes; a decimal keeps the layers of a narrow test model from reading as 0.
    return f"{value / MIB:,.0f}" if abs(value) >= 10 * MIB else f"{value / MIB:.1f}"


def process_walls(result: SizeResult) -> str:
    forward = "-" if result.forward is None else f"{result.forward.wall:.0f}"
    return f"{result.convert.wall:.0f}/{result.copy.wall:.0f}/{forward}"


def table_rows(results: list[SizeResult], baseline: int, calibration: Calibration) -> list[tuple[str, list[str]]]:
    def row(label, value):
        return label, [value(result) for result in results]

    def forward_or_skip(value):
        return lambda r: "skipped" if r.forward is None else value(r)

    def ratio_or_na(value):
        return "n/a" if value is None else f"{value:.2f}"

    return [
        row("decoder layers", lambda r: str(r.plan.layers)),
        row("parameters", lambda r: f"{r.plan.parameters:,}"),
        row("on disk (GiB)", lambda r: f"{r.plan.weight_bytes / GIB:.2f}"),
        row("largest decoder layer (MiB)", lambda r: _mib(r.plan.decoder_layer_bytes)),
        row("input embedding / lm_head (MiB)",
            lambda r: f"{_mib(r.plan.embedding_bytes)}/{_mib(r.plan.lm_head_bytes)}"),
        row("activations estimate (MiB)", lambda r: _mib(r.plan.activation_bytes(calibration))),
        row("pipeline mode (fp8_report.json)", lambda r: r.convert.details["mode"]),
        row("convert peak RSS above baseline (MiB)", lambda r: _mib(r.convert.peak_rss - baseline)),
        row("  / (3 x max(layer, embedding, head) + act)",
            lambda r: f"{memory_ratio(r, baseline, calibration, decoder_only=False):.2f}"),
        row("  / (3 x decoder layer + act)",
            lambda r: f"{memory_ratio(r, baseline, calibration, decoder_only=True):.2f}"),
        row("forward-only peak RSS above baseline (MiB)",
            forward_or_skip(lambda r: _mib(r.forward.peak_rss - baseline))),
        row("convert (s, in process)", lambda r: f"{r.convert.seconds:.1f}"),
        row("copy (s, in process)", lambda r: f"{r.copy.seconds:.1f}"),
        row("forward passes (s, in process)", forward_or_skip(lambda r: f"{r.forward.seconds:.1f}")),
        row("convert / (copy + forward)", lambda r: ratio_or_na(wall_ratio(r))),
        row("quality pass (s, report quality.seconds)", lambda r: f"{quality_seconds(r):.1f}"),
        row("  convert less quality pass / (copy + forward)", lambda r: ratio_or_na(wall_ratio_without_quality(r))),
        row("convert, measure false (s, in process)",
            lambda r: "-" if r.unmeasured is None else f"{r.unmeasured.seconds:.1f}"),
        row("  / (copy + forward)", lambda r: ratio_or_na(wall_ratio(r, r.unmeasured))),
        row("measure on / off", lambda r: ratio_or_na(measure_ratio(r))),
        row("  SQNR meter alone: (on - quality pass) / off", lambda r: ratio_or_na(measure_ratio(r, meter_only=True))),
        row("process wall convert / copy / forward (s)", process_walls),
    ]


def print_table(results: list[SizeResult], baseline: int, calibration: Calibration) -> None:
    rows = table_rows(results, baseline, calibration)
    label_width = max(len(label) for label, _ in rows)
    column_width = max(14, *(len(value) + 2 for _, values in rows for value in values))
    print()
    print(" " * label_width + "".join(result.plan.name.rjust(column_width) for result in results))
    for label, values in rows:
        print(label.ljust(label_width) + "".join(value.rjust(column_width) for value in values))


def _verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def flatness(results: list[SizeResult], baseline: int) -> str:
    results = [result for result in results if result.plan.source is None]  # one width: the random family's
    if len(results) < 2:
        return "flat: n/a (one size only)"
    shallow, deep = min(results, key=lambda r: r.plan.layers), max(results, key=lambda r: r.plan.layers)
    growth = deep.convert.peak_rss - shallow.convert.peak_rss
    layer_bytes = deep.plan.decoder_layer_bytes
    per_layer = growth / max(1, deep.plan.layers - shallow.plan.layers)
    passed = growth <= FLAT_TARGET_LAYERS * layer_bytes
    return (f"flat: convert peak RSS grows {growth / MIB:+,.0f} MiB from {shallow.plan.layers} to {deep.plan.layers} "
            f"layers ({per_layer / MIB:+.1f} MiB per added layer; one decoder layer is {layer_bytes / MIB:,.0f} MiB); "
            f"target growth <= {FLAT_TARGET_LAYERS} decoder layer: {_verdict(passed)}")


def print_targets(results: list[SizeResult], baseline: int, calibration: Calibration) -> None:
    print(f"\nbaseline: import-only peak RSS {baseline / MIB:,.0f} MiB (subtracted from every peak above)")
    print(f"targets (activations = {ACTIVATION_FACTOR} x steps x batch x seq x hidden x 2 bytes):")
    for result in results:
        broad = memory_ratio(result, baseline, calibration, decoder_only=False)
        strict = memory_ratio(result, baseline, calibration, decoder_only=True)
        ratio = wall_ratio(result)
        time_text = "n/a (no forward baseline)" if ratio is None else (
            f"{ratio:.2f} <= {WALL_TARGET}: {_verdict(ratio <= WALL_TARGET)}")
        measured, meter = measure_ratio(result), measure_ratio(result, meter_only=True)
        measure_text = "n/a" if measured is None else \
            f"{measured:.2f} <= {MEASURE_TARGET}: {_verdict(measured <= MEASURE_TARGET)} (the SQNR meter alone, " \
            f"without the quality pass: {meter:.2f})"
        print(f"  {result.plan.name}: memory / (3 x max(layer, embedding, head) + act) {broad:.2f} <= 1: "
              f"{_verdict(broad <= 1)}; / (3 x decoder layer + act) {strict:.2f} <= 1: {_verdict(strict <= 1)}; "
              f"time convert / (copy + forward) {time_text}; SQNR meter on / off {measure_text}")
    print(f"  {flatness(results, baseline)}")


# ---- command line -----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.5,1,3", help="target sizes in billions of parameters (0.5,1,3)")
    parser.add_argument("--real-smollm", action="store_true",
                        help="also run the real SmolLM2-135M (trained weights, tied head; after the --sizes models, "
                             "none with --sizes '')")
    parser.add_argument("--llama3-8b", action="store_true",
                        help="run only a Llama-3-8B-shaped model (~16 GB), without the forward-only baseline")
    parser.add_argument("--steps", type=int, help="calibration steps (default 4; 1 with --llama3-8b)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--workdir", type=Path, help="where the run's temporary directory goes (system temp)")
    parser.add_argument("--keep", action="store_true", help="keep the models and the run's directory")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run convert, convert with measure false and the forward this many times, interleaved, "
                             "and take the fastest of each (a noisy machine's figures); peak RSS is the highest")
    add_width_arguments(parser)
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    return args


def add_width_arguments(parser: argparse.ArgumentParser) -> None:
    """--hidden, --intermediate, --heads, --kv-heads, --vocab, defaulting to the benchmark family's width."""
    width = Width()
    parser.add_argument("--hidden", type=int, default=width.hidden_size)
    parser.add_argument("--intermediate", type=int, default=width.intermediate_size)
    parser.add_argument("--heads", type=int, default=width.num_attention_heads)
    parser.add_argument("--kv-heads", type=int, default=width.num_key_value_heads)
    parser.add_argument("--vocab", type=int, default=width.vocab_size)


def model_plans(args: argparse.Namespace) -> list[ModelPlan]:
    if args.llama3_8b:
        return [plan_model("llama3-8b", LLAMA3_8B_WIDTH, LLAMA3_8B_LAYERS)]
    width = Width(hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=args.heads,
                  num_key_value_heads=args.kv_heads, vocab_size=args.vocab)
    sizes = [float(size) for size in args.sizes.split(",") if size.strip()]
    plans = [plan_model(f"{size:g}B", width, layers_for(width, size)) for size in sizes]
    return plans + ([real_smollm_plan()] if args.real_smollm else [])


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(CHILD_ROLES[sys.argv[2]](json.loads(sys.argv[3]))))
        return
    args = parse_args()
    os.environ["TORCHAO_FORCE_SKIP_LOADING_SO_FILES"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    steps = args.steps if args.steps is not None else (1 if args.llama3_8b else 4)
    calibration = Calibration(steps=steps, batch_size=args.batch_size, seq_len=args.seq_len)
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench_scale-", dir=args.workdir)).resolve()
    started = time.perf_counter()
    try:
        plans = model_plans(args)
        print(f"calibration: {calibration.steps} steps of {calibration.batch_size} x {calibration.seq_len} tokens; "
              f"backend te; work directory {root}", flush=True)
        baseline = run_child("imports").peak_rss
        results = [measure_size(plan, root, calibration, with_forward=not args.llama3_8b, keep=args.keep,
                                repeat=args.repeat)
                   for plan in plans]
        print_table(results, baseline, calibration)
        print_targets(results, baseline, calibration)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
