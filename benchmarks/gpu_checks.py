"""The GPU checks that fit a lent GPU machine's lease, prepared as one run: what issue #38 asks of a GPU worker.

The device machine (an H200, 16 cores; docs: the device tool) reaches nothing outside it and has its own image:
python3 with torch, safetensors and numpy, which is all ``converters.modelfree`` imports: steps 1-3 need nothing more.
Steps 4-5 run calibrated jobs, which need the project's torchao and transformers (carried as wheels, below):

  1. bytes: the ~1 GB checkpoint of bench_requantize.py converted to each format on the CPU and with
     ``device="cuda"``; every weight file and the index must be the CPU's, byte for byte;
  2. speed: an 8B-shaped checkpoint (Llama-3-8B's sizes, ~16 GB of bf16 random weights in 17 shards) copied with
     ``cp -r`` (the limit: reading and writing those bytes) and requantized to each format with ``device="cuda"``,
     one worker and several, without the report's SQNR and with it: source GB/s of each run (target >= 1 GB/s),
     its start (imports) apart, as in bench_requantize.py.

  3. gptq: NVFP4 GPTQ rounding (``nvfp4_weight_rounding: gptq``, converters.serving.nvfp4_gptq) of an 8B
     ``down_proj``-shaped weight on the CPU and on the device from the same Hessian: the share of codes that agree,
     each one's output error on the Hessian's inputs, and the seconds (a GPU job rounds on its GPU).
  4. job: one calibrated job (``converters.convert``: torchao backend, layer-sequential calibration, GPTQ-rounded
     NVFP4, compressed-tensors FP8 with FP8 KV scales, the report's quality pass) on a random Llama, run twice in
     child processes: once with the GPU hidden (CPU) and once on it (a job takes the GPU whenever torch sees one);
     then the same with nearest rounding, and without the measurements (a failing variant is a result: the next
     still runs). Compared: each export's tensors (bytes the same, or the largest relative difference of scales,
     the share of FP8 / packed FP4 bytes that agree), the report's quality figures, the seconds (the image's
     transformers is older than the project's floor: ``--download-wheels``).
  5. resume: the first job of step 4 as one rank of ``python -m converters.distributed`` (NCCL on a GPU), killed
     with SIGKILL once layer 1 is recorded (tests/converters/distributed/killed_rank.py), then started again: it must
     resume at layer 2 and write the one-process job's exports, tensor for tensor.

What does not run there, and why: vLLM's CUDA build (issue #36's GPU rows) is not in the image and its wheels are
far over what a call may carry; an 8B calibrated job needs the 8B's real weights, which nothing can fetch there.

    # here, a rehearsal of the same steps on the CPU at a small size (no GPU on this machine):
    .venv/bin/python benchmarks/gpu_checks.py --device cpu --small --workdir /tmp/gpu-checks
    # here, the wheels steps 4 and 5 need there (this venv's versions; ~25 MB, in a git-ignored folder):
    .venv/bin/python benchmarks/gpu_checks.py --download-wheels .whl
    # on the lent machine, in one call (the start apart), stopping new runs after 7 minutes:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 PYTHONUNBUFFERED=1 python3 benchmarks/gpu_checks.py --budget-s 420 \
        --json $OUT/gpu_checks.json

Results (the printed table and the JSON) go to a dated file under docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_requantize import FORMATS, CheckpointShape, build_model  # noqa: E402

#: Llama-3-8B's sizes: hidden 4096, 14336 inner, 32 layers, 32 heads, 8 KV heads, 128256 tokens (~16 GB in bf16)
LLAMA_8B = CheckpointShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256, shards=17)
#: the rehearsal's "large" checkpoint: the 8B's widths, 2 layers and a small vocabulary (~1 GB)
REHEARSAL = CheckpointShape(hidden=4096, intermediate=14336, layers=2, heads=32, kv_heads=8, vocab=32000, shards=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="where the casts run (cpu: a rehearsal here)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp8forge-gpu-checks"))
    parser.add_argument("--small", action="store_true", help="the speed step on a ~1 GB checkpoint, not the 8B")
    parser.add_argument("--workers", type=int, default=min(8, max(2, (os.cpu_count() or 2) // 2)),
                        help="the several-workers runs' process count (default: half the cores, at most 8)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, of: " + ", ".join(FORMATS))
    parser.add_argument("--skip-bytes", action="store_true")
    parser.add_argument("--skip-gptq", action="store_true")
    parser.add_argument("--skip-job", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-resume", action="store_true")
    parser.add_argument("--jobs", default=",".join(JOB_VARIANTS), help="comma-separated job variants of step 4")
    parser.add_argument("--download-wheels", type=Path, metavar="DIR",
                        help="download (here) the wheels the job steps need on the device into DIR, then stop")
    parser.add_argument("--job-child", nargs=3, metavar=("MODEL", "OUT", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--sqnr-only", action="store_true", help="of the speed runs, only those with the SQNR on")
    parser.add_argument("--json", type=Path, help="write every figure here (rewritten after each run)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no run after this many seconds from the start (a lease's time is short: what ran "
                             "is kept, what did not is listed as skipped)")
    args = parser.parse_args()
    if args.download_wheels:
        _download_wheels(args.download_wheels)
        return
    if args.job_child:
        _job_child(Path(args.job_child[0]), Path(args.job_child[1]), args.job_child[2])
        return
    formats = [name for name in args.formats.split(",") if name]
    started = time.perf_counter()
    import torch

    from converters.modelfree import convert_model_free  # the start's imports, before any clock below

    environment = {"torch": torch.__version__, "cpus": os.cpu_count(), "device": args.device,
                   "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                   "imports_s": round(time.perf_counter() - started, 2)}
    print("environment:", json.dumps(environment), flush=True)
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    results: dict = {"environment": environment, "skipped": []}
    ledger = _Ledger(results, args.json, started, args.budget_s)
    try:
        if not args.skip_job and ledger.may_start("job"):
            results["job"] = _job(args.workdir, args.device, args.jobs.split(","), small=args.small,
                                  ledger=ledger)
            ledger.save()
        if not args.skip_resume and ledger.may_start("resume"):
            results["resume"] = _resume(args.workdir, args.device, small=args.small)
            ledger.save()
        if not args.skip_gptq and ledger.may_start("gptq"):
            results["gptq"] = _gptq(args.device, small=args.small)
            ledger.save()
        if not args.skip_bytes:
            results["bytes"] = _same_bytes(convert_model_free, args.workdir, formats, args.device, ledger)
        size = REHEARSAL if args.small else LLAMA_8B
        if not args.skip_speed:
            results["speed"] = _speed(convert_model_free, args.workdir, size, formats, args.device, args.workers,
                                      ledger, sqnr_only=args.sqnr_only)
    finally:
        ledger.save()
        shutil.rmtree(args.workdir, ignore_errors=True)
    print(f"all checks: {time.perf_counter() - started:.0f} s", flush=True)


class _Ledger:
    """The results so far, written after every run: a run killed at the lease's limit keeps what finished."""

    def __init__(self, results: dict, path: Path | None, started: float, budget_s: float | None):
        self.results, self.path, self.started, self.budget_s = results, path, started, budget_s

    def save(self) -> None:
        if self.path:
            self.path.write_text(json.dumps(self.results, indent=2))

    def may_start(self, what: str) -> bool:
        """False (and ``what`` listed as skipped) once the budget is spent."""
        if self.budget_s is None or time.perf_counter() - self.started < self.budget_s:
            return True
        self.results["skipped"].append(what)
        print(f"skipped (budget of {self.budget_s:.0f} s spent): {what}", flush=True)
        self.save()
        return False


