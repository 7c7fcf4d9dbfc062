"""The web UI: server-rendered pages under ``/ui`` whose scripts call the public ``/v1`` API from the browser.

Turned off with the ``ui_enabled`` setting (``FP8FORGE_UI_ENABLED=0``). Every script, style and licence it
needs ships in ``static/``; nothing is fetched from the internet. ``docs/ui.md`` describes the pages.
"""

from service.ui.routes import install_ui

__all__ = ["install_ui"]
