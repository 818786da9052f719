"""argparse value types shared by ``mla-bridge prefill`` and ``mla-bridge bench``: each names what it expected."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

__all__ = ["int_list", "positive_int", "nonnegative_int", "nonnegative_float", "output_file"]


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 256,512, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"lengths must be >= 0, got {text!r}")
    return values


def _int(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _int(text, 0, "an integer >= 0")


def nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def output_file(text: str) -> Path:
    """A file path that can be written, checked when the flags are parsed (before any work runs)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    return path
