"""dejavu-compile / dejavu-inspect: a real tiny build, determinism, and every bad input → one line, exit 2."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from dejavu.compiler.cli import inspect_main, main
from dejavu.engine_file import encode_engine, read_engine, read_header

QUICK = ["--calib-tokens", "600", "--calib-window", "64", "--predictor-epochs", "1", "-q"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def built(tiny_opt_dir, tmp_path_factory):
    """One real compile (calibration + training) of the tiny OPT, shared by the tests below."""
    d = tmp_path_factory.mktemp("built")
    mp = pytest.MonkeyPatch()
    mp.setenv("DEJAVU_CACHE", str(tmp_path_factory.mktemp("cache")))  # the calibration / sensitivity caches
    try:
        for name in ("a", "b"):  # the searched budget is deterministic too
            assert main([str(tiny_opt_dir), "--max-ppl-increase", "5", "-o", str(d / f"{name}.engine"), *QUICK]) == 0
    finally:
        mp.undo()
    return d


def _fails(capsys, fn, argv, match):
    with pytest.raises(SystemExit) as e:
        fn(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dejavu: error:"), err
    assert match in err, err
    return err


def test_compile_twice_same_bytes_and_no_state_left(built):
    a, b = (built / "a.engine").read_bytes(), (built / "b.engine").read_bytes()
    assert a == b
    assert sorted(p.name for p in built.iterdir()) == ["a.engine", "b.engine"]  # build state removed
    header, tensors = read_engine(built / "a.engine")
    assert header["build_config"]["calibration"]["n_tokens"] == 600
    assert header["build_config"]["calibration"]["corpus"].startswith("dejavu/data/")
    assert "layers.1.pred_attn.bias" in tensors


def test_summary_printed(tiny_opt_dir, tmp_path, capsys):
    out = tmp_path / "s.engine"
    assert main([str(tiny_opt_dir), "--mlp-density", "0.25", "--attn-density", "0.5", "-o",  # K fixed: no --density
                 str(out), "--summary-json", str(tmp_path / "s.json"), "--allocation", "uniform", *QUICK]) == 0
    text = capsys.readouterr().out
    assert "K_mlp" in text and "recall" in text and "time" in text and "MiB" in text
    assert "bytes/token" in text and "held-out    ppl" in text
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["mlp_k"] == [32, 32] and s["attn_k"] == [2, 2]
    bc = read_header(out)["build_config"]
    assert bc["mlp_density"] == 0.25 and bc["settings"]["mlp_density"] == 0.25
    # what the fixed K read; the default per-token K reads its held-out mean rows (recorded beside it)
    assert bc["density"] == s["density"] < 1 and bc["settings"]["token_k"] == "share"
    assert bc["bytes_per_token"] == bc["token_k"]["bytes_per_token"] == s["bytes_per_token"]
    assert abs(bc["bytes_per_token"]["fraction"] - bc["density"]) < 0.02
    tk = bc["token_k"]  # the summary names what the engine carries and what K rows for every token measured
    assert tk["rows"] == "read"  # the default rows measure
    assert (f"per-token K share, rows read: up to {sum(tk['k_max'])} MLP rows, held-out mean fc1 "
            f"{sum(tk['heldout']['mean_rows']):.0f} + fc2 {sum(tk['heldout']['mean_rows_fc2']):.0f} of 2 K "
            f"{2 * sum(tk['k_mean'])}; K rows for every token: "
            f"{bc['heldout']['fixed_k_increase_pct']:+.2f}%") in text
    # the default MLP predictors: int8 rows at the rank the budget pays for in int8 bytes; --predictor-dtype float
    # below: the engine dtype at the float rank
    from dejavu.compiler.config import PredictorSettings
    from dejavu.compiler.predictors import mlp_ranks
    from dejavu.models.loader import load_config

    cfg = load_config(tiny_opt_dir)
    assert bc["predictor_dtype"] == {"mlp": "int8", "attn": "float"}
    assert bc["predictor_rank_mlp"] == mlp_ranks(cfg, PredictorSettings(dtype="int8"))
    assert read_engine(out)[1]["layers.0.pred_mlp.a"].dtype.itemsize == 1
    assert main([str(tiny_opt_dir), "--mlp-density", "0.25", "--attn-density", "0.5", "-o", str(out), "--token-k", "off",
                 "--allocation", "uniform", *QUICK]) == 0
    bc = read_header(out)["build_config"]
    assert "token_k" not in bc and bc["settings"]["token_k"] == "off"
    assert "per-token K" not in capsys.readouterr().out
    assert bc["density"] == bc["bytes_per_token"]["fraction"] == s["density"]
    assert main([str(tiny_opt_dir), "--mlp-density", "0.25", "--attn-density", "0.5", "-o", str(out), "--token-k", "off",
                 "--allocation", "uniform", "--predictor-dtype", "float", *QUICK]) == 0
    bc = read_header(out)["build_config"]
    assert bc["predictor_dtype"] == {"mlp": "float", "attn": "float"} and bc["settings"]["predictor_dtype"] == "float"
    assert bc["predictor_rank_mlp"] == mlp_ranks(cfg, PredictorSettings(dtype="float")) != \
        mlp_ranks(cfg, PredictorSettings(dtype="int8"))
    assert "layers.0.pred_mlp.a_scale" not in read_engine(out)[1]


def test_inspect(built, capsys):
    path = built / "a.engine"
    assert inspect_main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "dejavu-engine v1" in text and "mlp_k" in text and "float16" in text
    h = read_header(built / "a.engine")["build_config"]
    assert f"({h['heldout']['increase_pct']:+.2f}%)" in text and "bytes/token" in text
    assert h["heldout"]["increase_pct"] <= 5 and h["settings"]["max_ppl_increase"] == 5.0
    assert h["bytes_per_token"]["fraction"] <= h["density"] <= 1.0
    header, tensors = read_engine(path)
    assert f"tensors     {len(tensors)} (" in text and "checksum verified" in text and "layers.0.mlp.w1" in text
    assert inspect_main([str(path), "--header-only"]) == 0
    short = capsys.readouterr().out
    assert short != text and "checksum not verified" in short and "layers.0.mlp.w1" not in short
    assert inspect_main([str(path), "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert "tokenizer_json" not in obj and obj["tokenizer"]["chars"] == len(header["tokenizer_json"])
    assert obj["file"] == {"bytes": path.stat().st_size, "checksum": "verified", "tensors": len(tensors)}
    assert {k: v for k, v in obj.items() if k not in ("tokenizer", "file")} == \
        {k: v for k, v in header.items() if k != "tokenizer_json"}
    assert inspect_main([str(path), "--json", "--full", "--header-only"]) == 0
    assert json.loads(capsys.readouterr().out) == header
    _fails(capsys, inspect_main, [str(path), "--full"], "--full goes with --json")


@pytest.mark.parametrize("argv,match", [
    (["opt-nonexistent", "--density", "0.3"], "not found"),
    (["MODEL", "--density", "0"], "density"),
    (["MODEL", "--density", "1.5"], "density"),
    (["MODEL", "--density", "abc"], "density"),
    (["MODEL", "--density", "0.3", "--attn-density", "2"], "attn-density"),
    (["MODEL"], "--density"),
    (["MODEL", "--max-ppl-increase", "-1"], "max-ppl-increase"),
    (["MODEL", "--max-ppl-increase", "1001"], "max-ppl-increase"),
    (["MODEL", "--density", "0.5", "--max-ppl-increase", "1"], "not both"),
    (["MODEL", "--density", "-0.5"], "density"),
    (["MODEL", "--density", "0.1"], "below the least"),
    (["MODEL", "--density", "0.3", "--dtype", "int4"], "dtype"),
    (["MODEL", "--density", "0.3", "--device", "tpu"], "--device"),
    (["MODEL", "--density", "0.3", "--calib", "/nonexistent/corpus.txt"], "corpus"),
    (["MODEL", "--density", "0.3", "--token-k-rows", "all"], "--token-k-rows"),
    (["MODEL", "--density", "0.3", "--token-k", "off", "--token-k-rows", "selected"], "needs a per-token K"),
])
def test_compile_bad_input(tiny_opt_dir, tmp_path, capsys, argv, match):
    argv = [str(tiny_opt_dir) if a == "MODEL" else a for a in argv]
    _fails(capsys, main, [*argv, "-o", str(tmp_path / "x.engine"), *QUICK], match)
    assert not [p for p in tmp_path.iterdir() if p.name != "cache"]  # no partial or temporary file


def test_compile_unwritable_output(tiny_opt_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for out, match in ((tmp_path / "missing" / "x.engine", "does not exist"),
                       (tmp_path / "file" / "x.engine", "does not exist"), (tmp_path, "is a folder")):
        _fails(capsys, main, [str(tiny_opt_dir), "--density", "0.3", "-o", str(out), *QUICK], match)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_inspect_bad_engines(built, tmp_path, capsys):
    good = (built / "a.engine").read_bytes()
    (n,) = struct.unpack("<Q", good[:8])
    header, tensors = read_engine(built / "a.engine")
    cases = {"truncated": good[: len(good) // 2], "flipped-data": good[:-10] + bytes([good[-10] ^ 0xFF]) + good[-9:],
             "flipped-header": good[:20] + bytes([good[20] ^ 0x01]) + good[21:], "empty": b"",
             "wrong-version": encode_engine({**header, "format_version": 2}, tensors)}
    for name, data in cases.items():
        p = tmp_path / f"{name}.engine"
        p.write_bytes(data)
        err = _fails(capsys, inspect_main, [str(p)], str(p))
        if name == "wrong-version":
            assert "version 2" in err and "version 1" in err
    _fails(capsys, inspect_main, [str(tmp_path / "none.engine")], "not found")


def test_console_scripts_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-c", "from dejavu.compiler.cli import main; main()", "opt-nope",
                        "--density", "0.3", "-o", str(tmp_path / "x.engine")],
                       capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "x.engine").exists()


def test_config_file_and_overrides(tmp_path, capsys):
    from dejavu.compiler.cli import _config, compile_parser
    from dejavu.compiler.config import BuildConfig

    f = tmp_path / "build.json"
    f.write_text(json.dumps({"density": 0.4, "dtype": "float32", "seed": 3}))
    argv = ["m", "--density", "0.3", "--config", str(f), "--seed", "5"]
    c = _config(compile_parser().parse_args(argv))
    assert (c.density, c.dtype, c.seed) == (0.3, "float32", 5)
    c = _config(compile_parser().parse_args(["m", "--density", "0.3", "--dtype", "bf16"]))
    assert c.dtype == "bfloat16" and c.calib_tokens == BuildConfig.calib_tokens  # the rest: BuildConfig's
    f.write_text(json.dumps({"density": 0.4, "bogus": 1}))
    _fails(capsys, main, ["m", "--density", "0.3", "--config", str(f)], "bogus")


def test_compile_help_shows_buildconfig_defaults(capsys):
    from dejavu.compiler.cli import compile_parser
    from dejavu.compiler.config import BuildConfig

    text = " ".join(compile_parser().format_help().split())
    d = BuildConfig  # the class attributes are the fields' defaults
    for opt, value in (("--calib-tokens", d.calib_tokens), ("--predictor-epochs", d.predictor_epochs),
                       ("--dtype", d.dtype), ("--allocation", d.allocation), ("--topk-limit", d.topk_limit),
                       ("--sensitivity-dtype", d.sensitivity_dtype), ("--token-k-rows", d.token_k_rows),
                       ("--predictor-dtype", d.predictor_dtype)):
        after = text.split(f" {opt} ", 1)[1]
        assert f"(default: {value})" in after.split(" --", 1)[0], opt


def test_heldout_option_reaches_the_config_and_a_missing_corpus_is_one_line(tmp_path, capsys):
    from dejavu.compiler.cli import _config, compile_parser

    corpus = tmp_path / "held.txt"
    corpus.write_text("some held-out text\n")
    cfg = _config(compile_parser().parse_args(["opt-mini", "--density", "0.7", "--heldout", str(corpus)]))
    assert cfg.heldout == str(corpus) and cfg.heldout_tokens == 2048
    with pytest.raises(SystemExit) as e:
        main(["opt-mini", "--density", "0.7", "--heldout", str(tmp_path / "nope.txt"), "-q",
              "-o", str(tmp_path / "m.engine")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("dejavu: error: corpus") and "not found" in err[0]
    assert not (tmp_path / "m.engine").exists()


def _compile_in_subprocess(argv: list[str]) -> tuple[subprocess.CompletedProcess, bool]:
    """Run dejavu-compile's main in a fresh interpreter: (result, whether torch was imported)."""
    code = ("import sys\nfrom dejavu.compiler.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "finally:\n    print('torch' in sys.modules, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                       env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    *lines, imported = r.stderr.strip().splitlines()
    assert imported in ("True", "False"), r.stderr
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout, "\n".join(lines)), imported == "True"


def test_compile_help_imports_no_torch():
    r, torch_imported = _compile_in_subprocess(["--help"])
    assert r.returncode == 0 and "(default: 65536)" in " ".join(r.stdout.split())  # BuildConfig's defaults shown
    assert not torch_imported


@pytest.mark.parametrize("argv,match", [
    (["m"], "one of --density or --max-ppl-increase is required"),
    (["m", "--density", "1.5"], "--density must be in (0, 1]"),
    (["m", "--density", "0.5", "--calib-tokens", "0"], "--calib-tokens must be a positive integer"),
    (["m", "--density", "0.5", "--predictor-source", "mlp_in", "--predictor-lookahead", "0"], "predictor input"),
    (["m", "--density", "0.5", "--config", "BAD"], "unknown build config key(s): bogus"),
    (["m", "--density", "0.5", "--max-ppl-increase", "1"], "not both"),
    (["m", "--density", "0.5", "--predictor-dtype", "int4"], "--predictor-dtype"),
    (["m", "--density", "0.5", "--config", "BADDTYPE"], "--predictor-dtype must be one of int8, float, got 'fp8'"),
])
def test_compile_argument_errors_before_torch(tmp_path, argv, match):
    bad, bad_dtype = tmp_path / "bad.json", tmp_path / "bad_dtype.json"
    bad.write_text(json.dumps({"bogus": 1}))
    bad_dtype.write_text(json.dumps({"predictor_dtype": "fp8"}))
    files = {"BAD": str(bad), "BADDTYPE": str(bad_dtype)}
    r, torch_imported = _compile_in_subprocess([files.get(a, a) for a in argv])
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("dejavu: error:") and match in r.stderr, r.stderr
    assert not torch_imported


_MALLINFO = """
import ctypes
from dejavu.compiler.cli import reuse_freed_memory
libc = ctypes.CDLL(None)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype, libc.malloc.restype = Info, ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
def mapped(n):  # bytes in mmapped blocks while a block of n bytes is held
    p = libc.malloc(n)
    got = libc.mallinfo2().hblkhd
    libc.free(p)
    return got
before = mapped(40 << 20)  # above glibc's largest dynamic mmap threshold (32 MiB): always mapped
from dejavu.compiler.stream import memory_bound
from dejavu.models.opt import OPTConfig
cfg = OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                max_position_embeddings=32, word_embed_proj_dim=16)
plain = memory_bound(cfg, 0)["bound_bytes"]
ok = reuse_freed_memory()
kept = memory_bound(cfg, 0)
print(before >= 40 << 20, ok, mapped(40 << 20) < 40 << 20, kept["bound_bytes"] - plain == kept["kept_heap_bytes"] == 1 << 30,
      memory_bound(cfg, 0, host=False)["bound_bytes"] == plain)
"""


def test_reuse_freed_memory_keeps_large_blocks_in_the_heap():
    """dejavu-compile's allocator setting: a 40 MiB block, mapped afresh by glibc's default, comes
    from the heap afterwards (where it is reused instead of faulted in again), and the build's host
    memory bound counts the 1 GiB of freed heap it may keep (a device's bound does not)."""
    import ctypes

    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("not glibc >= 2.33 (no mallinfo2)")
    out = subprocess.run([sys.executable, "-c", _MALLINFO], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True"] * 5


def test_compile_sets_the_allocator_before_building(tiny_opt_dir, tmp_path, monkeypatch):
    import dejavu.compiler.build as build
    import dejavu.compiler.cli as cli

    order = []
    monkeypatch.setattr(cli, "reuse_freed_memory", lambda: order.append("malloc") or True)
    monkeypatch.setattr(build, "build_engine", lambda *a, **k: order.append("build") or {"model_family": "x"})
    monkeypatch.setattr(cli, "format_summary", lambda s: "")
    main([str(tiny_opt_dir), "--density", "1.0", "--no-predictors", "-o", str(tmp_path / "e.engine")])
    assert order == ["malloc", "build"]
