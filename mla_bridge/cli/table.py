"""Text of the commands' rich tables: literal rows and the cell formats (lengths, tolerances, times)."""

from __future__ import annotations

from typing import Optional, Sequence


def lens_text(lens: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(x) for x in lens[:limit])
    return shown + (f", ... ({len(lens)} requests)" if len(lens) > limit else "")


def add_row(table, key: str, value) -> None:
    """A table row; plain strings are shown literally (no rich markup: values hold brackets such as [flashinfer])."""
    from rich.text import Text

    table.add_row(Text(key), value if isinstance(value, Text) else Text(str(value)))


def tol_text(tol: tuple[float, float]) -> str:
    atol, rtol = tol
    return f"{atol:g}" if rtol == 0 else f"{atol:g} + {rtol:.2g} x |ref|"


def ms_text(x: Optional[float]) -> str:
    if x is None:
        return "n/a"
    return f"{x / 1e3:.3f} s" if x >= 10_000 else f"{x:.3f} ms"
