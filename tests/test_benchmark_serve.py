"""benchmarks/serve.py on the CPU at tiny size: the scheduler-only load (--no-http) and the
solo-vs-batch agreement. With per-sequence index sets no request may differ from its solo run."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_serve_benchmark_tiny_no_http(tmp_path):
    out = tmp_path / "serve.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--shape", "tiny", "--threads", "1",
                    "--max-batch", "4", "--max-context", "64", "--clients", "1", "3", "--requests", "1",
                    "--prompt-len", "6", "--max-tokens", "5", "--no-http", "--agreement", "4",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    for kind in ("dense", "sparse"):
        levels = res["engines"][kind]["levels"]
        assert [lv["clients"] for lv in levels] == [1, 3]
        assert [lv["output_tokens"] for lv in levels] == [5, 15] and all(lv["tokens_per_s"] > 0 for lv in levels)
        assert res["engines"][kind]["direct_ms_per_token"] > 0
    assert res["agreement"]["per_sequence"]["differ"] == 0 and res["agreement"]["shared"]["prompts"] == 4


def test_serve_benchmark_budget_spent_records_skipped(tmp_path):
    """--budget-s 0: nothing starts, every engine level and the agreement are listed as skipped,
    and the JSON is complete (written through a temporary name, none left behind)."""
    out = tmp_path / "serve.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--shape", "tiny", "--threads", "1",
                        "--max-batch", "4", "--max-context", "64", "--clients", "1", "3", "--more-clients", "2",
                        "--requests", "1", "--prompt-len", "6", "--max-tokens", "5", "--agreement", "4",
                        "--budget-s", "0", "--out", str(out)], check=True, capture_output=True, text=True, timeout=120)
    res = json.loads(out.read_text())
    assert res["engines"] == {} and res["budget_s"] == 0 and "agreement" not in res
    # the order the levels would have run in: each engine at --clients, then each at --more-clients
    assert res["skipped"] == [{"engine": k, "clients": n} for k in ("dense", "sparse") for n in (1, 3)] + [
        {"engine": k, "clients": 2} for k in ("dense", "sparse")] + [{"agreement": 4}]
    assert list(tmp_path.iterdir()) == [out] and "skipped" in r.stdout
