"""tests/engines/cpu_fp8_gemm.py: torch's own CPU FP8 GEMM stands in for oneDNN's reference one where both agree."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.engines.cpu_fp8_gemm import check_agreement, onednn_runs_fp8_gemms, scaled_mm_in_torch, torch_fp8_gemms


def test_torchs_path_agrees_with_the_gemm_torch_picks_here():
    # on a CPU with AMX this compares torch's path with oneDNN's reference matmul; elsewhere both are torch's
    check_agreement(torch._scaled_mm, scaled_mm_in_torch(torch._scaled_mm))


def test_a_gemm_off_by_one_percent_fails_the_agreement_check():
    @functools.wraps(torch._scaled_mm)
    def off(*args, **kwargs):
        return torch._scaled_mm(*args, **kwargs) * 1.01

    with pytest.raises(AssertionError, match="differs from oneDNN's"):
        check_agreement(torch._scaled_mm, off)


def test_the_replacement_is_installed_only_where_onednn_would_run_it_and_undone_after():
    original = torch._scaled_mm
    with torch_fp8_gemms():
        assert (torch._scaled_mm is not original) == onednn_runs_fp8_gemms()
    assert torch._scaled_mm is original
