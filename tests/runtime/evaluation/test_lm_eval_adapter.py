"""The lm-evaluation-harness adapter: a local YAML task over a tiny jsonl, through lm_eval,
gives the same accuracy and log-likelihoods as dejavu's own scorer."""
from __future__ import annotations

import json
import math

import pytest

lm_eval = pytest.importorskip("lm_eval")

ROWS = [{"query": "The cat sat on the", "choices": ["mat.", "history of the world."], "gold": 0},
        {"query": "In 2004 he had a role in", "choices": ["the play", "a film", "rain"], "gold": 2},
        {"query": "Robert is an English film", "choices": ["actor", "television"], "gold": 1}]


@pytest.fixture(scope="module")
def adapter(tiny_opt_dir):
    from dejavu.runtime.evaluation.lm_eval_adapter import DejavuLM

    return DejavuLM(model=str(tiny_opt_dir), batch_size=4)


class _Req:
    def __init__(self, *args):
        self.args = args


def test_methods_match_our_scorer(adapter, tiny_opt_dir, tmp_path):
    from dejavu.runtime.evaluation.tasks import evaluate_task, load_task

    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in ROWS))
    sm = adapter.sm
    ours = evaluate_task(load_task(str(f)), sm.logits_fn, sm.encode, sm.bos_id, sm.max_len, 4, progress=False)
    for row, d in zip(ROWS, ours.details):
        got = adapter.loglikelihood([_Req(row["query"], " " + c) for c in row["choices"]])
        assert [g[0] for g in got] == pytest.approx(d["logprobs"], abs=1e-5)
    text = "Robert is an English film , television and theatre actor . " * 12  # > 64 positions
    (rolling,) = adapter.loglikelihood_rolling([_Req(text)])
    ids = sm.encode(text)
    assert len(ids) > sm.max_len
    from dejavu.models.metrics import perplexity
    import torch

    ref = perplexity(sm.logits_fn, torch.tensor([sm.bos_id] + ids), sm.max_len)
    # different windowing (lm_eval: disjoint windows, each conditioned on the previous token)
    assert math.isfinite(rolling) and rolling < 0
    assert -rolling / len(ids) == pytest.approx(ref["nll"], rel=0.05)
    (gen,) = adapter.generate_until([_Req("The cat sat on the", {"until": ["\n"], "max_gen_toks": 5})])
    assert isinstance(gen, str) and "\n" not in gen


def test_generate_path_through_the_adapter(tiny_opt_dir, tmp_path):
    # path=generate: lm_eval's requests scored as dejavu-eval --path generate scores them (contexts
    # prefilled dense, continuations through the decode loop)
    from _helpers import write_test_engine

    from dejavu.runtime.evaluation.lm_eval_adapter import DejavuLM
    from dejavu.runtime.evaluation.tasks import evaluate_task, load_task

    eng = DejavuLM(model=str(write_test_engine(tiny_opt_dir, tmp_path / "d5.engine", density=0.5)),
                   batch_size=2, path="generate")
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in ROWS))
    sm = eng.sm
    ours = evaluate_task(load_task(str(f)), sm.logits_fn, sm.encode, sm.bos_id, sm.max_len, 4, progress=False,
                         contexts_as_prompts=True)
    for row, d in zip(ROWS, ours.details):
        got = eng.loglikelihood([_Req(row["query"], " " + c) for c in row["choices"]])
        assert [g[0] for g in got] == pytest.approx(d["logprobs"], abs=1e-5)


def test_local_yaml_task_through_lm_eval(adapter, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    data = tmp_path / "tiny.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    (tmp_path / "tiny.yaml").write_text(f"""task: dejavu_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
""")
    res = simple_evaluate(model=adapter, tasks=["dejavu_tiny_mc"], task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
                          bootstrap_iters=0, log_samples=False)
    acc = res["results"]["dejavu_tiny_mc"]["acc,none"]

    from dejavu.runtime.evaluation.tasks import evaluate_task, load_task

    sm = adapter.sm
    ours = evaluate_task(load_task(str(data)), sm.logits_fn, sm.encode, sm.bos_id, sm.max_len, 4, progress=False)
    assert acc == pytest.approx(ours.acc)


def test_registered():
    from lm_eval.api.registry import get_model

    import dejavu.runtime.evaluation.lm_eval_adapter as ad

    assert get_model("dejavu") is ad.DejavuLM
