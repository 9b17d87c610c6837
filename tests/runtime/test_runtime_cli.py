"""Engine files through `Engine.load` and `dejavu-run` (CPU)."""
from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys

import pytest

from dejavu.engine_file import write_engine
from dejavu.runtime import Engine
from dejavu.runtime.cli import main
from runtime_helpers import engine_from_dense, tiny_model, tiny_tokenizer_json


@pytest.fixture(scope="module")
def engine_file(tmp_path_factory):
    model = tiny_model(seed=11, vocab_size=300)
    header, tensors = engine_from_dense(model, 0.5, 0.5, tokenizer_json=tiny_tokenizer_json())
    path = tmp_path_factory.mktemp("eng") / "tiny.engine"
    write_engine(path, header, tensors)
    return path, header, tensors


def test_load_equals_from_tensors(engine_file):
    path, header, tensors = engine_file
    a = Engine.load(path).generate(["The game"], 12, stop_at_eos=False)
    b = Engine.from_tensors(header, tensors).generate(["The game"], 12, stop_at_eos=False)
    assert a == b
    eng = Engine.load(path)
    assert eng.tokenizer.encode("The game")[0] == eng.spec.bos_id
    assert isinstance(eng.complete(["The game"], 4)[0], str)
    assert eng.describe()["kernels"]["sparse_fc1"] == "ref"
    assert eng.describe()["programmatic_launch"] is False  # CPU: reference kernels, plain calls