def _same_bytes(convert, workdir: Path, formats: list[str], device: str, ledger: _Ledger) -> dict:
    """Each format written on the CPU and on ``device``: are the weight files and the index the same bytes?"""
    source = workdir / "bytes-source"
    build_model(source)
    rows = ledger.results.setdefault("bytes", {})
    for fmt in formats:
        if not ledger.may_start(f"bytes {fmt}"):
            continue
        seconds = {}
        cpu_out, device_out = workdir / f"bytes-{fmt}-reference", workdir / f"bytes-{fmt}-device"
        try:
            for role, where, out in (("cpu", "cpu", cpu_out), ("device", device, device_out)):
                clock = time.perf_counter()
                convert(source, out, fmt, exclude=("lm_head",), skip_first_last=False, measure=False, device=where)
                seconds[role] = round(time.perf_counter() - clock, 2)
        except Exception as error:  # noqa: BLE001 - one format's failure is a result; the others still run
            rows[fmt] = {"error": f"{type(error).__name__}: {error}"}
            print(f"bytes {fmt:32s} FAILED: {rows[fmt]['error']}", flush=True)
            shutil.rmtree(cpu_out, ignore_errors=True)
            shutil.rmtree(device_out, ignore_errors=True)
            ledger.save()
            continue
        compared = sorted(path.name for path in cpu_out.iterdir()
                          if path.suffix == ".safetensors" or path.name == "model.safetensors.index.json")
        differ = [name for name in compared if (cpu_out / name).read_bytes() != (device_out / name).read_bytes()]
        rows[fmt] = {"files": len(compared), "differ": differ, "seconds": seconds,
                     "tensors_differ": {name: _tensors_differ(cpu_out / name, device_out / name)
                                        for name in differ if name.endswith(".safetensors")}}
        print(f"bytes {fmt:32s} {len(compared)} files, "
              f"{'the same on cpu and ' + device if not differ else 'DIFFERENT: ' + ', '.join(differ)}  "
              f"(cpu {seconds['cpu']} s, {device} {seconds['device']} s)", flush=True)
        shutil.rmtree(cpu_out)
        shutil.rmtree(device_out, ignore_errors=True)
        ledger.save()
    shutil.rmtree(source)
    return rows


