"""YAML read without aliases, anchors or deep nesting, for every YAML file the service and the CLI read.

An alias repeats a whole subtree by reference, so nine aliases per level expand 406 bytes into hundreds of
megabytes once the document is turned into objects (or echoed in an error). Accelerate's ``config.yaml`` never
needs one, so anchors and aliases are refused while the document is composed, before any object is built, and
nesting is bounded so that neither the composer nor the constructor can exhaust the stack.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["MAX_YAML_BYTES", "MAX_YAML_DEPTH", "YamlRefused", "load_yaml"]

#: An Accelerate config is a few hundred bytes; a megabyte leaves room for comments and unrelated keys.
MAX_YAML_BYTES = 1 << 20
#: Accelerate's config nests three levels (``fp8_config.override_linear_precision``); 32 is generous.
MAX_YAML_DEPTH = 32


class YamlRefused(ValueError):
    """The text is not YAML this reader accepts; the message says why, without echoing the document."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing anchors and aliases and bounding the depth as each node is composed."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise YamlRefused(f"Anchors and aliases ('&' and '*', line {event.start_mark.line + 1}) are not "
                              "accepted; write the values out in full")
        self.depth += 1
        if self.depth > MAX_YAML_DEPTH:
            raise YamlRefused(f"The document nests deeper than {MAX_YAML_DEPTH} levels "
                              f"(line {event.start_mark.line + 1}); an Accelerate config nests three")
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def load_yaml(text: str) -> Any:
    """Parse one YAML document into plain Python objects (``yaml.safe_load``'s types).

    Raises:
        YamlRefused: more than :data:`MAX_YAML_BYTES`, a character YAML does not allow, an anchor or alias, nesting
            deeper than :data:`MAX_YAML_DEPTH`, or not YAML (PyYAML's message, whose snippet is bounded).
    """
    if len(text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES:
        raise YamlRefused(f"The document is larger than {MAX_YAML_BYTES} bytes; an Accelerate config is a few hundred")
    loader = None
    try:
        # inside the try: PyYAML's reader checks every character as the loader is built
        loader = _BoundedLoader(text)
        return loader.get_single_data()
    except YamlRefused:
        raise
    except yaml.reader.ReaderError as exc:
        raise YamlRefused(_unacceptable(text, exc)) from exc
    except yaml.YAMLError as exc:
        raise YamlRefused(f"Not valid YAML: {exc}") from exc
    except (ValueError, OverflowError) as exc:  # e.g. an integer of more digits than Python converts
        raise YamlRefused(f"A value cannot be read: {str(exc)[:200]}") from exc
    except (AttributeError, TypeError, LookupError) as exc:
        # an explicit tag on a value that is not of its type: PyYAML's constructor fails with an error of its own
        # (``!!timestamp x`` raises AttributeError), never a YAMLError
        raise YamlRefused(f"A value cannot be read as the type its tag ('!!...') names; remove the tag or fix the "
                          f"value ({type(exc).__name__})") from exc
    except RecursionError as exc:  # defence in depth: the depth bound above should stop it first
        raise YamlRefused("The document nests too deeply") from exc
    finally:
        if loader is not None:
            loader.dispose()


def _unacceptable(text: str, error: yaml.reader.ReaderError) -> str:
    """Where the character PyYAML's reader refused lies, named by its code point: the character itself may be one
    no JSON answer or terminal can carry (a NUL, a lone surrogate)."""
    code = error.character if isinstance(error.character, int) else ord(str(error.character)[:1] or "\0")
    before = text[:error.position]
    line, column = before.count("\n") + 1, error.position - (before.rfind("\n") + 1) + 1
    return (f"The document holds the character U+{code:04X} at line {line}, column {column}, which YAML does not "
            f"allow (control characters other than tab and line breaks, U+FFFE, U+FFFF, lone surrogates); remove it")
