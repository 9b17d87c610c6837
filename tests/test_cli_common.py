"""Every console script in pyproject.toml: a `main(argv=None)` wrapped in `cli_entry`; one
argument vocabulary (`dejavu.cli_common`); `--help`, `--version` and argument errors answered
before torch is imported; help text for every option."""
from __future__ import annotations

import argparse
import importlib
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from dejavu.cli_common import DTYPES, canonical_device, canonical_dtype
from dejavu.errors import DejavuError

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def console_scripts() -> dict[str, str]:
    text = PYPROJECT.read_text(encoding="utf-8")
    block = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.:]+)"', block, flags=re.M))


SCRIPTS = console_scripts()
PARSERS = {"dejavu-generate": "dejavu.models.cli:build_parser",
           "dejavu-compile": "dejavu.compiler.cli:compile_parser", "dejavu-inspect": "dejavu.compiler.cli:inspect_parser", "dejavu-run": "dejavu.runtime.cli:build_parser",
           "dejavu-compare": "dejavu.runtime.evaluation.compare:build_parser", "dejavu-eval": "dejavu.runtime.evaluation.evaluate:build_parser",
           "dejavu-serve": "dejavu.runtime.serve:build_parser", "dejavu-tune": "dejavu.runtime.cli:build_tune_parser"}
MINIMAL = {"dejavu-generate": ["m", "--prompt", "y"], "dejavu-compile": ["m", "--density", "0.5"],
           "dejavu-run": ["x.engine", "--prompt", "y"], "dejavu-serve": ["x.engine"], "dejavu-eval": ["x.engine"],
           "dejavu-compare": ["x.engine"]}


def _load(spec: str):
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)


def _run(name: str, argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    code = (f"import sys\nfrom {SCRIPTS[name].split(':')[0]} import {SCRIPTS[name].split(':')[1]} as main\n"
            "try:\n    main(sys.argv[1:])\nfinally:\n    print('torch' in sys.modules, file=sys.stderr)")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return r, cpu  # CPU seconds: wall time on a shared machine measures the other processes


def test_scripts_declared():
    assert set(SCRIPTS) == set(PARSERS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_and_cli_entry(name, capsys):
    fn = _load(SCRIPTS[name])
    assert hasattr(fn, "__wrapped__"), f"{name}: main is not wrapped in dejavu.errors.cli_entry"
    with pytest.raises(SystemExit) as e:
        fn(["--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_version_and_errors_before_torch(name):
    r, _ = _run(name, ["--help"])
    assert r.returncode == 0 and "usage:" in r.stdout
    assert r.stderr.strip().splitlines()[-1] == "False"  # no torch: --help reads the dataclasses alone
    r, _ = _run(name, ["--version"])
    assert r.returncode == 0 and r.stdout.startswith(f"{name} (dejavu) ")
    assert r.stderr.strip().splitlines()[-1] == "False"
    r, _ = _run(name, [*MINIMAL.get(name, ["x.engine"]), "--no-such-option"])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and r.stdout == ""
    assert len(lines) == 2 and lines[0].startswith(f"dejavu: error: {name}: ") and "--no-such-option" in lines[0]
    assert lines[1] == "False"  # the error came before torch


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_is_fast(name):
    """CPU time of the whole process, the interpreter's start included (~0.1 s); importing
    torch alone costs ~1.8 s of CPU here."""
    _run(name, ["--help"])  # warm the file cache
    best = min(_run(name, ["--help"])[1] for _ in range(3))
    assert best < 0.3, f"{name} --help took {best:.2f} s of CPU"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_option_has_help_and_shared_vocabulary(name):
    p = _load(PARSERS[name])()
    for a in p._actions:
        assert a.help and a.help != argparse.SUPPRESS, f"{name}: {a.option_strings or a.dest} has no help text"
    opts = {o: a for a in p._actions for o in a.option_strings}
    assert "--version" in opts
    if "--quiet" in opts:
        assert "-q" in opts and opts["-q"] is opts["--quiet"]
    if "--dtype" in opts:
        assert p.parse_args([*MINIMAL[name], "--dtype", "bf16"]).dtype == "bfloat16"
    if "--device" in opts:
        assert opts["--device"].metavar == "{cpu,cuda[:N]}"


def test_vocabulary_functions():
    for alias, name in (("fp16", "float16"), ("half", "float16"), ("BF16", "bfloat16"), ("fp32", "float32"),
                        *((d, d) for d in DTYPES)):
        assert canonical_dtype(alias) == name
    for dev in ("cpu", "cuda", "cuda:1"):
        assert canonical_device(dev) == dev
    for bad, fn in (("int8", canonical_dtype), ("tpu", canonical_device), ("cuda:x", canonical_device)):
        with pytest.raises(DejavuError):
            fn(bad)