def _gptq(device: str, *, small: bool) -> dict:
    """GPTQ's codes of one weight on the CPU and on ``device`` from the same Hessian (inputs with uneven column
    energies, fewer rows than columns as in a job's calibration): agreement, output error, seconds."""
    import torch

    from converters.serving.nvfp4 import quantize_nvfp4
    from converters.serving.nvfp4_gptq import dequantize_codes, gptq_codes

    rows, columns, tokens = (512, 1024, 768) if small else (4096, 14336, 8192)
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(rows, columns, generator=generator) * 0.02).to(torch.bfloat16)
    inputs = torch.randn(tokens, columns, generator=generator) * torch.rand(columns, generator=generator) * 3
    hessian = (inputs.double().T @ inputs.double()) * (2 / tokens)
    _, scale, scale_global = quantize_nvfp4(weight, float(weight.float().abs().max()))
    result = {"shape": [rows, columns], "calibration_rows": tokens}
    codes = {}
    for where in ("cpu", device):
        clock = time.perf_counter()
        codes[where] = gptq_codes(weight.to(where), hessian.to(where), scale.to(where), scale_global.to(where),
                                  act_order=True).cpu()
        result[f"{where}_s"] = round(time.perf_counter() - clock, 2)
        error = inputs @ (dequantize_codes(codes[where], scale, scale_global) - weight.float()).T
        result[f"{where}_output_error"] = float(error.square().mean())
    result["codes_agree"] = float((codes["cpu"] == codes[device]).float().mean())
    print(f"gptq {rows}x{columns}: codes agree {result['codes_agree']:.4%}; output error cpu "
          f"{result['cpu_output_error']:.4g}, {device} {result[f'{device}_output_error']:.4g}; "
          f"cpu {result['cpu_s']} s, {device} {result[f'{device}_s']} s", flush=True)
    return result


#: the jobs of step 4, each on the CPU and on the device: what a GPU worker runs for a serving user who asks for
#: GPTQ NVFP4 and FP8 with FP8 KV scales, then the same with less (a failure of the first still tells what works)
JOB_VARIANTS = {
    "gptq-kv-measured": {"recipe": {"backend": "ao", "nvfp4_weight_scales": "four_over_six",
                                    "nvfp4_weight_rounding": "gptq"},
                         "serving_formats": ["compressed-tensors-fp8", "nvfp4"], "kv_cache": "fp8"},
    "nearest-kv-measured": {"recipe": {"backend": "ao"}, "serving_formats": ["compressed-tensors-fp8", "nvfp4"],
                            "kv_cache": "fp8"},
    "nearest-unmeasured": {"recipe": {"backend": "ao"}, "serving_formats": ["compressed-tensors-fp8", "nvfp4"],
                           "measure": False},
    # a Qwen2-MoE: the experts' own calibration walk and grouped casts
    "moe-kv-measured": {"model": "qwen2_moe", "recipe": {"backend": "ao"},
                        "serving_formats": ["compressed-tensors-fp8", "nvfp4"], "kv_cache": "fp8"},
    # GPTQ of the expert matrices (each expert from its routed tokens) on the GPU against the CPU
    "moe-gptq": {"model": "qwen2_moe", "recipe": {"backend": "ao", "nvfp4_weight_rounding": "gptq"},
                 "serving_formats": ["nvfp4"], "measure": False},
    # TransformerEngine's recipe where the GPU has no TE installed (the image has none): what a user is told
    "te-without-te": {"recipe": {"backend": "te"}, "serving_formats": ["compressed-tensors-fp8"]},
}