def test_cli_streams_prompt_and_completion(engine_file, capsys):
    path, _, _ = engine_file
    assert main([str(path), "--prompt", "The game", "--max-new-tokens", "8", "--stats"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("The game") and len(out) > len("The game\n")
    assert "tokens/s" in err


def test_cli_batch_file_one_line_per_file_line(engine_file, tmp_path, capsys):
    path, _, _ = engine_file
    f = tmp_path / "prompts.txt"
    f.write_text("The game\n\nIn 1990 the\n")
    assert main([str(path), "--batch-file", str(f), "--max-new-tokens", "6", "--no-overlap",
                 "--temperature", "0.8", "--top-k", "5", "--seed", "1"]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert lines[-1] == "" and len(lines) == 4  # one line per line of the file, the blank one kept
    assert lines[0].startswith("[0] The game") and lines[1].startswith("[1] ")
    assert lines[2].startswith("[2] In 1990 the")


def test_cli_batch_jsonl_matches_engine(engine_file, tmp_path, capsys):
    path, _, _ = engine_file
    f = tmp_path / "prompts.txt"
    f.write_text("The game\n\nIn 1990 the\n")
    assert main([str(path), "--batch-file", str(f), "--max-new-tokens", "6", "--output-format", "jsonl"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    eng = Engine.load(path)
    want = eng.generate(["The game", "", "In 1990 the"], 6)
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert [r["prompt"] for r in rows] == ["The game", "", "In 1990 the"]
    assert [r["tokens"] for r in rows] == want
    assert [r["completion"] for r in rows] == [eng.tokenizer.decode(t) for t in want]


def test_cli_stats_readable_and_json(engine_file, capsys):
    path, _, _ = engine_file
    assert main([str(path), "--prompt", "The game", "--max-new-tokens", "8", "--stats"]) == 0
    err = capsys.readouterr().err
    assert "{" not in err and "ms/step" in err and "decode steps" in err
    assert main([str(path), "--prompt", "The game", "--max-new-tokens", "8", "--stats", "--output-format", "json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    (row,) = obj["outputs"]
    assert obj["stats"]["new_tokens"] == len(row["tokens"])  # the prefill's token counted
    assert obj["stats"]["decode_steps"] == len(row["tokens"]) - 1


def test_stats_new_tokens_counts_every_token(engine_file):
    path, _, _ = engine_file
    eng = Engine.load(path)
    (out,) = eng.generate(["The game"], 32, stop_at_eos=False)
    assert len(out) == 32 and eng.stats.new_tokens == 32 and eng.stats.decode_steps == 31


def test_complete_takes_a_bare_string_and_shares_the_cli_default(engine_file):
    from dejavu.generation import GENERATION
    from dejavu.runtime.cli import build_parser

    path, _, _ = engine_file
    eng = Engine.load(path)
    assert eng.complete("The game", 5) == eng.complete(["The game"], 5)
    for fn in (Engine.generate, Engine.complete):
        assert inspect.signature(fn).parameters["max_new_tokens"].default == GENERATION.max_new_tokens
    assert build_parser().parse_args(["x", "--prompt", "y"]).max_new_tokens == GENERATION.max_new_tokens


def test_top_p_alone_samples_at_temperature_1(engine_file, capsys):
    path, _, _ = engine_file
    argv = [str(path), "--prompt", "The game", "--max-new-tokens", "12", "--top-p", "0.9", "--seed", "3",
            "--output-format", "jsonl"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)["tokens"]
    eng = Engine.load(path)
    assert got == eng.generate(["The game"], 12, temperature=1.0, top_p=0.9, seed=3)[0]
    assert got == eng.generate(["The game"], 12, top_p=0.9, seed=3)[0]  # the API: the same rule
    assert got != eng.generate(["The game"], 12)[0]  # not greedy


@pytest.mark.parametrize("argv,msg", [
    (["/nonexistent.engine", "--prompt", "x"], "not found"),
    (["{engine}"], "exactly one of"),
    (["{engine}", "--prompt", "x", "--max-new-tokens", "0"], "max-new-tokens"),
    (["{engine}", "--prompt", "x", "--top-p", "0"], "top_p"),
    (["{engine}", "--prompt", "x", "--device", "tpu"], "device"),
    (["{engine}", "--batch-file", "/nonexistent.txt"], "batch file"),
    (["{engine}", "--batch-file", "{latin1}"], "not UTF-8"),
    (["{engine}", "--prompt", "x", "--temperature", "0", "--top-p", "0.9"], "temperature is 0"),
    (["{engine}", "--prompt", "x", "--dtype", "int8"], "--dtype"),
    (["{engine}", "--prompt", "x", "--output-format", "csv"], "--output-format"),
    (["{engine}", "--prompt", "word " * 100, "--max-new-tokens", "64"], "exceeds the model's 128 positions"),
])
def test_cli_errors_one_line_exit_2(engine_file, tmp_path, capsys, argv, msg):
    path, _, _ = engine_file
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(SystemExit) as e:
        main([a.replace("{engine}", str(path)).replace("{latin1}", str(latin1)) for a in argv])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing echoed before the check (the prompt-length check runs before the load)
    assert len(err.strip().splitlines()) == 1 and msg in err, err


def _script(code: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; from dejavu.runtime.cli import main; {code}"]


def test_broken_pipe_is_silent(engine_file, tmp_path):
    """`dejavu-run ... | head -1`: the reader is gone; no traceback, exit 141 as SIGPIPE gives."""
    path, _, _ = engine_file
    f = tmp_path / "p.txt"
    f.write_text("The game\nIn 1990\n")
    r, w = os.pipe()
    os.close(r)  # the reader has gone before the first write
    try:
        p = subprocess.run(_script(f"sys.exit(main([{str(path)!r}, '--batch-file', {str(f)!r}, "
                                   "'--max-new-tokens', '2']))"), stdout=w, stderr=subprocess.PIPE, text=True,
                           timeout=300)
    finally:
        os.close(w)
    assert p.returncode == 141 and p.stderr == "", p.stderr


def test_ctrl_c_while_importing_torch_is_one_line(engine_file):
    """Ctrl-C while `main` imports torch (its first ~2 s): one line, exit 130. The child holds
    the import of torch open (an import hook that waits) so the signal lands there."""
    path, _, _ = engine_file
    hook = ("import builtins, time\n"
            "real = builtins.__import__\n"
            "def hook(name, *a, **k):\n"
            "    if name == 'torch' and 'torch' not in sys.modules:\n"
            "        print('importing torch', file=sys.stderr, flush=True)\n"
            "        time.sleep(60)\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = hook\n")
    code = (f"import sys\n{hook}from dejavu.runtime.cli import main\n"
            f"sys.exit(main([{str(path)!r}, '--prompt', 'x', '--max-new-tokens', '4']))")
    # the child starts with SIGINT at its default, as an interactive shell starts it: a suite launched in the
    # background by a non-interactive shell (`pytest ... &`) runs with SIGINT ignored, and the child would inherit it
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert p.stderr.readline() == "importing torch\n"
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and err == "dejavu: interrupted\n" and out == "", err


def test_corrupt_engine_is_dejavu_error(engine_file, tmp_path):
    path, _, _ = engine_file
    bad = tmp_path / "bad.engine"
    bad.write_bytes(path.read_bytes()[:1000])
    from dejavu.errors import DejavuError
    with pytest.raises(DejavuError):
        Engine.load(bad)
