"""Where a measurement came from: the checkout's commit, marked when the tree it ran differs from it.

Benchmark scripts record `tree_commit()` beside their figures. A run of an uncommitted change reads
"<commit>+changes", so a raw file never names a commit whose tree did not make it."""
from __future__ import annotations

import subprocess
from pathlib import Path

CHANGED = "+changes"


def tree_commit(path: str | Path | None = None, short: bool = True) -> str | None:
    """The commit checked out where `path` lies (default: this package's checkout), with "+changes"
    appended when tracked files differ from it; None outside a git checkout or without git."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    where = where if where.is_dir() else where.parent

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    head = git("rev-parse", *(["--short"] if short else []), "HEAD")
    if not head:
        return None
    changes = git("status", "--porcelain", "--untracked-files=no")
    return head + CHANGED if changes else head