def _job_child(model: Path, out: Path, variant: str) -> None:
    """One job, in its own process (where torch sees the GPU or not), timed; its seconds go to ``out``'s side file."""
    import torch

    from converters import convert, local_sources
    from converters.pipeline.request import CalibrationSettings

    clock = time.perf_counter()
    job = {key: value for key, value in JOB_VARIANTS[variant].items() if key != "model"}
    convert(str(model), out, **job, sources=local_sources(model.parent),
            calibration=CalibrationSettings(steps=8, batch_size=2, seq_len=128))
    seconds = round(time.perf_counter() - clock, 2)
    (out.parent / f"{out.name}.seconds.json").write_text(json.dumps(
        {"seconds": seconds, "cuda": torch.cuda.is_available()}))


def _job(workdir: Path, device: str, variants: list[str], *, small: bool, ledger: _Ledger) -> dict:
    """Step 4: each job variant on the CPU and on ``device`` (the GPU hidden from the first child)."""
    from converters.model.demo import build_tiny_llama

    models = {"llama": build_tiny_llama(workdir / "job" / "llama", hidden_size=256 if small else 1024, layers=4)}
    rows = ledger.results.setdefault("job", {})
    for variant in variants:
        job = JOB_VARIANTS[variant]
        if not ledger.may_start(f"job {variant}"):
            continue
        if job.get("model", "llama") not in models:
            models[job["model"]] = _tiny_moe(job["model"], workdir / "job" / job["model"])
        model = models[job.get("model", "llama")]
        outs, failed = {}, {}
        for role in ("cpu", "device"):  # "device" with --device cpu (a rehearsal) is a second CPU run
            env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if role == "cpu" or device == "cpu" else {}))
            outs[role] = workdir / "job" / f"{variant}-{role}"
            done = subprocess.run([sys.executable, __file__, "--job-child", str(model), str(outs[role]), variant],
                                  env=env, capture_output=True, text=True)
            if done.returncode:
                failed[role] = done.stderr[-3000:]
                print(f"job {variant} on {role} FAILED:\n{failed[role]}", flush=True)
        rows[variant] = {"failed": failed} if failed else _compare_jobs(outs["cpu"], outs["device"],
                                                                        JOB_VARIANTS[variant]["serving_formats"])
        print(f"job {variant}:", json.dumps(rows[variant], indent=1), flush=True)
        ledger.save()
    return rows


def _resume(workdir: Path, device: str, *, small: bool) -> dict:
    """Step 5: a rank killed after layer 1 and started again writes the one-process job's exports."""
    from converters.model.demo import build_tiny_llama
    from converters.pipeline.request import CalibrationSettings, ConversionRequest

    root = workdir / "resume"
    model = build_tiny_llama(root / "llama", hidden_size=256 if small else 1024, layers=4)
    variant = "gptq-kv-measured"
    job = {key: value for key, value in JOB_VARIANTS[variant].items() if key != "model"}
    request = root / "request.json"
    request.write_text(json.dumps(ConversionRequest(
        model=str(model), calibration=CalibrationSettings(steps=8, batch_size=2, seq_len=128),
        **{**job, "serving_formats": tuple(job["serving_formats"])}).to_dict()))
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # carried wheels stay on it
    env = dict(os.environ, PYTHONPATH=path, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}))
    one = root / "one"
    subprocess.run([sys.executable, __file__, "--job-child", str(model), str(one), variant], env=env, check=True)
    out, codes = root / "ranked", []
    rank = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    for script, extra in ((["tests/converters/distributed/killed_rank.py"], {"KILL_AFTER_LAYER": "1"}),
                          (["-m", "converters.distributed"], {})):
        done = subprocess.run([sys.executable, *script, "--request", str(request), "--out", str(out),
                               "--allow-root", str(root)], cwd=ROOT, env={**rank, **extra}, capture_output=True,
                              text=True)
        codes.append(done.returncode)
        if done.returncode not in (0, -9):
            print(f"resume: rank exited {done.returncode}:\n{done.stderr[-3000:]}", flush=True)
    result: dict = {"exit_codes": codes}
    if codes == [-9, 0]:
        report = json.loads((out / "fp8_report.json").read_text())
        result["resumed_at_layer"] = report["calibration"]["forward"].get("resumed_at_layer")
        result["device_in_report"] = report["pipeline"]["device"]
        result["exports"] = {fmt: _export_agreement(one / "serving" / fmt, out / "serving" / fmt)
                             for fmt in job["serving_formats"]}
    print("resume:", json.dumps(result, indent=1), flush=True)
    return result


