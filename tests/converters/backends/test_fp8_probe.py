"""The "is FP8 on?" probe (`fp8forge check`): one real step of a real artifact, traced at torchao's GEMMs."""

import json
import shutil

import pytest

from converters.artifact.files import write_manifest
from converters.backends.gemm_trace import GemmKind
from converters.backends.probe import format_probe, probe_artifact
from service.cli.main import main

SMALL = ["--calib-steps", "2", "--calib-seq-len", "32", "--no-progress"]


def convert(root, out, recipe, tmp_path):
    path = tmp_path / f"{out.name}.json"
    path.write_text(json.dumps(recipe))
    assert main(["convert", str(root / "llama"), "--out", str(out), "--allow-root", str(root), "--recipe", str(path),
                 *SMALL]) == 0
    return out


@pytest.fixture(scope="module")
def tensorwise(llama_root, tmp_path_factory):
    return convert(llama_root, llama_root / "ao-tensorwise", {"backend": "ao"}, tmp_path_factory.mktemp("r"))


def test_good_artifact_runs_every_converted_gemm_in_fp8_emulated_on_cpu(tensorwise):
    report = probe_artifact(tensorwise)
    converted = json.loads((tensorwise / "config.json").read_text())["fp8"]["converted_modules"]
    assert report.ok, report.errors
    by_path = {layer.path: layer for layer in report.layers}
    assert sorted(path for path, layer in by_path.items() if layer.ran_fp8) == sorted(converted)
    for path in converted:  # forward, dgrad and wgrad: FP8 operands into torch._scaled_mm's CPU kernel
        assert [record.kind for record in by_path[path].gemms] == [GemmKind.FP8_EMULATED_CPU] * 3
        assert "float8_e4m3fn" in by_path[path].gemms[0].detail and "_scaled_mm on CPU" in by_path[path].gemms[0].detail
    assert by_path["lm_head"].ran == GemmKind.HIGH_PRECISION
    assert any("emulated on CPU" in note for note in report.notes)
    assert any("tensorwise scaling, emulate=False" in active for active in report.active)
    assert report.loss != report.reference_loss  # the FP8 casts change the numbers, a little
    assert abs(report.loss - report.reference_loss) < 0.02 * report.reference_loss


def test_broken_artifact_with_one_layer_left_in_bf16_is_caught_by_name(tensorwise, tmp_path, capsys):
    broken = shutil.copytree(tensorwise, tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    config["fp8"]["converted_modules"].remove("model.layers.1.mlp.down_proj")  # loads as a bf16 nn.Linear
    (broken / "config.json").write_text(json.dumps(config))
    write_manifest(broken)  # a consistent artifact: only its layer lists disagree

    report = probe_artifact(broken)
    assert not report.ok
    assert len(report.errors) == 1 and report.errors[0].startswith("model.layers.1.mlp.down_proj: the artifact says "
                                                                   "FP8, but its forward GEMM ran in high precision")
    assert "MISMATCH" in format_probe(report)

    assert main(["check", str(broken)]) == 1
    out, err = capsys.readouterr()
    assert "model.layers.1.mlp.down_proj" in err or "model.layers.1.mlp.down_proj" in out
    assert "1 layer(s) did not run as the artifact says" in err
    assert main(["check", str(tensorwise), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_emulated_recipe_says_emulated(llama_root, tmp_path):
    out = convert(llama_root, llama_root / "ao-emulate", {"backend": "ao", "emulate": True}, tmp_path)
    report = probe_artifact(out)
    assert report.ok, report.errors
    kinds = {layer.ran for layer in report.layers if layer.expected_fp8}
    assert kinds == {GemmKind.EMULATED}
    assert any(note.startswith("'emulated'") for note in report.notes)


def test_mxfp8_training_config_silently_in_bf16_on_cpu_is_an_error_per_layer(llama_root, tmp_path):
    """MXFP8TrainingOpConfig (kernel_preference auto) needs a Blackwell GPU: on a CPU the loader leaves the layers in
    high precision with a warning. The probe turns that into errors naming every layer."""
    out = convert(llama_root, llama_root / "ao-mxfp8", {"backend": "ao", "scaling": "mxfp8_training_op"}, tmp_path)
    report = probe_artifact(out)
    converted = json.loads((out / "config.json").read_text())["fp8"]["converted_modules"]
    assert len(report.errors) == len(converted) == 13
    assert all("ran in high precision" in error and "the loader says" in error for error in report.errors)


def test_check_refuses_what_is_not_an_artifact(tmp_path, capsys):
    assert main(["check", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err


def test_check_of_a_te_artifact_without_cuda_says_where_it_runs(llama_root, tmp_path, capsys):
    from converters.backends.te.runtime import te_status

    if te_status()[0]:
        pytest.skip("TransformerEngine runs here: the GPU test checks the TE probe")
    out = convert(llama_root, llama_root / "te-on-cpu", {"backend": "te", "scaling": "current"}, tmp_path)
    assert main(["check", str(out)]) == 1
    err = capsys.readouterr().err
    assert "TransformerEngine backend unavailable" in err and "GPU worker" in err


def test_te_artifact_probe_on_a_gpu(llama_root, tmp_path):
    from converters.backends.te.runtime import te_status

    ok, why = te_status()
    if not ok:
        pytest.skip(why)
    out = convert(llama_root, llama_root / "te-delayed", {"backend": "te"}, tmp_path)
    report = probe_artifact(out)
    assert report.ok, report.errors
    assert {layer.ran for layer in report.layers if layer.expected_fp8} == {GemmKind.FP8}
