"""A new user's first steps (issue 35, item 5): names the CLI prints are names it takes, one list of requantize
targets, help that says defaults without splitting names, messages that say what to do instead."""

from __future__ import annotations

import json

import pytest

from service.cli.main import build_parser, main

FAST = ("--calib-steps", "1", "--calib-batch-size", "1", "--calib-seq-len", "16", "--no-progress", "--no-measure")


def run_cli(capsys, *argv):
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _help(capsys, *command: str) -> str:
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    return capsys.readouterr().out


def test_requantize_help_lists_every_target_its_error_lists(capsys):
    from converters.modelfree.targets import MODEL_FREE_TARGETS

    text = " ".join(_help(capsys, "requantize").split())
    assert all(name in text for name in MODEL_FREE_TARGETS), text
    code, _, err = run_cli(capsys, "requantize", "demo/tiny-llama", "--out", "x", "--to", "fp7")
    assert code == 2 and f"model-free targets: {', '.join(MODEL_FREE_TARGETS)}" in err


def test_help_keeps_names_whole_and_states_defaults_and_an_example(capsys):
    parser = build_parser()
    commands = next(action for action in parser._actions if action.dest == "command").choices
    for name in commands:
        text = _help(capsys, name)
        lines = text.splitlines()
        # a name such as compressed-tensors-fp8-dynamic or --calib-batch-size never broken at a hyphen
        assert not any(line.rstrip().endswith("-") and not line.rstrip().endswith(" -") for line in lines), (name, text)
        assert "example:" in text, name
    text = " ".join(_help(capsys, "convert").split())
    assert "compressed-tensors-fp8-dynamic" in text and "(default: 16)" in text  # --calib-steps


def test_convert_takes_the_recipe_names_compare_prints(demo_cache, tmp_path, capsys):
    code, out, err = run_cli(capsys, "convert", "demo/tiny-llama", "--out", tmp_path / "out", "--recipe",
                             "te-current", *FAST)
    assert code == 0, err
    recipe = json.loads((tmp_path / "out" / "fp8_report.json").read_text())["recipe"]
    assert (recipe["backend"], recipe["scaling"]) == ("te", "current")
    code, _, err = run_cli(capsys, "convert", "demo/tiny-llama", "--out", tmp_path / "o2", "--recipe", "te-fp7", *FAST)
    assert code == 2 and "te-current" in err and "te-fp7" in err  # names the names it takes


def test_check_on_a_plain_model_says_what_it_is_and_what_to_run(demo_cache, capsys):
    import os
    from pathlib import Path

    code, _, _ = run_cli(capsys, "analyze", "demo/tiny-llama")
    model = Path(os.environ["XDG_CACHE_HOME"]) / "fp8forge" / "demo-models" / "tiny-llama"
    code, _, err = run_cli(capsys, "check", model)
    assert code == 2
    assert "None" not in err and "plain model" in err and "fp8forge convert" in err and "--backend ao" in err