#: what a calibrated job imports beyond the device image's packages (its torch, numpy, safetensors, tokenizers,
#: pyyaml, ...): the project's torchao, and transformers with what its release needs newer than the image's
DEVICE_WHEELS = ("transformers", "torchao", "huggingface_hub", "kernels", "httpx2", "httpcore2", "truststore",
                 "hf-xet", "click", "tomlkit")


def _download_wheels(directory: Path) -> None:
    """:data:`DEVICE_WHEELS` at this environment's versions, for the device's Python 3.12 on x86-64."""
    from importlib.metadata import version

    pins = [f"{name}=={version(name)}" for name in DEVICE_WHEELS]
    platforms = [arg for tag in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_24", "manylinux_2_17",
                                 "manylinux2014", "manylinux1") for arg in ("--platform", f"{tag}_x86_64")]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", *platforms, "--platform", "any", "-d", str(directory), *pins],
                   check=True)
    print(f"{len(pins)} wheels in {directory}: {', '.join(pins)}", flush=True)


def _tiny_moe(name: str, directory: Path) -> Path:
    """The suite's tiny MoE model ``name`` (tests/models.py), saved with the demo's tokenizer."""
    from tests.models import save_tiny_moe  # ROOT is on the path

    return save_tiny_moe(name, directory)


def _compare_jobs(cpu_out: Path, device_out: Path, formats: list[str]) -> dict:
    roles = (("cpu", cpu_out), ("device", device_out))
    reports = {role: json.loads((out / "fp8_report.json").read_text()) for role, out in roles}
    result: dict = {"seconds": {}, "quality": {}, "exports": {}}
    for role, out in roles:
        side = json.loads((out.parent / f"{out.name}.seconds.json").read_text())
        result["seconds"][role] = side["seconds"]
        result.setdefault("ran_on_cuda", {})[role] = side["cuda"]
        quality = reports[role]["quality"]
        if quality.get("measured"):
            result["quality"][role] = {name: {"perplexity": row.get("perplexity"), "kl_mean": row.get("kl_mean")}
                                       for name, row in [("training", quality["training"]),
                                                         *quality["serving"].items()]}
    result["device_in_report"] = {role: report["pipeline"]["device"] for role, report in reports.items()}
    for fmt in formats:
        result["exports"][fmt] = _export_agreement(cpu_out / "serving" / fmt, device_out / "serving" / fmt)
    return result


def _export_agreement(cpu_dir: Path, device_dir: Path) -> dict:
    """Per tensor kind of two exports of one job: how many tensors are the same bytes; of those that differ, the
    largest relative difference (scales, high-precision weights) or the share of bytes that agree (FP8 / packed FP4
    codes)."""
    import torch
    from safetensors import safe_open

    kinds: dict[str, dict] = {}
    for cpu_file in sorted(cpu_dir.glob("*.safetensors")):
        with safe_open(cpu_file, "pt") as cpu, safe_open(device_dir / cpu_file.name, "pt") as other:
            for key in cpu.keys():
                a, b = cpu.get_tensor(key).reshape(-1), other.get_tensor(key).reshape(-1)
                kind = kinds.setdefault(key.rsplit(".", 1)[-1], {"tensors": 0, "same_bytes": 0})
                kind["tensors"] += 1
                if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                    kind["same_bytes"] += 1
                elif a.dtype in (torch.uint8, torch.float8_e4m3fn) and a.numel() > 64:
                    agree = float((a.view(torch.uint8) == b.view(torch.uint8)).float().mean())
                    kind["least_bytes_agree"] = min(kind.get("least_bytes_agree", 1.0), round(agree, 5))
                else:
                    relative = float(((a.float() - b.float()).abs() / a.float().abs().clamp_min(1e-12)).max())
                    kind["largest_relative_difference"] = max(kind.get("largest_relative_difference", 0.0),
                                                              relative)
    return kinds


