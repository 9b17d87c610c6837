"""Atomic file writes: write to a temporary name beside the target, rename when complete."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from dejavu.errors import DejavuError


_UMASK = None


def _umask() -> int:
    """The process's umask. Read once (setting it to read it is not thread-safe: a server's threads write files)."""
    global _UMASK
    if _UMASK is None:
        _UMASK = os.umask(0)
        os.umask(_UMASK)
    return _UMASK


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path in the target's folder; rename it to `path` on success, with the mode a plain
    open would give it (the umask's: mkstemp makes its files 0600).

    On any exception the temporary file is removed, so no partial output is left behind.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise DejavuError(f"output folder does not exist: {folder}")
    if not os.access(folder, os.W_OK):
        raise DejavuError(f"output folder is not writable: {folder}")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, obj, indent: int | None = 2, **dumps_kw) -> Path:
    """`obj` as JSON (and a final newline) at `path`, atomically: no partial file if it fails midway.
    dumps_kw: json.dumps' other options (sort_keys, default)."""
    import json

    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=indent, **dumps_kw) + "\n", encoding="utf-8")
    return path
