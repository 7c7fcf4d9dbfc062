"""The "is FP8 on?" probe: load a training artifact, run one forward and backward step, and report per Linear whether
its GEMMs ran in FP8, which recipe was active, and the step's loss next to the high-precision model's.

A Linear the artifact says is FP8 (``fp8.converted_modules`` of config.json, and the report's ``converted_modules``)
whose forward GEMM ran in high precision is an error naming it, as is the converse. torchao layers are traced at
the GEMM (:mod:`converters.backends.gemm_trace`); TE layers by their FP8 state (:mod:`converters.backends.te.probe`).
"""

from __future__ import annotations

import inspect
import json
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from converters.artifact.files import verify_manifest
from converters.artifact.layout import REPORT_FILE, read_fp8_block
from converters.backends.cpu_fp8_gemm import torch_fp8_gemms
from converters.backends.gemm_trace import GemmKind, LinearCheck, tracing_gemms
from converters.backends.loaders import load_te, load_torchao
from converters.backends.te.probe import te_step_checks
from converters.backends.te.runtime import require_te
from converters.errors import ArtifactError, ConversionError, Fp8ForgeError
from converters.model.sources import ModelSourceOptions, load_model
from converters.recipes import recipe_from_dict

__all__ = ["LinearCheck", "ProbeReport", "probe_artifact", "format_probe"]

_CPU_NOTE = ("'fp8 (emulated on CPU)': FP8 operands went into torch._scaled_mm's CPU kernel (torch's own path): the "
             "step computes with the FP8-rounded values, but no FP8 tensor core ran; run the check on the training GPU "
             "for its kernels")


@dataclass(frozen=True, kw_only=True)
class ProbeReport:
    directory: str
    backend: str
    recipe: dict[str, Any]  #: the artifact's recipe
    active: list[str]  #: what the loaded model ran (recipe objects / configs found on its layers)
    device: str
    loss: float
    reference_loss: float  #: the same step on the artifact's weights in high precision
    layers: list[LinearCheck]
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def probe_artifact(directory: str | Path, *, device: str | None = None, verify: bool = True, batch_size: int = 2,
                   seq_len: int = 32, seed: int = 0) -> ProbeReport:
    """Load the artifact in ``directory`` as its loader does and check one training step (see the module docstring).

    ``device`` defaults to ``cuda`` for TE artifacts and ``cpu`` for torchao ones. The batch is ``batch_size`` rows
    of ``seq_len`` random token ids (seeded), so TE's multiple-of-8 token rule holds at the defaults.

    Raises ArtifactError for a directory that is not an artifact (or fails its manifest), BackendUnavailableError
    for a TE artifact where CUDA or TE is missing, the loaders' errors, and ConversionError when the step fails.
    """
    directory = Path(directory).resolve()
    block = read_fp8_block(directory, _backend_of(directory))
    backend = block["backend"]
    device = device or ("cuda" if backend == "te" else "cpu")
    expected = _expected_fp8(directory, block)
    if backend == "te":
        require_te()  # before any weight is read, as load_te does
    if verify:
        verify_manifest(directory)
    # one model in memory at a time: the high-precision step first, then the FP8 model on the same batch
    reference = load_model(directory, ModelSourceOptions(allowed_roots=(directory,))).to(device)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, reference.config.vocab_size, (batch_size, seq_len), generator=generator).to(device)
    reference_loss = _training_step(reference, ids)
    del reference
    model = load_te(directory, verify=False) if backend == "te" else load_torchao(directory, verify=False,
                                                                                  device=device)
    try:
        if backend == "te":
            loss, layers, active = te_step_checks(model, ids, expected, _training_step)
        else:
            loss, layers, active = _torchao_step_checks(model, ids, expected)
    except Fp8ForgeError:
        raise
    except Exception as exc:  # torch, torchao and TE kernels raise RuntimeError/AssertionError: say where
        raise ConversionError(f"the FP8 step of {directory} failed: {type(exc).__name__}: {exc}") from exc
    errors = _mismatches(layers, model)
    if not torch.isfinite(torch.tensor(loss)):
        errors.append(f"the FP8 step's loss is not finite ({loss}); the bf16 step's is {reference_loss}")
    notes = [_CPU_NOTE] if any(layer.ran == GemmKind.FP8_EMULATED_CPU for layer in layers) else []
    if any(layer.ran == GemmKind.EMULATED for layer in layers):
        notes.append("'emulated': the recipe emulates (torchao emulate=True / kernel_preference emulated): FP8-rounded "
                     "values are dequantized and multiplied in high precision on any device")
    return ProbeReport(directory=str(directory), backend=backend, recipe=block["recipe"], active=active,
                       device=str(device), loss=loss, reference_loss=reference_loss, layers=layers, errors=errors,
                       notes=notes)


def _backend_of(directory: Path) -> str:
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ArtifactError(f"{directory}: no readable config.json ({exc}); point at an fp8forge artifact") from exc
    return str((config.get("fp8") or {}).get("backend")) if isinstance(config, dict) else "te"


