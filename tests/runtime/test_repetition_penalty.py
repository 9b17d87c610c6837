"""The repetition penalty of `Engine.generate`, `dejavu-run`, the dense `generate` and the server's scheduler
(models/sampling.Penalties) against transformers' RepetitionPenaltyLogitsProcessor and its `generate`; OpenAI's
presence / frequency penalties of the same against a reference loop."""
from __future__ import annotations

import json

import pytest
import torch

from dejavu.compiler.build import build_engine
from dejavu.compiler.config import BuildConfig
from dejavu.engine_file import read_engine, write_engine
from dejavu.errors import DejavuError
from dejavu.models.generate import generate as dense_generate
from dejavu.models.sampling import Penalties
from dejavu.runtime import Engine
from llama_helpers import write_tiny_llama

transformers = pytest.importorskip("transformers")

PROMPTS = [[0, 17, 93, 5, 17, 60, 2], [0, 44, 8]]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(folder, dense engine path, transformers' model of the folder) for a tiny random GQA Llama."""
    root = tmp_path_factory.mktemp("rp")
    folder = write_tiny_llama(root / "tiny", seed=7)
    path = root / "dense.engine"
    build_engine(folder, BuildConfig(density=1.0, calib_tokens=256, calib_window=64, dtype="float32"), path,
                 progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, path, hf


def _hf_greedy(hf, prompt: list[int], n: int, penalty: float) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, repetition_penalty=penalty)
    return out[0, len(prompt):].tolist()


def test_penalties_equal_transformers_processor_as_tokens_come():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3, 9), generator=g)
    pen = Penalties(ids.tolist(), 50, "cpu", repetition=1.7)
    ref = RepetitionPenaltyLogitsProcessor(1.7)
    for _ in range(4):
        logits = 3 * torch.randn(3, 50, generator=g)
        got = pen(logits)
        assert torch.equal(got, ref(ids, logits.clone()))
        assert not torch.equal(got, logits)  # some seen token's logit moved
        nxt = torch.randint(0, 50, (3,), generator=g)
        pen.add(nxt)
        ids = torch.cat([ids, nxt[:, None]], 1)


def test_penalties_frequency_presence_and_bias_follow_openais_formula():
    g = torch.Generator().manual_seed(1)
    pen = Penalties([[4, 4, 9]], 20, "cpu", presence=0.5, frequency=0.25, logit_bias=[(3, 2.0), (4, -1.0)])
    for t in (4, 7, 4):
        pen.add(torch.tensor([t]))
    logits = torch.randn(1, 20, generator=g)
    want = logits.clone()
    want[0, 4] -= 2 * 0.25 + 0.5  # generated twice (the prompt's don't count)
    want[0, 7] -= 0.25 + 0.5
    want[0, 3] += 2.0
    want[0, 4] -= 1.0
    assert torch.allclose(pen(logits), want)


def test_dense_generate_equals_transformers_generate_with_a_penalty(built):
    from dejavu.models.auto import load_llama

    folder, _, hf = built
    model = load_llama(folder)[0]
    for prompt in PROMPTS:
        want = _hf_greedy(hf, prompt, 12, 1.8)
        assert dense_generate(model, [prompt], 12, repetition_penalty=1.8)[0] == want
        assert want != _hf_greedy(hf, prompt, 12, 1.0)  # the penalty changed the tokens


def test_engine_generate_equals_transformers_generate_with_a_penalty(built):
    _, path, hf = built
    eng = Engine.load(path)
    together = eng.generate(PROMPTS, 12, stop_at_eos=False, repetition_penalty=1.8)  # right-padded batch
    assert together == [_hf_greedy(hf, p, 12, 1.8) for p in PROMPTS]
    assert together != eng.generate(PROMPTS, 12, stop_at_eos=False, repetition_penalty=1.0)


def test_engine_takes_the_checkpoints_penalty_unless_given(built, tmp_path):
    _, path, hf = built
    header, tensors = read_engine(path)
    header["sampling_defaults"] = {"repetition_penalty": 1.8}
    own = tmp_path / "own.engine"
    write_engine(own, header, tensors)
    eng = Engine.load(own)
    assert eng.generate(PROMPTS[:1], 12, stop_at_eos=False) == [_hf_greedy(hf, PROMPTS[0], 12, 1.8)]
    assert eng.generate(PROMPTS[:1], 12, stop_at_eos=False, repetition_penalty=1.0) == \
        [_hf_greedy(hf, PROMPTS[0], 12, 1.0)]
    with pytest.raises(DejavuError, match="repetition_penalty must be > 0"):
        eng.generate(PROMPTS[:1], 4, repetition_penalty=0.0)


