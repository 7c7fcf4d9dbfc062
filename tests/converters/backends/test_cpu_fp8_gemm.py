"""converters/backends/cpu_fp8_gemm.py: torch's own CPU FP8 GEMM stands in for oneDNN's only where both agree."""

from __future__ import annotations

import functools

import pytest
import torch

from converters.backends.cpu_fp8_gemm import disagreement, onednn_runs_fp8_gemms, scaled_mm_in_torch, torch_fp8_gemms


def test_torchs_path_agrees_with_onednns_reference_matmul():
    if not onednn_runs_fp8_gemms():
        pytest.skip("torch runs its own CPU path for FP8 GEMMs here (no AMX): there is no second GEMM to compare")
    assert disagreement(torch._scaled_mm, scaled_mm_in_torch(torch._scaled_mm)) is None


def test_a_gemm_off_by_one_percent_disagrees():
    @functools.wraps(torch._scaled_mm)
    def off(*args, **kwargs):
        return torch._scaled_mm(*args, **kwargs) * 1.01

    assert "differs from oneDNN's (torch.float32 output)" in disagreement(torch._scaled_mm, off)


def test_the_replacement_is_installed_only_where_onednn_would_run_it_and_undone_after():
    original = torch._scaled_mm
    with torch_fp8_gemms():
        assert (torch._scaled_mm is not original) == onednn_runs_fp8_gemms()
    assert torch._scaled_mm is original


def test_where_the_sample_disagrees_onednn_stays_and_a_warning_says_so(monkeypatch, caplog):
    from converters.backends import cpu_fp8_gemm

    monkeypatch.setattr(cpu_fp8_gemm, "onednn_runs_fp8_gemms", lambda: True)
    monkeypatch.setattr(cpu_fp8_gemm, "disagreement", lambda *gemms: "torch's CPU FP8 GEMM differs from oneDNN's")
    original = torch._scaled_mm
    with caplog.at_level("WARNING", logger=cpu_fp8_gemm.__name__), torch_fp8_gemms():
        assert torch._scaled_mm is original
    assert "FP8 GEMMs stay on oneDNN's reference matmul" in caplog.text
