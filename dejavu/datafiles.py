"""The data files shipped inside the package (`dejavu/data`, see its SOURCES.md), named once.

Paths are found from this module, so they hold for an editable checkout and an installed
wheel alike. Imports no torch.
"""
from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
CALIB_TEXT = DATA_DIR / "calib" / "wikitext2-train-head.txt"  # the default calibration corpus
WIKITEXT2_TEST = DATA_DIR / "wikitext-2" / "test.txt"  # perplexity text of dejavu-eval and dejavu-compare
HELDOUT_TEXT = DATA_DIR / "heldout" / "wikitext2-valid-head.txt"  # the compiler's held-out windows (allocate.py)
TASKS_DIR = DATA_DIR / "tasks"  # the zero-shot task files (runtime/evaluation/tasks.py)
