"""Engine files through `Engine.load` and `dejavu-run` (CPU)."""
from __future__ import annotations

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


def test_cli_batch_file(engine_file, tmp_path, capsys):
    path, _, _ = engine_file
    f = tmp_path / "prompts.txt"
    f.write_text("The game\n\nIn 1990 the\n")
    assert main([str(path), "--batch-file", str(f), "--max-new-tokens", "4", "--no-overlap",
                 "--temperature", "0.8", "--top-k", "5", "--seed", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[0] The game") and lines[1].startswith("[1] In 1990 the")


@pytest.mark.parametrize("argv,msg", [
    (["/nonexistent.engine", "--prompt", "x"], "not found"),
    (["{engine}"], "exactly one of"),
    (["{engine}", "--prompt", "x", "--max-new-tokens", "0"], "max-new-tokens"),
    (["{engine}", "--prompt", "x", "--top-p", "0"], "top_p"),
    (["{engine}", "--prompt", "x", "--device", "tpu"], "device"),
    (["{engine}", "--batch-file", "/nonexistent.txt"], "batch file"),
])
def test_cli_errors_one_line_exit_2(engine_file, capsys, argv, msg):
    path, _, _ = engine_file
    with pytest.raises(SystemExit) as e:
        main([a.replace("{engine}", str(path)) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err


def test_corrupt_engine_is_dejavu_error(engine_file, tmp_path):
    path, _, _ = engine_file
    bad = tmp_path / "bad.engine"
    bad.write_bytes(path.read_bytes()[:1000])
    from dejavu.errors import DejavuError
    with pytest.raises(DejavuError):
        Engine.load(bad)
