"""Where each export loads: the table covers the format registry, the README shows it, the report carries it, and
transformers does with every layout's export what the report says it does."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from converters.model.sources import ModelSourceOptions, load_model
from converters.serving import SERVING_FORMATS
from converters.serving.loads_in import CONSUMERS, LAYOUT_OF, LoadStatus, loads_in, loads_in_markdown
from tests.converters.serving.exports import cosine, export

README = Path(__file__).resolve().parents[3] / "README.md"
START, END = "<!-- loads-in table", "<!-- end of loads-in table -->"
#: one format per layout of the table (a training twin writes its parent's layout)
ONE_PER_LAYOUT = tuple({layout: name for name, layout in reversed(LAYOUT_OF.items())}.values())


@pytest.fixture(scope="module")
def llama_out(llama_dir):
    return export(llama_dir, ONE_PER_LAYOUT)


def test_every_registered_format_has_one_cell_per_consumer():
    assert set(LAYOUT_OF) == set(SERVING_FORMATS)
    for name in SERVING_FORMATS:
        cells = loads_in(name)
        assert [cell.consumer for cell in cells] == list(CONSUMERS)
        assert all(cell.source and (cell.note or cell.status is not LoadStatus.NOT_LOADED) for cell in cells), name


def test_the_readme_shows_the_table_as_generated():
    text = README.read_text()
    block = text[text.index(START):text.index(END)]
    assert block.split("\n", 1)[1].strip() == loads_in_markdown(SERVING_FORMATS), \
        "README's loads-in table is stale: regenerate it with converters.serving.loads_in.loads_in_markdown"


def _loaded_by_transformers(directory: Path, reference: torch.Tensor, ids: torch.Tensor) -> tuple[LoadStatus, str]:
    """What transformers does with the export: raises or runs unrelated logits (not loaded), runs it with bf16
    weights (dequantized) or keeps low-precision weights (loads); and what it logged."""
    import transformers

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = transformers.utils.logging.get_logger("transformers")
    logger.addHandler(handler)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    except (RuntimeError, ValueError) as exc:
        return LoadStatus.NOT_LOADED, str(exc)
    finally:
        logger.removeHandler(handler)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if cosine(logits, reference) < 0.9:
        return LoadStatus.NOT_LOADED, " ".join(records)
    dtypes = {module.weight.dtype for module in model.modules() if isinstance(module, torch.nn.Linear)}
    status = LoadStatus.DEQUANTIZES if dtypes <= {torch.bfloat16, torch.float32} else LoadStatus.LOADS
    return status, " ".join(records)


@pytest.mark.parametrize("name", ONE_PER_LAYOUT)
def test_transformers_does_what_the_report_says(llama_dir, llama_out, name):
    report = json.loads((llama_out / "fp8_report.json").read_text())
    claim = next(cell for cell in report["serving"][name]["loads_in"] if cell["consumer"] == "transformers")
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = load_model(llama_dir, ModelSourceOptions())(input_ids=ids).logits
    observed, log = _loaded_by_transformers(llama_out / "serving" / name, reference, ids)
    assert claim["status"] == observed.value, (name, claim, log)
    if name == "modelopt-fp8":  # the case: transformers skips the config and says so only in a log line
        assert "Unknown quantization type" in log and "modelopt" in log


def test_an_export_a_consumer_misreads_carries_a_warning(llama_out):
    report = json.loads((llama_out / "fp8_report.json").read_text())
    entry = report["serving"]["modelopt-fp8"]
    assert {"consumer": "transformers", "status": "not loaded"}.items() <= entry["loads_in"][-1].items()
    warning = next(line for line in entry["warnings"] if "transformers" in line)
    assert warning in report["warnings"] and "vLLM" in warning  # says where it does load
    assert report["serving"]["compressed-tensors-fp8-dynamic"]["warnings"] == []
