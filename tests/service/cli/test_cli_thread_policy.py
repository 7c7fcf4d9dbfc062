"""The CLI sets OpenMP's passive wait policy before any command loads torch, as the service's conversion children do,
and keeps a policy the user chose."""

import os
import subprocess
import sys

from service.cli.main import main


def test_the_cli_waits_passively_unless_told_otherwise(models_root, monkeypatch, capsys):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert main(["analyze", str(models_root / "llama"), "--allow-root", str(models_root), "--json"]) == 0
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert main(["analyze", str(models_root / "llama"), "--allow-root", str(models_root), "--json"]) == 0
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    capsys.readouterr()


def test_torch_is_not_loaded_before_the_policy_is_set():
    """libgomp reads the policy when torch loads: the CLI module itself must not import torch."""
    probe = "import sys, service.cli.main; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
