"""dejavu-generate: streamed text, defaults from GenerateSettings, one-line errors."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from dejavu.models.cli import GenerateSettings, build_parser, main
from dejavu.models.generate import generate
from dejavu.models.loader import load_model
from dejavu.models.tokenizer import TextTokenizer


def test_defaults_come_from_settings():
    args = build_parser().parse_args(["m", "--prompt", "x"])
    for f in dataclasses.fields(GenerateSettings):
        assert getattr(args, f.name) == f.default


def test_greedy_text_matches_generate(tiny_opt_dir, capsys):
    assert main([str(tiny_opt_dir), "--prompt", "The city", "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    model, _ = load_model(tiny_opt_dir)
    tok = TextTokenizer.from_pretrained(tiny_opt_dir)
    ids = generate(model, [tok.encode("The city")], 8, eos_id=tok.eos_id)[0]
    assert out == "The city" + tok.decode(ids) + "\n"
    assert "tokens in" in err


def test_sampled_text_reproducible(tiny_opt_dir, capsys):
    argv = [str(tiny_opt_dir), "--prompt", "A", "--max-new-tokens", "8", "--temperature", "1.0",
            "--top-k", "20", "--top-p", "0.9", "--seed", "7", "--dtype", "bf16"]
    main(argv)
    first = capsys.readouterr().out
    main(argv)
    assert capsys.readouterr().out == first


def test_missing_model_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["/no/such/model", "--prompt", "hi"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dejavu: error: model '/no/such/model' not found") and err.count("\n") == 1


def test_cli_subprocess_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt_neox", "hidden_size": 64}')
    code = "import sys; from dejavu.models.cli import main; sys.exit(main())"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model_type" in lines[0] and lines[0].startswith("dejavu: error:")


def test_cuda_without_gpu_is_one_line(tiny_opt_dir, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit) as e:
        main([str(tiny_opt_dir), "--prompt", "hi", "--max-new-tokens", "4", "--device", "cuda"])
    assert e.value.code == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_top_p_alone_samples_and_zero_temperature_with_top_p_fails(tiny_opt_dir, capsys):
    main([str(tiny_opt_dir), "--prompt", "A", "--max-new-tokens", "8", "--top-p", "0.9", "--seed", "7"])
    got = capsys.readouterr().out
    model, _ = load_model(tiny_opt_dir)
    tok = TextTokenizer.from_pretrained(tiny_opt_dir)
    ids = generate(model, [tok.encode("A")], 8, temperature=1.0, top_p=0.9, seed=7, eos_id=tok.eos_id)[0]
    assert got == "A" + tok.decode(ids) + "\n"
    with pytest.raises(SystemExit) as e:
        main([str(tiny_opt_dir), "--prompt", "A", "--temperature", "0", "--top-p", "0.9"])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "temperature is 0" in err


def test_long_prompt_fails_before_the_load_and_the_echo(tiny_opt_dir, capsys):
    from dejavu.models.loader import load_config

    limit = load_config(tiny_opt_dir).max_position_embeddings
    with pytest.raises(SystemExit) as e:
        main([str(tiny_opt_dir), "--prompt", "word " * limit])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"exceeds the model's {limit} positions" in err


@pytest.mark.parametrize("alias,name", [("fp32", "float32"), ("bf16", "bfloat16"), ("half", "float16")])
def test_dtype_aliases(alias, name):
    assert build_parser().parse_args(["m", "--prompt", "x", "--dtype", alias]).dtype == name
def test_cli_subprocess_incomplete_llama_config(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    code = "import sys; from dejavu.models.cli import main; sys.exit(main())"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "vocab_size" in lines[0] and lines[0].startswith("dejavu: error:")


def test_chat_renders_the_models_template(make_tiny_opt_dir, capsys):
    """--chat [--system]: the prompt as a user message in the folder's chat template (tokenizer_config.json),
    tokenized as transformers' apply_chat_template tokenizes it; the reply alone printed. A folder without a
    template, and --system without --chat: one error line, exit 2."""
    import json

    pytest.importorskip("jinja2")
    from transformers import PreTrainedTokenizerFast

    folder = make_tiny_opt_dir()
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    for bad, why in (([str(folder), "--chat", "--prompt", "x"], "carries no chat template"),
                     ([str(folder), "--system", "s", "--prompt", "x"], "--system is a chat message: give --chat")):
        with pytest.raises(SystemExit) as e:
            main(bad)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and why in err[0]
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert main([str(folder), "--chat", "--system", "Be brief.", "--prompt", "The city", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    tok = TextTokenizer.from_pretrained(folder)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The city"}]
    ids = PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer).apply_chat_template(
        msgs, chat_template=template, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ids[0] != tok.bos_id  # the template writes no BOS, and none is added
    want = generate(load_model(folder)[0], [ids], 6, eos_id=tok.eos_id)[0]
    assert out == tok.decode(want) + "\n" and want
