"""dejavu-eval: perplexity against transformers, task scoring against a hand computation,
engine = dense at density 1.0, report, and the error paths."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dejavu.errors import DejavuError
from dejavu.runtime.evaluation.evaluate import load_scoring_model, main
from dejavu.runtime.evaluation.tasks import evaluate_task, load_task

from _helpers import write_test_engine

TEXT_CHARS = 6000


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    import dejavu

    from pathlib import Path

    src = Path(dejavu.__file__).parent / "data" / "wikitext-2" / "test.txt"
    p = tmp_path_factory.mktemp("text") / "wiki.txt"
    p.write_text(src.read_text(encoding="utf-8")[:TEXT_CHARS], encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def dense_engine(tiny_opt_dir, tmp_path_factory):
    return write_test_engine(tiny_opt_dir, tmp_path_factory.mktemp("eng") / "d1.engine")


def _run_json(capsys, argv) -> dict:
    assert main(argv + ["--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


def test_perplexity_equals_transformers(tiny_opt_dir, text_file, capsys):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    got = _run_json(capsys, [str(tiny_opt_dir), "--ppl-file", str(text_file)])
    hf = transformers.OPTForCausalLM.from_pretrained(tiny_opt_dir, attn_implementation="eager").float().eval()
    tok = Tokenizer.from_file(str(tiny_opt_dir / "tokenizer.json"))
    lines = text_file.read_text(encoding="utf-8").split("\n")  # line by line, as opt-mini was trained
    ids = torch.tensor([2] + [i for e in tok.encode_batch([ln + "\n" for ln in lines], add_special_tokens=False)
                              for i in e.ids])
    window = hf.config.max_position_embeddings
    nll, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, ids.numel(), window):
            c = ids[i:i + window]
            if c.numel() < 2:
                continue
            logits = hf(c[None]).logits[0].double()
            nll += torch.nn.functional.cross_entropy(logits[:-1], c[1:], reduction="sum").item()
            n += c.numel() - 1
    assert got["ppl_tokens"] == n
    assert got["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-3)


def test_ppl_tokens_prefix_equals_whole_text_prefix(tiny_opt_dir, text_file):
    from dejavu.runtime.evaluation.evaluate import text_ids

    sm = load_scoring_model(str(tiny_opt_dir))
    text = text_file.read_text(encoding="utf-8")
    full = text_ids(sm, text)
    assert torch.equal(text_ids(sm, text, 300), full[:300]) and full[0].item() == sm.bos_id


def _hand_logprob(model, tok, context: str, continuation: str) -> float:
    """log p(continuation | </s> context), one sequence, no batching, no shared code."""
    ctx = [tok.bos_id] + tok.encode(context, add_bos=False)
    cont = tok.encode(continuation, add_bos=False)
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0].double(), -1)
    return sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))


def test_task_scoring_equals_hand_computation(tiny_opt_dir, tmp_path):
    rows = [{"query": "The cat sat on the", "choices": ["mat.", "history of the world."], "gold": 0},
            {"query": "In 2004 he had a role in", "choices": ["the play", "a film", "rain"], "gold": 2}]
    f = tmp_path / "mine.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    sm = load_scoring_model(str(tiny_opt_dir))
    model, tok = sm.info["model"], sm.tokenizer
    res = evaluate_task(load_task(str(f)), sm.logits_fn, sm.encode, sm.bos_id, sm.max_len,
                        batch_size=2, progress=False)
    correct = correct_norm = 0
    for row, d in zip(rows, res.details):
        hand = [_hand_logprob(model, tok, row["query"], " " + c) for c in row["choices"]]
        assert d["logprobs"] == pytest.approx(hand, abs=1e-4)
        correct += max(range(len(hand)), key=hand.__getitem__) == row["gold"]
        norm = [h / len(" " + c) for h, c in zip(hand, row["choices"])]
        correct_norm += max(range(len(norm)), key=norm.__getitem__) == row["gold"]
    assert res.acc == correct / 2 and res.acc_norm == correct_norm / 2
    d = res.as_dict()
    assert sum(d["correct"]) == correct and sum(d["correct_norm"]) == correct_norm
    assert d["stderr"] == pytest.approx(np.sqrt(res.acc * (1 - res.acc) / 1))  # lm-eval's: n - 1 = 1


@pytest.mark.parametrize("a, b", [([1, 1, 0, 0, 1], [1, 0, 1, 0, 0]), ([0, 1, 1], [0, 1, 1]), ([1] * 7 + [0], [0] * 8)])
def test_paired_difference_equals_numpy(a, b):
    from dejavu.runtime.evaluation.tasks import paired_difference

    d = np.subtract(b, a, dtype=np.float64)
    mean, se = paired_difference(a, b)
    assert mean == pytest.approx(d.mean()) and se == pytest.approx(d.std(ddof=1) / np.sqrt(len(d)))


def test_paired_difference_bad_input_is_one_error():
    from dejavu.runtime.evaluation.tasks import paired_difference

    with pytest.raises(DejavuError, match="two equal, non-empty lists"):
        paired_difference([1, 0], [1])
    with pytest.raises(DejavuError, match="two equal, non-empty lists"):
        paired_difference([], [])
    assert paired_difference([1], [0]) == (-1.0, None)


def test_shipped_task_formats():
    assert load_task("rte", 2).examples[0].pairs[0][0].endswith(" True or False? Answer:")
    assert [p[1] for p in load_task("rte", 1).examples[0].pairs] == [" True", " False"]
    w = load_task("winogrande", 1).examples[0]
    assert len(w.pairs) == 2 and w.pairs[0][1] == w.pairs[1][1] and w.pairs[0][1].startswith(" ")
    assert load_task("lambada_openai", 3).examples[0].kind == "greedy"
    assert load_task("piqa", 1).examples[0].pairs[0][0].endswith("\nAnswer:")
    assert load_task("openbookqa", 1).metrics == ("acc", "acc_norm")


def test_engine_density_1_matches_dense(tiny_opt_dir, dense_engine, text_file, capsys):
    argv = ["--ppl-file", str(text_file), "--task", "copa", "winogrande", "--limit", "4"]
    dense = _run_json(capsys, [str(tiny_opt_dir)] + argv)
    eng = _run_json(capsys, [str(dense_engine)] + argv)
    assert eng["kind"] == "engine" and eng["density"] == 1.0
    assert eng["perplexity"] == pytest.approx(dense["perplexity"], rel=1e-4)
    assert eng["tasks"] == dense["tasks"]


def test_report_for_several_runs(tiny_opt_dir, dense_engine, tmp_path, text_file, capsys):
    sparse = write_test_engine(tiny_opt_dir, tmp_path / "d5.engine", density=0.5)
    out = _run_json(capsys, [str(tiny_opt_dir), str(dense_engine), str(sparse), "--ppl-file", str(text_file),
                             "--ppl-tokens", "200", "--task", "copa", "--limit", "2",
                             "--report", str(tmp_path / "rep")])
    assert [r["density"] for r in out["runs"]] == [None, 1.0, 0.5]
    md = (tmp_path / "rep" / "README.md").read_text()
    assert "| copa |" in md and "metrics_vs_density.png" in md
    assert (tmp_path / "rep" / "metrics_vs_density.png").read_bytes()[:4] == b"\x89PNG"


def test_tasks_alone_skip_perplexity_and_any_order_works(tiny_opt_dir, text_file, capsys):
    """`--task copa MODEL` (the task list swallows the model) = `MODEL --task copa`; no perplexity
    unless asked; comma lists and repeated --task add up."""
    a = _run_json(capsys, ["--task", "copa", str(tiny_opt_dir), "--limit", "2"])
    b = _run_json(capsys, [str(tiny_opt_dir), "--task", "copa", "--limit", "2"])
    assert a == {**b, "seconds": a["seconds"]} and "perplexity" not in a and list(a["tasks"]) == ["copa"]
    c = _run_json(capsys, [str(tiny_opt_dir), "--tasks", "copa,winogrande", "--limit", "2", "--ppl-tokens", "100",
                           "--ppl-file", str(text_file)])
    assert list(c["tasks"]) == ["copa", "winogrande"] and 0 < c["ppl_tokens"] < 100
    assert c["tasks"]["copa"] == a["tasks"]["copa"]
    assert "perplexity" in _run_json(capsys, [str(tiny_opt_dir), "--ppl-file", str(text_file), "--ppl-tokens", "50"])
    assert c["ppl_file"] == str(text_file)  # outside the working folder: as given


def test_single_engine_report_adds_dense_and_compares(tiny_opt_dir, tmp_path, monkeypatch, capsys):
    sparse = write_test_engine(tiny_opt_dir, tmp_path / "d5.engine", density=0.5)
    monkeypatch.chdir(tmp_path)
    out = _run_json(capsys, ["d5.engine", "--task", "piqa", "--limit", "6", "--report", "rep"])
    assert [r["density"] for r in out["runs"]] == [None, 0.5]  # the engine's dense model was added
    md = (tmp_path / "rep" / "README.md").read_text()
    assert "n/a" not in md and "perplexity: not measured" in md
    assert "| piqa (norm) |" in md.split("Agreement")[1]  # agreement for acc and acc_norm
    dense, eng = out["runs"]
    same = sum(x == y for x, y in zip(dense["tasks"]["piqa"]["preds_norm"], eng["tasks"]["piqa"]["preds_norm"]))
    assert f"| {100 * same / 6:.1f} |" in md.split("Agreement")[1]
    diff = 100 * (eng["tasks"]["piqa"]["acc_norm"] - dense["tasks"]["piqa"]["acc_norm"])
    gold = [ex.gold for ex in load_task("piqa", limit=6).examples]
    cd, ce = ([int(x == g) for x, g in zip(r["tasks"]["piqa"]["preds_norm"], gold)] for r in (dense, eng))
    assert eng["tasks"]["piqa"]["correct_norm"] == ce and dense["tasks"]["piqa"]["correct_norm"] == cd
    se = 100 * np.std(np.subtract(ce, cd, dtype=np.float64), ddof=1) / np.sqrt(6)
    # the difference from dense in points, ± its paired standard error
    assert f"({diff:+.1f} ± {se:.1f})" in md.split("Agreement")[0]
    saved = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert not any(str(r["model"]).startswith("/") for r in saved)
    # what guessing scores on the same six examples: a blind guess (two choices) / the most common gold index
    top = max(gold.count(0), gold.count(1)) / 6
    assert dense["tasks"]["piqa"]["chance"] == pytest.approx({"uniform": 0.5, "majority": top})
    assert f"| chance: blind / most common answer | | 50.0 / {100 * top:.1f} | 50.0 / {100 * top:.1f} |" in md


def test_chance_levels_count_the_gold_answers():
    from dejavu.runtime.evaluation.tasks import chance_levels

    rte = load_task("rte")  # GLUE RTE validation: 146 entailment, 131 not (docs SOURCES)
    assert chance_levels(rte) == pytest.approx({"uniform": 0.5, "majority": 146 / 277})
    obqa = load_task("openbookqa", limit=40)
    golds = [ex.gold for ex in obqa.examples]
    assert chance_levels(obqa) == pytest.approx({"uniform": 0.25, "majority": max(map(golds.count, set(golds))) / 40})
    assert chance_levels(load_task("lambada_openai", limit=5)) is None  # scored by greedy continuation


def test_report_ppl_vs_dense_column(tiny_opt_dir, tmp_path, text_file, capsys):
    sparse = write_test_engine(tiny_opt_dir, tmp_path / "d5.engine", density=0.5)
    out = _run_json(capsys, [str(tiny_opt_dir), str(sparse), "--ppl-file", str(text_file), "--ppl-tokens", "120",
                             "--report", str(tmp_path / "rep")])
    dense, eng = out["runs"]
    md = (tmp_path / "rep" / "README.md").read_text()
    assert "| ppl vs dense |" in md and f"{100 * (eng['perplexity'] / dense['perplexity'] - 1):+.2f}%" in md
    assert f"{dense['ppl_tokens']} tokens, window" in md


def test_decode_path_equals_parallel_path(tiny_opt_dir, tmp_path, text_file, capsys):
    # --path decode: one decode step per token from an empty cache (the runtime's decode loop), the
    # quantity --path parallel computes token-parallel: the same perplexity and task predictions
    sparse = write_test_engine(tiny_opt_dir, tmp_path / "d5.engine", density=0.5)
    argv = [str(sparse), "--ppl-file", str(text_file), "--ppl-tokens", "300", "--window", "64",
            "--task", "copa", "winogrande", "--limit", "3", "--batch-size", "3"]
    par, dec = _run_json(capsys, argv), _run_json(capsys, argv + ["--path", "decode"])
    assert (par["path"], dec["path"]) == ("parallel", "decode")
    assert dec["ppl_tokens"] == par["ppl_tokens"] == 300 - 5  # 5 windows, each with a first token unscored
    assert dec["perplexity"] == pytest.approx(par["perplexity"], rel=1e-5)
    assert dec["tasks"] == par["tasks"]


def test_generate_path_prefills_each_context(tiny_opt_dir, tmp_path):
    # --path generate: each example's context is a prompt (dense prefill), its continuation decoded
    # sparse, in batches of rows with different context lengths; against one sequence at a time
    rows = [{"query": "The cat sat on the", "choices": ["mat.", "history of the world."], "gold": 0},
            {"query": "In 2004 he had a role in", "choices": ["the play", "a film", "rain"], "gold": 2}]
    f = tmp_path / "mine.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    path = write_test_engine(tiny_opt_dir, tmp_path / "d5.engine", density=0.5)
    sm = load_scoring_model(str(path), path="generate")
    engine, tok = sm.info["engine"], sm.tokenizer
    res = evaluate_task(load_task(str(f)), sm.logits_fn, sm.encode, sm.bos_id, sm.max_len,
                        batch_size=3, progress=False, contexts_as_prompts=True)
    par = evaluate_task(load_task(str(f)), load_scoring_model(str(path)).logits_fn, sm.encode, sm.bos_id,
                        sm.max_len, batch_size=3, progress=False)
    for row, d, p in zip(rows, res.details, par.details):
        hand = []
        for c in row["choices"]:
            ctx, cont = [tok.bos_id] + tok.encode(row["query"], add_bos=False), tok.encode(" " + c, add_bos=False)
            logp = torch.log_softmax(engine.decode_logits([ctx + cont], len(ctx))[0].double(), -1)
            hand.append(sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont)))
        assert d["logprobs"] == pytest.approx(hand, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(d["logprobs"], p["logprobs"])) > 1e-3  # dense contexts differ


@pytest.mark.parametrize("argv, match", [
    (["--task", "nosuchtask"], "unknown task 'nosuchtask'"),
    (["--task", "missing.jsonl"], "task file not found"),
    (["--ppl-file", "/nonexistent/text.txt"], "text file not found"),
    (["--task", "copa", "--no-ppl", "--ppl-tokens", "5"], "--no-ppl contradicts"),
    (["--task", "copa", "nosuch"], "unknown task 'nosuch'"),  # a model came first: nothing to recover
    (["copa", "--task", "piqa"], "'copa' is a task, not a model"),
    (["--limit", "0"], "--limit must be positive"),
])
def test_bad_inputs(tiny_opt_dir, argv, match):
    with pytest.raises(DejavuError, match=match):
        main.__wrapped__([str(tiny_opt_dir)] + argv)


def test_missing_engine_and_bad_task_file(tmp_path):
    with pytest.raises(DejavuError, match="engine file not found"):
        load_scoring_model(str(tmp_path / "nope.engine"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(DejavuError, match="unknown task format"):
        load_task(str(bad))
    bad.write_text('{"query": "x", "choices": ["a"], "gold": 3}\n')
    with pytest.raises(DejavuError, match="gold index 3 out of range"):
        load_task(str(bad))


def test_cli_exit_status(tiny_opt_dir, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tiny_opt_dir), "--task", "nosuchtask"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().startswith("dejavu: error: unknown task")


def test_dtype_scores_the_engine_and_the_dense_model_in_it(tiny_opt_dir, dense_engine, text_file, capsys):
    import torch

    base = ["--ppl-file", str(text_file), "--ppl-tokens", "200", "--json"]
    e32, ebf = (_run_json(capsys, [str(dense_engine)] + base + x) for x in ([], ["--dtype", "bf16"]))
    dbf = _run_json(capsys, [str(tiny_opt_dir)] + base + ["--dtype", "bfloat16"])
    # bfloat16 rounds every weight: close to the engine's own float32, not equal; the dense model the same
    assert ebf["perplexity"] != e32["perplexity"] and ebf["perplexity"] == pytest.approx(e32["perplexity"], rel=0.05)
    assert dbf["perplexity"] == pytest.approx(ebf["perplexity"], rel=0.02)
    assert (e32["dtype"], ebf["dtype"], dbf["dtype"]) == ("float32", "bfloat16", "bfloat16")  # recorded as run
    assert load_scoring_model(str(dense_engine), dtype="bfloat16").info["engine"].spec.dtype == torch.bfloat16
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(dense_engine), "--dtype", "fp8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "'fp8' is not one of float16" in err[0]