def _tensors_differ(cpu_file: Path, device_file: Path, shown: int = 6) -> list[dict]:
    """Which tensors of two same-named shards differ, and in how many elements (the first ``shown``)."""
    import torch
    from safetensors import safe_open

    rows = []
    with safe_open(cpu_file, "pt") as cpu, safe_open(device_file, "pt") as device:
        if sorted(cpu.keys()) != sorted(device.keys()):
            return [{"keys": "different", "cpu_only": sorted(set(cpu.keys()) - set(device.keys()))[:shown],
                     "device_only": sorted(set(device.keys()) - set(cpu.keys()))[:shown]}]
        for key in sorted(cpu.keys()):
            a, b = cpu.get_tensor(key), device.get_tensor(key)
            if a.dtype != b.dtype or a.shape != b.shape:
                rows.append({"tensor": key, "cpu": f"{a.dtype} {list(a.shape)}",
                             "device": f"{b.dtype} {list(b.shape)}"})
            else:
                differing = (a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum().item()
                if differing:
                    rows.append({"tensor": key, "dtype": str(a.dtype), "bytes_differ": differing,
                                 "of": a.numel() * a.element_size()})
            if len(rows) >= shown:
                break
    if not rows:
        rows.append({"tensors": "all equal: the header or padding differs"})
    return rows


def _speed(convert, workdir: Path, size: CheckpointShape, formats: list[str], device: str, workers: int,
           ledger: _Ledger, *, sqnr_only: bool = False) -> dict:
    """The copy, then each format with ``workers`` and one worker without the SQNR, then with it: source GB/s.

    Every format's headline run (several workers, no SQNR) comes before any format's other runs, so a short lease
    still gives each format its figure."""
    source = workdir / "speed-source"
    clock = time.perf_counter()
    total = build_model(source, size)
    print(f"speed: checkpoint {total / 1e9:.2f} GB in {size.shards} shards, built in "
          f"{time.perf_counter() - clock:.0f} s", flush=True)
    out = workdir / "speed-out"
    clock = time.perf_counter()
    subprocess.run(["cp", "-r", str(source), str(out)], check=True)
    copy_s = time.perf_counter() - clock
    shutil.rmtree(out)
    print(f"copy (cp -r)                          {copy_s:6.2f} s  {total / 1e9 / copy_s:6.2f} GB/s", flush=True)
    rows = ledger.results.setdefault("speed", {})
    rows.update({"checkpoint_gb": round(total / 1e9, 3), "copy_s": round(copy_s, 3), "runs": []})
    ledger.save()
    plan = [] if sqnr_only else [(fmt, workers, False) for fmt in formats] + [(fmt, 1, False) for fmt in formats]
    plan += [(fmt, workers, True) for fmt in formats]
    for fmt, count, measure in plan:
        if ledger.may_start(f"speed {fmt} workers {count} sqnr {'on' if measure else 'off'}"):
            clock = time.perf_counter()
            try:
                convert(source, out, fmt, exclude=("lm_head",), skip_first_last=False, measure=measure,
                        device=device, workers=count)
            except Exception as error:  # noqa: BLE001 - recorded; the other runs still run
                rows["runs"].append({"format": fmt, "workers": count, "measure": measure,
                                     "error": f"{type(error).__name__}: {error}"})
                print(f"{fmt:32s} workers {count} FAILED: {error}", flush=True)
                shutil.rmtree(out, ignore_errors=True)
                continue
            seconds = time.perf_counter() - clock
            shutil.rmtree(out)
            row = {"format": fmt, "workers": count, "measure": measure, "seconds": round(seconds, 3),
                   "source_gb_per_s": round(total / 1e9 / seconds, 3), "over_copy": round(seconds / copy_s, 2)}
            rows["runs"].append(row)
            ledger.save()
            print(f"{fmt:32s} workers {count} sqnr {'on ' if measure else 'off'} {seconds:6.2f} s  "
                  f"{row['source_gb_per_s']:6.2f} GB/s  {row['over_copy']:5.2f}x the copy", flush=True)
    shutil.rmtree(source)
    return rows


if __name__ == "__main__":
    main()
