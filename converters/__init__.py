"""fp8forge's conversion library: analysis, recipes, calibration, conversion and export.

The public API (see docs/cli.md, "Python API")::

    import converters
    report = converters.analyze("org/name", recipe={"backend": "te"})
    result = converters.convert("org/name", "out/", recipe=converters.load_recipe_file("fp8.yaml"))
    model = converters.load_torchao("out/")

Names load on first use, so ``import converters.errors`` (the service does) pulls in no torch.
"""

from converters._lazy import lazy_exports
from converters._version import __version__

#: public name -> the module that defines it (loaded on first use: see converters._lazy)
_EXPORTS = {
    "analyze": "converters.api",
    "convert": "converters.api",
    "local_sources": "converters.api",
    "load_te": "converters.backends.loaders",
    "load_torchao": "converters.backends.loaders",
    "recipe_from_dict": "converters.recipes",
    "recipe_from_accelerate_yaml": "converters.recipes",
    "load_recipe_file": "converters.recipes",
    "default_recipe": "converters.recipes",
    "ConversionRequest": "converters.pipeline.request",
    "CalibrationSettings": "converters.pipeline.request",
    "ConversionResult": "converters.pipeline.driver",
    "ModelSourceOptions": "converters.model.sources",
    "AnalysisOptions": "converters.analysis.eligibility",
    "analyze_model": "converters.analysis.eligibility",
    "Fp8ForgeError": "converters.errors",
}
__all__ = ["__version__", *_EXPORTS]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
