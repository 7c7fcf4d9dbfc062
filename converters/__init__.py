"""fp8forge's conversion library: analysis, recipes, calibration, conversion and export."""

__version__ = "0.1.0"
__all__ = ["__version__"]
