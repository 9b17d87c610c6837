"""Every console script in pyproject.toml: a `main(argv=None)` wrapped in `cli_entry`, whose
`--help` works without a GPU stack (heavy imports stay inside the functions)."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def console_scripts() -> dict[str, str]:
    text = PYPROJECT.read_text(encoding="utf-8")
    block = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.:]+)"', block, flags=re.M))


SCRIPTS = console_scripts()


def test_scripts_declared():
    assert {"dejavu-generate", "dejavu-compile", "dejavu-run"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_and_cli_entry(name, capsys):
    module, func = SCRIPTS[name].split(":")
    fn = getattr(importlib.import_module(module), func)
    assert hasattr(fn, "__wrapped__"), f"{name}: main is not wrapped in dejavu.errors.cli_entry"
    with pytest.raises(SystemExit) as e:
        fn(["--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out
