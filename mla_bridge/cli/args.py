"""Output files of the CLI, and (re-exported) the argparse value types of :mod:`mla_bridge.argtypes`."""

from __future__ import annotations

from pathlib import Path

from ..argtypes import int_list, nonnegative_float, nonnegative_int, output_file, positive_int, seed
from .errors import CLIError

__all__ = ["int_list", "positive_int", "nonnegative_int", "seed", "nonnegative_float", "output_file", "write_output"]


def write_output(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a sibling temporary file, then renamed over ``path`` (an
    interrupted or failed write leaves no partial file). A path that is not a regular file (``/dev/stdout``) is
    written directly; a symbolic link is followed (the file it names is replaced, the link kept).

    Raises:
        CLIError: the write failed (a full disk, ``/dev/full``...): one line, exit 2, instead of a traceback.
    """
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()
    try:
        _write_whole(path, text)
    except OSError as err:
        raise CLIError(f"could not write {path}: {err.strerror or err}") from None


def _write_whole(path: Path, text: str) -> None:
    import os
    import tempfile

    if path.exists() and not path.is_file():
        path.write_text(text, encoding="utf-8")
        return
    if path.exists():
        mode = path.stat().st_mode & 0o7777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)  # mkstemp makes 0600: give the file the mode a plain open() would have
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
