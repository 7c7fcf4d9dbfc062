"""The FP8 and FP4 casts emulated on a CPU with the rounding and scale rules of the hardware recipes and the serving
formats (:mod:`converters.casts.emulation`): one floor below calibration, the quality pass and the serving exports,
which all cast with them."""

__all__: list[str] = []
