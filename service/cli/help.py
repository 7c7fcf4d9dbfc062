"""How ``fp8forge ... --help`` reads: names never split at their hyphens, defaults stated, one example per command.

argparse wraps help with ``textwrap``'s default ``break_on_hyphens``, which cut ``compressed-tensors-fp8-dynamic``
and ``--calib-batch-size`` across lines; :class:`HelpFormatter` wraps at spaces only. A flag whose help does not say
its default gets `` (default: X)`` when it has one worth saying (not None, False or empty).
"""

from __future__ import annotations

import argparse
import textwrap

__all__ = ["EXAMPLES", "HelpFormatter", "finish_help"]

#: one runnable example per command (the demo model needs no hub)
EXAMPLES: dict[str, str] = {
    "analyze": "fp8forge analyze demo/tiny-llama --recipe te-mxfp8",
    "convert": "fp8forge convert demo/tiny-llama --out out/tiny-fp8 --backend ao --serving compressed-tensors-fp8",
    "compare": "fp8forge compare demo/tiny-llama --recipes te-current,te-mxfp8,ao-rowwise",
    "check": "fp8forge check out/tiny-fp8",
    "plan": "fp8forge plan demo/tiny-llama --target-kl 0.001 --gpu b200 --out out/plan",
    "requantize": "fp8forge requantize ./models/llama-fp8 --out out/llama-block --to fp8-block",
    "sync": "fp8forge sync out/tiny-fp8 --out out/tiny-serving",
    "serve": "fp8forge serve --host 127.0.0.1 --port 8000 --workers 1",
    "worker": "FP8FORGE_DATABASE_URL=postgresql+psycopg://... fp8forge worker",
    "keys": "fp8forge keys create alice --role user",
}


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter without breaks at hyphens; keeps the epilog's lines; states defaults."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in text.splitlines():
            if line.startswith(" ") or not line.strip():  # an example line: as written
                lines.append(indent + line)
            else:
                lines += textwrap.wrap(line, width, initial_indent=indent, subsequent_indent=indent,
                                       break_on_hyphens=False, break_long_words=False)
        return "\n".join(lines)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def finish_help(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and every command under it :class:`HelpFormatter`, and each command its example."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                if name in EXAMPLES and not command.epilog:
                    command.epilog = f"example:\n  {EXAMPLES[name]}"
                finish_help(command)
