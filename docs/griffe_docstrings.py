"""A griffe extension for the API reference (mkdocs.yml loads it): the docstrings as this code base writes them.

- Sphinx roles (``:class:`~mla_bridge.RaggedPlan```, ``:func:``, ``:mod:``...) become Markdown code spans. They are
  not turned into links: many name private helpers that the reference does not document, and strict mode fails on
  a link without a target.
- A module-level constant documented by ``#:`` comment lines right above it (Sphinx's convention, used here) gets
  them as its docstring, so the reference shows it (tests/test_public_docstrings.py reads the same comments).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|const):`~?([^`]+)`")


@lru_cache(maxsize=None)
def _lines(path: str) -> tuple[str, ...]:
    return tuple(Path(path).read_text(encoding="utf-8").splitlines())


class CodebaseDocstrings(griffe.Extension):
    """Sphinx roles as code spans; ``#:`` comments as the docstrings of the constants they precede."""

    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.docstring is not None or attr.lineno is None or not isinstance(attr.parent, griffe.Module):
            return
        path = attr.parent.filepath
        if not isinstance(path, Path):
            return
        lines, text, i = _lines(str(path)), [], attr.lineno - 2
        while i >= 0 and lines[i].lstrip().startswith("#:"):
            text.insert(0, lines[i].lstrip()[2:].strip())
            i -= 1
        if text:
            attr.docstring = griffe.Docstring(
                _ROLE.sub(lambda m: f"`{m.group(1)}`", " ".join(text)), lineno=attr.lineno, parent=attr
            )

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(lambda m: f"`{m.group(1)}`", obj.docstring.value)