def _expected_fp8(directory: Path, block: dict[str, Any]) -> set[str]:
    """Every Linear the artifact says is FP8: config.json's list and the report's (they must agree)."""
    expected = set(block.get("converted_modules") or [])
    try:
        report = json.loads((directory / REPORT_FILE).read_text(encoding="utf-8"))
        expected |= set(report.get("converted_modules") or [])
    except (OSError, UnicodeDecodeError, ValueError):
        pass  # an artifact without a readable report still says what config.json says
    return expected


def _training_step(model: nn.Module, ids: torch.Tensor) -> float:
    """One forward and backward step (eval mode: dropout off, so both models see the same computation)."""
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            takes_labels = "labels" in inspect.signature(model.forward).parameters
            output = model(input_ids=ids, labels=ids) if takes_labels else model(input_ids=ids)
            loss = getattr(output, "loss", None) if takes_labels else None
            if loss is None:  # no language-model head: a loss on the outputs
                loss = output[0].float().square().mean()
            loss.backward()
    finally:
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    return float(loss.detach())


def _torchao_step_checks(model: nn.Module, ids: torch.Tensor, expected: set[str]
                         ) -> tuple[float, list[LinearCheck], list[str]]:
    paths = [path for path, module in model.named_modules() if isinstance(module, nn.Linear)]
    # on a CPU with AMX torch would run the FP8 GEMMs as oneDNN's reference matmul, many times slower
    on_cpu = torch_fp8_gemms() if ids.device.type == "cpu" else nullcontext()
    with tracing_gemms(model, paths) as gemms, on_cpu:
        loss = _training_step(model, ids)
    layers = []
    for path in paths:
        records = tuple(gemms.get(path, ()))
        forward = [record.kind for record in records if record.phase == "forward"]
        ran = next((kind for kind in forward if kind != GemmKind.HIGH_PRECISION), forward[0] if forward else None)
        layers.append(LinearCheck(path=path, expected_fp8=path in expected, ran=ran or "did not run", gemms=records))
    return loss, layers, _torchao_active(model)


def _torchao_active(model: nn.Module) -> list[str]:
    active = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if type(module).__name__ == "Float8Linear" and config is not None:
            granularity = config.cast_config_input.scaling_granularity.value
            active.add(f"torchao Float8Linear ({granularity} scaling, emulate={config.emulate})")
    for name in ("fp8_linears", "fp8_experts"):
        note = getattr(getattr(model, name, None), "note", None)
        if note:
            active.add(f"{name}: {note}")
    return sorted(active)


def _mismatches(layers: list[LinearCheck], model: nn.Module) -> list[str]:
    why = getattr(getattr(model, "fp8_linears", None), "note", None)
    errors = []
    for layer in layers:
        detail = layer.detail or ", ".join(record.detail for record in layer.gemms if record.phase == "forward")
        if layer.expected_fp8 and not layer.ran_fp8:
            errors.append(f"{layer.path}: the artifact says FP8, but its forward GEMM ran "
                          f"{'in high precision' if layer.ran != 'did not run' else 'nowhere'} ({detail or 'no GEMM'})"
                          + (f"; the loader says: {why}" if why else ""))
        elif layer.ran_fp8 and not layer.expected_fp8:
            errors.append(f"{layer.path}: the artifact keeps it in high precision, but it ran {layer.ran} ({detail})")
    return errors


def format_probe(report: ProbeReport) -> str:
    """The report as text: one line per Linear, the losses, then errors and notes."""
    recipe = recipe_from_dict(report.recipe).library_class
    lines = [f"artifact: {report.directory}", f"recipe:   {recipe} ({report.backend} backend) on {report.device}",
             *(f"active:   {entry}" for entry in report.active),
             f"loss:     {report.loss:.6f} (FP8 step)  vs  {report.reference_loss:.6f} (high precision), "
             f"difference {report.loss - report.reference_loss:+.6f}", ""]
    width = max((len(layer.path) for layer in report.layers), default=10)
    lines.append(f"{'layer':<{width}}  {'artifact':<14}  {'forward GEMM':<21}  backward GEMMs")
    for layer in report.layers:
        mark = "" if layer.expected_fp8 == layer.ran_fp8 else "  <-- MISMATCH"
        backward = layer.ran_backward if layer.gemms else layer.detail
        lines.append(f"{layer.path:<{width}}  {'fp8' if layer.expected_fp8 else 'high precision':<14}  "
                     f"{layer.ran:<21}  {backward}{mark}")
    lines += ["", *(f"note: {note}" for note in report.notes)]
    lines += [f"ERROR: {error}" for error in report.errors]
    lines.append("FP8 is on for every layer the artifact converts." if report.ok else
                 f"{len(report.errors)} layer(s) did not run as the artifact says.")
    return "\n".join(lines)