def test_dejavu_run_repetition_penalty(built, capsys):
    from dejavu.runtime.cli import main as run_main

    _, path, _ = built
    args = [str(path), "--prompt", "The game", "--max-new-tokens", "8", "--output-format", "json"]
    assert run_main(args + ["--repetition-penalty", "1.8"]) == 0
    got = json.loads(capsys.readouterr().out)["outputs"][0]["tokens"]
    eng = Engine.load(path)
    assert got == eng.generate(["The game"], 8, repetition_penalty=1.8)[0]
    with pytest.raises(SystemExit) as e:
        run_main(args + ["--repetition-penalty", "-1"])
    assert e.value.code != 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().count("\n") == 0 and "repetition_penalty" in captured.err


def test_dejavu_generate_takes_the_folders_generation_config(built, tmp_path, capsys):
    """dejavu-generate (the dense model) applies generation_config.json's repetition_penalty, as transformers'
    generate does, and --repetition-penalty overrides it."""
    import shutil

    from dejavu.models.auto import load_text_tokenizer
    from dejavu.models.cli import main as gen_main

    folder, _, hf = built
    own = tmp_path / "own"
    shutil.copytree(folder, own)
    cfg = json.loads((own / "generation_config.json").read_text()) if (own / "generation_config.json").is_file() else {}
    (own / "generation_config.json").write_text(json.dumps({**cfg, "repetition_penalty": 1.8}))
    tok = load_text_tokenizer(own)
    ids = tok.encode("The game")
    outs = []
    for extra, penalty in (([], 1.8), (["--repetition-penalty", "1.0"], 1.0)):
        assert gen_main([str(own), "--prompt", "The game", "--max-new-tokens", "8", "--device", "cpu",
                         "--dtype", "float32"] + extra) == 0
        outs.append(capsys.readouterr().out)
        assert outs[-1] == "The game" + tok.decode(_hf_greedy(hf, ids, 8, penalty)) + "\n"
    assert outs[0] != outs[1]


