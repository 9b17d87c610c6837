"""The one exception type for user mistakes; CLIs turn it into a one-line error."""
from __future__ import annotations

import functools
import sys


class DejavuError(Exception):
    """A user-facing error: bad input, missing file, corrupt engine, ..."""


def cli_entry(fn):
    """Wrap a CLI `main(argv)` so a DejavuError prints one line and exits 2."""

    @functools.wraps(fn)
    def wrapper(argv=None):
        try:
            return fn(argv)
        except DejavuError as e:
            print(f"dejavu: error: {e}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("dejavu: interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapper
