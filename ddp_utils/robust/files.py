"""Atomic file writes: a reader (or a resume after a crash) sees the old file or the new one, never half.

Used for checkpoints and for the run folder's text files (settings.json, results.json). The temporary
file is ``.<name>.tmp`` beside the target, one name per target: a process killed while writing leaves
at most one, which ``remove_leftovers`` deletes when the run folder is opened again.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

MB = 2**20


class DiskFull(RuntimeError):
    """The disk filled up while writing; the previous file is kept. The message says where and how much."""


def folder_refusal(folder, what: str) -> str | None:
    """Why ``folder`` cannot be a folder this process writes, in a sentence that starts with ``what`` ("the run
    folder"), or None when it can. Asked before anything is built or written: a file in its place (or in a
    parent's), or a nearest existing folder that cannot be written. Tried for real (a temporary file made and
    removed there), so a read-only disk or mount answers as it will when the run writes, also for root."""
    folder = Path(folder)
    existing = folder
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if os.path.lexists(existing) and not existing.is_dir():
        where = "is a file" if existing == folder else f"cannot be made: {existing} is a file"
        return f"{what} {folder} {where}, not a folder. Name a folder (a new one is made) and start again."
    try:
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".write-probe-", suffix=".tmp")   # remove_leftovers' pattern
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        inside = "" if existing == folder else f" (it would be made in {existing})"
        return (f"{what} {folder} cannot be written{inside}: {exc.strerror or exc}. Choose a folder this user can "
                f"write (a path under your home folder or the current one), or fix its permissions, and start again.")
    return None


def temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def remove_leftovers(folder) -> list[Path]:
    """Delete the temporary files an interrupted write left in ``folder``; return what was deleted."""
    gone = []
    for tmp in Path(folder).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
        gone.append(tmp)
    return gone


def atomic_write(path, write: Callable[[BinaryIO], None], check: Callable[[Path], None] | None = None) -> Path:
    """Call ``write(f)`` on a temporary file beside ``path``, force it to disk, then rename it over ``path``.

    ``check(tmp)`` may inspect the finished temporary file and raise to keep the old file. On any
    error or interrupt the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same folder as the target: os.replace is only atomic within one file system.
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them "the" file
        if check is not None:
            check(tmp)
        os.replace(tmp, path)
    except BaseException as exc:  # also KeyboardInterrupt: never leave a temp file behind
        written = tmp.stat().st_size if tmp.exists() else 0
        tmp.unlink(missing_ok=True)
        interrupt = _interrupt_under(exc)
        if interrupt is not None:   # Ctrl-C / Stop: the caller's interrupt handling, not a write error
            raise interrupt from None
        if _disk_full(exc, path.parent):
            raise DiskFull(_disk_full_text(path, written)) from exc
        raise
    fsync_folder(path.parent)  # make the rename itself survive a power cut
    return path


def _interrupt_under(exc: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt that ``exc`` is, or that it replaced: torch.save's zip writer, interrupted, raises
    "unexpected pos" from its cleanup over the KeyboardInterrupt."""
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        exc = exc.__context__
    return None


def _disk_full(exc: BaseException, folder: Path) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # torch.save through its zip writer reports a full disk as "[enforce fail ...] unexpected pos".
    return isinstance(exc, RuntimeError) and shutil.disk_usage(folder).free < MB


def _disk_full_text(path: Path, written: int) -> str:
    free = shutil.disk_usage(path.parent).free
    need = (f"about {path.stat().st_size / MB:.1f} MB (the size of the previous {path.name})" if path.exists()
            else f"more than the {written / MB:.1f} MB written when it failed")
    return (f"No space left on the disk that holds {path.parent}: writing {path.name} needed {need}, and "
            f"{free / MB:.1f} MB are free. The previous {path.name} (if any) is unchanged. Free space on that disk "
            f"(old runs and checkpoints: du -sh runs/*) or choose a run folder on a bigger disk, then resume.")


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
