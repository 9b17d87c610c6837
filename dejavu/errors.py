"""The one exception type for user mistakes; CLIs turn it into a one-line error."""
from __future__ import annotations

import functools
import os
import sys


class DejavuError(Exception):
    """A user-facing error: bad input, missing file, corrupt engine, ..."""


def cli_entry(fn):
    """Wrap a CLI `main(argv)`: a DejavuError prints one line and exits 2; Ctrl-C (also while
    torch is being imported: CLIs import it inside `main`) prints one line and exits 130; a
    reader that goes away (`| head`) ends the program silently with 141, as SIGPIPE would."""

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
        except BrokenPipeError:
            _silence_stdout()
            sys.exit(141)

    return wrapper


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout replaced by an object without a descriptor
        pass