def test_min_p_draws_from_transformers_kept_set():
    """sample_next's min_p keeps the tokens transformers' MinPLogitsWarper keeps (after temperature): 4,000 draws
    cover that set and nothing outside it; min_p 0 draws outside it."""
    from transformers.generation.logits_process import MinPLogitsWarper

    from dejavu.models.sampling import sample_next

    logits = torch.tensor([[3.0, 2.6, 2.2, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(4000, 1)
    kept = set(torch.isfinite(MinPLogitsWarper(0.3)(None, logits[:1] / 0.8)).nonzero()[:, 1].tolist())
    g = torch.Generator().manual_seed(0)
    drawn = set(sample_next(logits, 0.8, 0, 1.0, g, min_p=0.3).tolist())
    assert drawn == kept and 2 <= len(kept) < 8
    assert set(sample_next(logits, 0.8, 0, 1.0, g).tolist()) - kept
    with pytest.raises(DejavuError, match="min_p"):
        sample_next(logits, 1.0, 0, 1.0, g, min_p=2.0)


def _openai_greedy(model, prompt: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """Greedy tokens by hand: the dense model's logits (the whole sequence recomputed each step, in float64) minus
    OpenAI's formula over the tokens generated so far, frequency * count + presence * [count > 0]."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            lg = model(torch.tensor([prompt + out]))[0, -1].double()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=lg.numel()).double()
            out.append(int((lg - frequency * counts - presence * (counts > 0).double()).argmax()))
    return out


def test_engine_presence_and_frequency_penalties_follow_openais_formula(built):
    """Engine.generate's presence / frequency penalties: its greedy tokens equal a reference loop over the dense
    model's logits minus OpenAI's formula over the generated tokens, and differ from the unpenalized ones; a value
    outside [-2, 2] is a DejavuError."""
    from dejavu.models.auto import load_llama

    folder, path, _ = built
    eng, model = Engine.load(path), load_llama(folder)[0]
    prompt, out = PROMPTS[0], _openai_greedy(model, PROMPTS[0], 12, 0.6, 0.9)
    got = eng.generate([prompt], 12, stop_at_eos=False, repetition_penalty=1.0, presence_penalty=0.6,
                       frequency_penalty=0.9)[0]
    assert got == out and got != eng.generate([prompt], 12, stop_at_eos=False, repetition_penalty=1.0)[0]
    with pytest.raises(DejavuError, match=r"frequency_penalty must be a number in \[-2, 2\], got -3"):
        eng.generate([prompt], 4, frequency_penalty=-3)


def test_dense_generate_presence_and_frequency_penalties_follow_openais_formula(built):
    """The dense `generate`: with presence penalty 2 the greedy tokens never repeat where the unpenalized ones do,
    and equal the reference loop; presence and frequency together on a left-padded batch equal the loop per prompt;
    a value outside [-2, 2] is a DejavuError."""
    from dejavu.models.auto import load_llama

    model = load_llama(built[0])[0]
    for prompt in PROMPTS:
        plain = dense_generate(model, [prompt], 16)[0]
        got = dense_generate(model, [prompt], 16, presence_penalty=2.0)[0]
        assert len(set(plain)) < 16 and len(set(got)) == 16
        assert got == _openai_greedy(model, prompt, 16, 2.0, 0.0)
    assert dense_generate(model, PROMPTS, 12, presence_penalty=0.6, frequency_penalty=0.9) == \
        [_openai_greedy(model, p, 12, 0.6, 0.9) for p in PROMPTS]
    with pytest.raises(DejavuError, match="presence_penalty must be a number in"):
        dense_generate(model, PROMPTS, 4, presence_penalty=2.5)


BAD_PENALTIES = [("--presence-penalty", "2.5"), ("--frequency-penalty", "-3"), ("--presence-penalty", "nan")]


def _one_error_line(capsys, e, flag: str) -> None:
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"dejavu: error: {flag} must be a number in [-2, 2], got "), err


def test_dejavu_run_presence_and_frequency_penalties(built, capsys):
    """dejavu-run --presence-penalty 2: greedy tokens that never repeat (the unpenalized ones do), equal to the
    reference loop; --frequency-penalty alone too; a value outside [-2, 2] (or NaN) is one error line, exit 2."""
    from dejavu.models.auto import load_llama
    from dejavu.runtime.cli import main as run_main

    folder, path, _ = built
    model, prompt = load_llama(folder)[0], Engine.load(path).tokenizer.encode("The game")
    args = [str(path), "--prompt", "The game", "--max-new-tokens", "12", "--output-format", "json"]
    got = {}
    for extra in ([], ["--presence-penalty", "2"], ["--frequency-penalty", "1.5"]):
        assert run_main(args + extra) == 0
        got[tuple(extra)] = json.loads(capsys.readouterr().out)["outputs"][0]["tokens"]
    assert len(set(got[()])) < 12 and len(set(got[("--presence-penalty", "2")])) == 12
    assert got[("--presence-penalty", "2")] == _openai_greedy(model, prompt, 12, 2.0, 0.0)
    assert got[("--frequency-penalty", "1.5")] == _openai_greedy(model, prompt, 12, 0.0, 1.5) != got[()]
    for flag, value in BAD_PENALTIES:
        with pytest.raises(SystemExit) as e:
            run_main(args + [flag, value])
        _one_error_line(capsys, e, flag)


def test_dejavu_generate_presence_and_frequency_penalties(built, capsys):
    """dejavu-generate (the dense model) --presence-penalty / --frequency-penalty: the text of the reference loop's
    tokens, other than the unpenalized text; a value outside [-2, 2] (or NaN) is one error line before the load."""
    from dejavu.models.auto import load_llama, load_text_tokenizer
    from dejavu.models.cli import main as gen_main

    folder = built[0]
    model, tok = load_llama(folder)[0], load_text_tokenizer(folder)
    ids = tok.encode("The game")
    args = [str(folder), "--prompt", "The game", "--max-new-tokens", "12", "--device", "cpu", "--dtype", "float32"]
    assert gen_main(args) == 0
    plain = capsys.readouterr().out
    for extra, presence, frequency in ((["--presence-penalty", "2"], 2.0, 0.0),
                                       (["--presence-penalty", "0.5", "--frequency-penalty", "1"], 0.5, 1.0)):
        assert gen_main(args + extra) == 0
        out = capsys.readouterr().out
        assert out == "The game" + tok.decode(_openai_greedy(model, ids, 12, presence, frequency)) + "\n" != plain
    for flag, value in BAD_PENALTIES:
        with pytest.raises(SystemExit) as e:
            gen_main(args + [flag, value])
        _one_error_line(capsys, e, flag)
