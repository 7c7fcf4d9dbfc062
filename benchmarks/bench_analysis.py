"""Analysis cost on a Llama-3-70B-sized config, against the cost of merely building the meta model.

Prints two ratios, each against a baseline measured in the same run:
  analysis / build-meta-model   (target: < 0.20, i.e. analysis adds under 20% to the build)
  `fp8forge analyze` wall time / bare `python -c "import torch, transformers"`
and checks that no weight file is opened (with strace, against a decoy model.safetensors placed beside the
config) and that the CLI imports neither torchao nor the service stack.

Run: .venv/bin/python benchmarks/bench_analysis.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def in_process(directory: Path, repeat: int) -> tuple[float, float, dict]:
    from converters.analysis.eligibility import analyze_model
    from converters.model.sources import ModelSourceOptions, build_meta_model, load_config

    sources = ModelSourceOptions(allowed_roots=(directory.parent,))
    config = load_config(directory, sources)
    build_meta_model(config, sources)  # warm caches shared by both measurements
    builds, analyses = [], []
    for _ in range(repeat):
        build_time, model = timed(lambda: build_meta_model(config, sources))
        analysis_time, report = timed(lambda model=model: analyze_model(model))
        builds.append(build_time)
        analyses.append(analysis_time)
    return statistics.median(builds), statistics.median(analyses), report


def wall(argv: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    with tempfile.TemporaryDirectory() as root:
        directory = Path(root) / "llama-3-70b-config"
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(LLAMA_70B))
        build, analysis, report = in_process(directory, args.repeat)
        totals = report["totals"]
        print(f"model: Llama-3-70B-sized config, {totals['model_parameters'] / 1e9:.1f}B parameters, "
              f"{totals['linear_layers']} Linears, {totals['eligible_layers']} eligible")
        print(f"build meta model (baseline): {build * 1000:8.1f} ms")
        print(f"analysis:                    {analysis * 1000:8.1f} ms")
        print(f"analysis / build ratio:      {analysis / build:8.3f}  (target < 0.20 added, i.e. "
              f"{(build + analysis) / build:.3f}x the build)")

        bare = wall([sys.executable, "-c", "import torch, transformers"], args.repeat)
        cli = [sys.executable, "-m", "service.cli.main", "analyze", str(directory), "--allow-root", root, "--json"]
        analyze_wall = wall(cli, args.repeat)
        print(f"bare `import torch, transformers` (baseline): {bare:6.2f} s")
        print(f"`fp8forge analyze` wall:                      {analyze_wall:6.2f} s")
        print(f"analyze / bare import ratio:                  {analyze_wall / bare:6.2f}")

        print(weight_file_check(directory, root, cli))
        probe = (
            "import sys\nfrom service.cli.main import main\n"
            f"main(['analyze', {str(directory)!r}, '--allow-root', {root!r}, '--json'])\n"
            "mods = [m for m in ('torchao', 'fastapi', 'uvicorn', 'sqlalchemy') if sys.modules.get(m) is not None]\n"
            "print(f'heavy modules imported by analyze: {mods}', file=sys.stderr)"
        )
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
        print(result.stderr.strip().splitlines()[-1])


def weight_file_check(directory: Path, root: str, cli: list[str]) -> str:
    """Trace every file the analyze CLI opens, with a decoy weight file present."""
    import shutil

    from safetensors.torch import save_file

    if shutil.which("strace") is None:
        return "weight files opened: not checked (strace is not installed)"
    import torch

    save_file({"decoy": torch.zeros(4)}, directory / "model.safetensors")
    trace = Path(root) / "trace.log"
    subprocess.run(["strace", "-f", "-e", "trace=open,openat", "-o", str(trace), *cli], check=True,
                   capture_output=True)
    opened = [line for line in trace.read_text().splitlines()
              if ".safetensors" in line and str(directory) in line]
    return f"weight files opened by analyze: {len(opened)}"


if __name__ == "__main__":
    main()
