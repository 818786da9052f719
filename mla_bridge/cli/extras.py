"""What the ``mla-bridge`` command needs beyond the library: the ``cli`` extra.

``pip install mla-bridge`` brings the library (torch and numpy); ``pip install 'mla-bridge[cli]'`` adds rich (every
command's tables and progress bar), matplotlib (``bench --plot``) and safetensors (``prefill --checkpoint``). A
command that needs one of them and runs without it stops with exit 2 and one line naming the missing package and
the extra, before any work.
"""

from __future__ import annotations

import importlib.util
from typing import Sequence

__all__ = ["CLI_EXTRA", "missing", "needed_for"]

#: The extra that brings the command's own dependencies.
CLI_EXTRA = "mla-bridge[cli]"


def missing(modules: Sequence[str]) -> list[str]:
    """The names in ``modules`` that do not import here (not installed, or blocked)."""
    out = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent missing, or sys.modules[name] is None
            found = False
        if not found:
            out.append(name)
    return out


def needed_for(argv: Sequence[str]) -> list[str]:
    """The modules of the ``cli`` extra a command line needs: rich always (the output), matplotlib for
    ``bench --plot``, safetensors for ``prefill --checkpoint``."""
    need = ["rich"]
    command = next((a for a in argv if not a.startswith("-")), None)
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    if command == "bench" and "--plot" in flags:
        need.append("matplotlib")
    if command == "prefill" and "--checkpoint" in flags:
        need.append("safetensors")
    return need
