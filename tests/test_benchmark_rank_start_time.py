"""benchmarks/rank_start_time.py on a tiny shape: the installed start and another file's, one JSON row each."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("rank_start_time", ROOT / "benchmarks" / "rank_start_time.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rank_start_time_rows(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    args = ["--dims", "16", "64", "--tokens", "128", "--rank", "8", "--repeats", "1", "--out", str(out)]
    assert _script().main(args) == 0
    assert _script().main(args + ["--predictors-py", str(ROOT / "compiler" / "predictors.py")]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["predictors"] for r in rows] == ["installed", str(ROOT / "compiler" / "predictors.py")]
    assert all(r["D"] == 16 and r["N"] == 64 and r["min_s"] > 0 for r in rows)
    assert capsys.readouterr().out.count("\n") == 2
