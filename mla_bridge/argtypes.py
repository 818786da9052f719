"""argparse value types shared by ``mla-bridge prefill`` and ``mla-bridge bench`` (below both, so that the bench
never imports the CLI): each names what it expected."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["int_list", "positive_int", "nonnegative_int", "seed", "nonnegative_float", "output_file"]


def int_list(text: str) -> list[int]:
    try:
        items = text.replace(" ", "").split(",")
        if len(items) > 1 and "" in items:  # "1,,2" or ",5,": a typo would silently change the batch
            raise ValueError
        values = [int(x) for x in items if x != ""]
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


def seed(text: str) -> int:
    """A random seed torch accepts: an integer in [0, 2**63)."""
    value = _int(text, 0, "an integer seed in [0, 2**63)")
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"expected an integer seed in [0, 2**63), got {value}")
    return value


def nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def output_file(text: str) -> Path:
    """A file path that can really be written, checked when the flags are parsed (before any work runs): the one
    rule of every output flag (``prefill/info/bench --json``, ``bench --plot``).

    An existing file is opened for append (its content is untouched); otherwise a temporary sibling file is created
    and removed in the same folder, so nothing is left behind when the run later fails. ``os.access`` is not
    enough: it says yes to root for folders such as ``/proc`` where no file can be created. argparse reports a
    refusal as ``argument --json: ...`` with exit 2.
    """
    import tempfile

    path = Path(text)
    if text == "" or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(parent)!r} does not exist")
    try:
        if path.exists():
            with open(path, "a", encoding="utf-8"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{path.name}.", suffix=".tmp"):
                pass
    except OSError as err:
        what = f"{text!r} cannot be written" if path.exists() else f"no file can be created in {str(parent)!r}"
        raise argparse.ArgumentTypeError(f"{what} ({err.strerror or err})") from None
    return path
