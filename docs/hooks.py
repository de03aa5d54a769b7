"""mkdocs hook: docstrings cite code with Sphinx roles (:class:`~placements2jax.layout.Layout`),
which Markdown leaves as text; show them as code, shortened as Sphinx would (``Layout``)."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)\.?([^<]*)</code>")


def _code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    return _ROLE.sub(_code, html)
