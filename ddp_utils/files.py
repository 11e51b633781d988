"""Atomic file writes: a reader (or a resume after a crash) sees the old file or the new one, never half.

Used for checkpoints and for the run folder's text files (settings.json, results.json).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable


def atomic_write(path, write: Callable[[BinaryIO], None], check: Callable[[Path], None] | None = None) -> Path:
    """Call ``write(f)`` on a temporary file beside ``path``, force it to disk, then rename it over ``path``.

    ``check(tmp)`` may inspect the finished temporary file and raise to keep the old file. On any
    error or interrupt the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same folder as the target: os.replace is only atomic within one file system.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them "the" file
        if check is not None:
            check(tmp)
        os.replace(tmp, path)
    except BaseException:  # also KeyboardInterrupt: never leave a temp file behind
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)  # make the rename itself survive a power cut
    return path


def atomic_write_text(path, text: str) -> Path:
    """``atomic_write`` for UTF-8 text."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def fsync_folder(folder: Path) -> None:
    if os.name != "posix":
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems (network mounts) do not support it; the data is safe anyway
        pass
    finally:
        os.close(fd)
