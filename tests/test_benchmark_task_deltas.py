"""benchmarks/task_deltas.py: a run's accuracy difference from dense and its paired standard error,
against numpy on the shipped copa file's gold answers; runs in parts (T_A_B names, FILE@K)."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from dejavu.datafiles import TASKS_DIR

_spec = importlib.util.spec_from_file_location(
    "task_deltas", Path(__file__).resolve().parents[1] / "benchmarks" / "task_deltas.py")
td = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(td)

GOLD = [json.loads(line)["gold"] for line in (TASKS_DIR / "copa" / "copa_val_icl.jsonl").read_text().splitlines()
        if line.strip()][:40]


def _write(path, tasks, **run):
    path.write_text(json.dumps({"density": 0.5, "kind": "engine", "model": "m.engine", **run, "tasks": tasks}))
    return str(path)


def test_the_difference_and_its_paired_error_equal_numpy(tmp_path):
    rng = np.random.default_rng(0)
    dense = [g if rng.random() < 0.7 else 1 - g for g in GOLD]
    run = [p if rng.random() < 0.8 else 1 - p for p in dense]
    d = _write(tmp_path / "d.json", {"copa": {"preds": dense}}, density=None, kind="dense")
    # the run in parts: examples 1-15 as copa, 16-30 as copa_16_30, 31-40 as copa from example 31 on
    a = _write(tmp_path / "a.json", {"copa": {"preds": run[:15]}})
    b = _write(tmp_path / "b.json", {"copa_16_30": {"preds": run[15:30]}})
    c = _write(tmp_path / "c.json", {"copa": {"preds": run[30:]}})
    out = tmp_path / "out.json"
    assert td.main([d, f"{a}+{b}+{c}@31", "--out", str(out)]) == 0
    got = json.loads(out.read_text())[0]["tasks"]["copa"]
    diff = np.equal(run, GOLD).astype(np.float64) - np.equal(dense, GOLD).astype(np.float64)
    assert got["n"] == 40
    assert got["diff"] == pytest.approx(100 * diff.mean(), abs=0.006)
    assert got["paired_se"] == pytest.approx(100 * diff.std(ddof=1) / np.sqrt(40), abs=0.006)
    assert got["dense"] == pytest.approx(100 * np.mean(np.equal(dense, GOLD)), abs=0.006)
    assert got["changed"] == int(np.sum(np.not_equal(run, dense)))


def test_a_dense_run_is_a_run_only_with_with_dense(tmp_path):
    # the dense model in another dtype as the control: left out by default, compared when asked
    rng = np.random.default_rng(1)
    fp32 = [g if rng.random() < 0.6 else 1 - g for g in GOLD]
    bf16 = list(fp32)
    bf16[3], bf16[7] = 1 - bf16[3], 1 - bf16[7]
    d = _write(tmp_path / "d.json", {"copa": {"preds": fp32}}, density=None, kind="dense", dtype="float32")
    c = _write(tmp_path / "c.json", {"copa": {"preds": bf16}}, density=None, kind="dense", dtype="bfloat16")
    out = tmp_path / "out.json"
    assert td.main([d, c, "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == []
    assert td.main([d, c, "--with-dense", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["run"] == "m.engine (bfloat16)"
    want = np.equal(bf16, GOLD).mean() - np.equal(fp32, GOLD).mean()
    assert row["tasks"]["copa"]["changed"] == 2
    assert row["tasks"]["copa"]["diff"] == pytest.approx(100 * want, abs=0.006)


def test_length_normalised_predictions_are_a_row_of_their_own(tmp_path):
    # acc_norm's predictions (piqa, openbookqa) compared as "task (acc_norm)" against the same gold answers
    norm_dense, norm_run = list(GOLD), [1 - g if i < 5 else g for i, g in enumerate(GOLD)]
    d = _write(tmp_path / "d.json", {"copa": {"preds": GOLD, "preds_norm": norm_dense}}, density=None, kind="dense")
    r = _write(tmp_path / "r.json", {"copa": {"preds": GOLD, "preds_norm": norm_run}})
    out = tmp_path / "out.json"
    assert td.main([d, r, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())[0]["tasks"]
    assert rows["copa"]["diff"] == 0 and rows["copa"]["changed"] == 0
    assert rows["copa (acc_norm)"]["diff"] == pytest.approx(-100 * 5 / 40) and rows["copa (acc_norm)"]["changed"] == 5


def test_a_part_of_the_wrong_length_is_one_error(tmp_path):
    d = _write(tmp_path / "d.json", {"copa": {"preds": GOLD}}, density=None, kind="dense")
    b = _write(tmp_path / "b.json", {"copa_16_30": {"preds": GOLD[:10]}})
    with pytest.raises(SystemExit, match="dejavu: error: copa_16_30: 10 predictions for examples 16..30"):
        td.main([d, b])
