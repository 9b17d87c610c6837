"""The runtime's Triton backend path (argument order, dtypes, index layouts) on CPU tensors
through Triton's interpreter, in a subprocess (TRITON_INTERPRET must be set before triton
is imported). Greedy tokens must equal the reference backend's.

Each test's script takes up to a few minutes of one core. Under pytest-xdist (`pytest -n 2`, the
README's command) tests/conftest.py puts these tests first in every worker, which runs them inline;
in one process it starts the scripts of the collected tests in the background (start_background,
one at a time, the longest first) as soon as collection ends, so they run on the machine's second
core beside the rest of the suite, and each test waits for its own result."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

pytest.importorskip("triton")

BACKGROUND: dict[str, tuple[str, int]] = {}  # test name -> (script, timeout s), filled below
_FUTURES: dict[str, Future] = {}
_PROCS: list[subprocess.Popen] = []


def _run_now(script: str, timeout: int) -> dict:
    """Run a script in a subprocess with Triton's interpreter on; the JSON of its last line."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).parent))
    p = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    _PROCS.append(p)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def start_background(names) -> None:
    """Run the scripts of these (collected) tests one after another in a thread, in BACKGROUND's order."""
    todo = [n for n in BACKGROUND if n in set(names) and n not in _FUTURES]
    for n in todo:
        _FUTURES[n] = Future()

    def work():
        for n in todo:
            fut = _FUTURES[n]
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(_run_now(*BACKGROUND[n]))
            except BaseException as e:  # the test re-raises it
                fut.set_exception(e)

    if todo:
        threading.Thread(target=work, name="interpreter-scripts", daemon=True).start()


def stop_background() -> None:
    """End of the session: drop what has not started, kill what runs."""
    for fut in _FUTURES.values():
        fut.cancel()
    for p in _PROCS:
        if p.poll() is None:
            p.kill()


def _run(name: str) -> dict:
    """Test `name`'s script result: from the background run, or run now (not started: e.g. called directly)."""
    fut = _FUTURES.get(name)
    return fut.result() if fut is not None else _run_now(*BACKGROUND[name])


SCRIPT = r"""
import torch, warnings, json
torch.set_num_threads(1)
from runtime_helpers import engine_from_dense, random_predictors, tiny_model
from dejavu.runtime import Engine
m = tiny_model(seed=3)
P = [[2, 17, 40, 5, 88, 63, 9], [2, 33, 7]]
out = {}
for policy, kv in (("per_sequence", "deferred"), ("shared", "deferred"), ("per_sequence", "full")):
    # MLP predictor ranks differ per layer (the compiler's per-layer ranks)
    h, t = engine_from_dense(m, 0.5, 0.5, "attn_in", 1, preds=random_predictors(m.config, rank=[16, 8, 4]))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = Engine.from_tensors(h, t, "cpu", backend="triton", batch_policy=policy, kv_policy=kv)
    b = Engine.from_tensors(h, t, "cpu", batch_policy=policy, kv_policy=kv)
    out[policy if kv == "deferred" else "full"] = {"kernels": a.ops.kernels, "check": {k: str(v) for k, v in a.kernel_check.items()},
                   "same": a.generate(P, 4, stop_at_eos=False) == b.generate(P, 4, stop_at_eos=False),
                   "warnings": [str(x.message) for x in w]}
print(json.dumps(out))
"""


def test_triton_backend_in_interpreter_equals_reference():
    out = _run("test_triton_backend_in_interpreter_equals_reference")
    per = out["per_sequence"]
    assert per["kernels"] == {"predictor_topk": "triton", "sparse_fc1": "triton", "sparse_fc2": "triton",
                              "sparse_attn": "triton", "sparse_attn_deferred": "triton", "layer_norm": "triton",
                              "kv_refresh": "triton", "compact_rows": "triton"}, per
    assert per["same"], per
    assert out["full"]["same"], out["full"]
    assert out["shared"]["same"], out["shared"]  # kernels that fail their check fall back, still equal


REFRESH_SCRIPT = r"""
import torch, json
torch.set_num_threads(1)
from runtime_helpers import engine_from_dense, tiny_model, record_steps
from dejavu.runtime import Engine
import dataclasses
from dejavu.plugins import DEFAULT
# batch 1's Q/K/V partials hold one missing slot (SHARED_P 2): an unselected head lagging one slot or
# more is a refresh candidate; with 2 of 4 heads attending there is one most steps
m = tiny_model(seed=3)
P = [[2, 17, 40, 5, 88, 63, 9]]
h, t = engine_from_dense(m, 0.5, 0.5, "attn_in", 1)
out = {}
logits = {}
for name, backend, r, lags_ in (("ref", "ref", 0, None), ("ref_refresh", "ref", 2, None),
                                ("refresh2", "triton", 2, None), ("refresh_hist", "triton", 2, (None, "hist")),
                                ("folded", "triton", 2, None)):
    qkv = dataclasses.replace(DEFAULT.qkv_b1, SHARED_P=2, FOLD_FINISH=True if name == "folded" else "wide",
                              FOLD_MAX_SPLIT=8)
    eng = Engine.from_tensors(h, t, "cpu", backend=backend, kernel_settings=dataclasses.replace(DEFAULT, qkv_b1=qkv))
    dec, got, picks, lags = eng.decoder, [], [], []
    dec.set_options(kv_refresh=r, kv_refresh_lags=lags_ or (None, None))
    real = eng.ops.kv_refresh
    def pick(*a, **k):
        res = real(*a, **k)
        picks.extend(x for x in res.tolist() if x >= 0)
        return res
    eng.ops.kv_refresh = pick
    deferred = eng.ops.sparse_attn_deferred
    def attn(*a, **k):  # the largest lag of a selected head when it attends (hist_slots 1 covers 1)
        idx, vl, pos = a[7], a[11], int(a[12].reshape(-1)[0])
        lags.append(max(pos - min(int(vl[0, i]), pos) for i in idx.reshape(-1).tolist()))
        return deferred(*a, **k)
    eng.ops.sparse_attn_deferred = attn
    record_steps(dec, got)
    out[name + "_tokens"] = eng.generate(P, 8, stop_at_eos=False)
    out[name + "_picks"] = len(picks)
    out[name + "_max_lag"] = max(lags)
    out[name + "_kernels"] = eng.ops.kernels
    logits[name] = torch.stack(got)
ref = logits["ref"]
out["err"] = {k: float((v - ref).abs().max() / ref.abs().max()) for k, v in logits.items()}
print(json.dumps(out))
"""


def test_decoder_refresh_heads_keep_lags_bounded():
    # Triton backend in the interpreter (and the reference backend), batch 1: with refresh heads the
    # logits equal the reference's without them; heads get picked; and with two refresh slots (as
    # many as the heads that do not attend) no selected head ever lags more than the partials hold,
    # which without refresh happens
    out = _run("test_decoder_refresh_heads_keep_lags_bounded")
    assert out["refresh2_kernels"]["kv_refresh"] == "triton", out
    assert out["refresh2_picks"] > 0 and out["ref_refresh_picks"] > 0, out
    assert out["ref_picks"] == 0 and out["ref_max_lag"] > 1, out
    assert out["refresh2_max_lag"] <= 1 and out["ref_refresh_max_lag"] <= 1, out
    assert out["refresh_hist_picks"] > 0, out
    # a route that leaves refresh heads out (the finish folded into attention) does not pick any
    assert out["folded_picks"] == 0 and out["folded_max_lag"] > 1, out
    assert max(out["err"].values()) < 1e-5, out
    assert (out["ref_tokens"] == out["ref_refresh_tokens"] == out["refresh2_tokens"] == out["refresh_hist_tokens"]
            == out["folded_tokens"]), out


DEFER_SCRIPT = r"""
import torch, json
torch.set_num_threads(1)
from runtime_helpers import engine_from_dense, tiny_model
from dejavu.runtime import Engine
from dejavu.plugins.layer_norm import PendingLN
import dataclasses
from dejavu.plugins import DEFAULT
from runtime_helpers import record_steps
# blocks of 16 rows: fc2 splits K, so its reduction runs (and stores the stats) on every route
routes = ("proj1", "fc2_dot", "fc2_gemv", "fc2_dot1")
ks = dataclasses.replace(DEFAULT, **{r: dataclasses.replace(getattr(DEFAULT, r), BLOCK_K=16) for r in routes})
m = tiny_model(seed=3, hidden_size=64, word_embed_proj_dim=64)
P = [[2, 17, 40, 5, 88, 63, 9], [2, 33, 7]]
h, t = engine_from_dense(m, 0.5, 0.5, "attn_in", 1)
out = {}
for policy, prompts in (("per_sequence", P), ("shared", P), ("batch1", P[:1])):
    logits = {}
    # the LayerNorm before attention left to the Q/K/V kernel (DecodeOptions.defer_ln_attn), or not
    for name, attn in (("attn", True), ("off", False)):
        eng = Engine.from_tensors(h, t, "cpu", backend="triton", kernel_settings=ks,
                                  batch_policy="shared" if policy == "shared" else "per_sequence")
        dec, got, pend_attn = eng.decoder, [], []
        dec.set_options(defer_ln_attn=attn)
        lns = []
        ln_op = eng.ops.layer_norm
        eng.ops.layer_norm = lambda *a, **k: lns.append(1) or ln_op(*a, **k)
        att = eng.ops.sparse_attn_deferred
        record_steps(dec, got)
        eng.ops.sparse_attn_deferred = lambda x, *a, **k: pend_attn.append(isinstance(x, PendingLN)) or att(x, *a, **k)
        toks = eng.generate(prompts, 3, stop_at_eos=False)
        logits[name] = torch.stack(got)
        out[f"{policy}_{name}"] = {"kernels": eng.ops.kernels, "pending_attn": sum(pend_attn), "attn": len(pend_attn),
                                   "ln_calls": len(lns), "check": {k: str(v) for k, v in eng.kernel_check.items()},
                                   "tokens": toks}
    ref = logits["off"]
    out[policy] = {k: float((v - ref).abs().max() / ref.abs().max()) for k, v in logits.items()}
print(json.dumps(out))
"""


def test_deferred_layer_norm_in_interpreter_equals_separate_one():
    # DecodeOptions.defer_ln_attn (the Q/K/V kernel normalising its input from fc2's reduction's block
    # stats) against the separate LayerNorm kernel: Triton backend in the interpreter, fp32
    out = _run("test_deferred_layer_norm_in_interpreter_equals_separate_one")
    for policy in ("per_sequence", "shared", "batch1"):
        off, on = out[f"{policy}_off"], out[f"{policy}_attn"]
        assert off["pending_attn"] == 0 and off["attn"] > 0, out
        # batch 1: every decode step's attention but layer 0's gets a PendingLN (prefill is dense);
        # batch 2 keeps the LayerNorm launch
        assert set(on["kernels"].values()) == {"triton"}, on
        assert out[policy]["attn"] < 1e-5 and on["tokens"] == off["tokens"], out
        want = on["attn"] * 2 // 3 if policy == "batch1" else 0
        assert on["attn"] == off["attn"] > 0 and on["pending_attn"] == want, out
        assert (on["ln_calls"] < off["ln_calls"]) == (policy == "batch1"), out


FOLD_SCRIPT = r"""
import torch, json
torch.set_num_threads(1)
from runtime_helpers import engine_from_dense, tiny_model
from dejavu.runtime import Engine
import dataclasses
import dejavu.plugins.qkv_partial as DK, dejavu.plugins.qkv_finish as QF, dejavu.plugins.sparse_attention as SA
from dejavu.plugins import DEFAULT
m = tiny_model(seed=3)
P = [[2, 17, 40, 5, 88, 63, 9]]
h, t = engine_from_dense(m, 0.5, 0.5, "attn_in", 1)
attn = dataclasses.replace(DEFAULT.attn, CHUNK=4, BLOCK_S=4)  # contexts of several chunks: the fold applies
names = []
for mod in (DK, QF, SA):  # the launches (a spy: the test's own process)
    real = mod.jit
    mod.jit = lambda fn, dev, real=real: names.append(fn.__name__) or real(fn, dev)
out = {}
for fold in (True, False):
    ks = dataclasses.replace(DEFAULT, attn=attn, qkv_b1=dataclasses.replace(DEFAULT.qkv_b1, FOLD_FINISH=fold))
    a = Engine.from_tensors(h, t, "cpu", backend="triton", kernel_settings=ks)
    a.generate(P, 1, stop_at_eos=False)  # activation: verify() checks each kernel (a batch: no fold)
    names.clear()
    toks = a.generate(P, 8, stop_at_eos=False)
    out[str(fold)] = {"tokens": toks, "finish": names.count("_qkv_finish_kernel"),
                      "attn": names.count("_attn_decode_kernel"), "check": str(a.kernel_check.get("sparse_attn_deferred"))}
out["ref"] = Engine.from_tensors(h, t, "cpu").generate(P, 8, stop_at_eos=False)
print(json.dumps(out))
"""


def test_folded_qkv_finish_in_the_runtime_equals_reference():
    """Batch 1 through the Triton backend with the Q/K/V finish folded into attention (FOLD_FINISH
    True, chunks of 4 positions so it applies; the default "wide" needs more than 8 slices of D):
    the same greedy tokens as the reference backend and as without the fold, no finishing kernel."""
    out = _run("test_folded_qkv_finish_in_the_runtime_equals_reference")
    on, off = out["True"], out["False"]
    assert on["attn"] > 0 and on["finish"] == 0 and off["finish"] > 0, out
    assert on["tokens"] == off["tokens"] == out["ref"], out


DECODE_LOGITS_SCRIPT = r"""
import torch, json
torch.set_num_threads(1)
from runtime_helpers import engine_from_dense, tiny_model
from dejavu.runtime import Engine
m = tiny_model(seed=3)
ids = torch.tensor([[2, 17, 40, 5, 88, 63, 9, 31], [2, 33, 7, 64, 12, 90, 41, 8]])
h, t = engine_from_dense(m, 0.5, 0.5, "attn_in", 1)
a = Engine.from_tensors(h, t, "cpu", backend="triton", batch_policy="per_sequence")
b = Engine.from_tensors(h, t, "cpu", batch_policy="per_sequence")
out = {"kernels": a.ops.kernels}
for name, p in (("empty", 0), ("prompts", [3, 5])):
    x, y = a.decode_logits(ids, p), b.decode_logits(ids, p)
    ok = ~y.isnan()
    out[name] = {"err": float((x - y)[ok].abs().max() / y[ok].abs().max()), "nan_same": bool((x.isnan() == ~ok).all())}
print(json.dumps(out))
"""


def test_decode_logits_in_interpreter_equal_reference():
    # Engine.decode_logits (the decode loop fed given tokens, what `dejavu-eval --path decode /
    # generate` scores) through the Triton backend in the interpreter against the reference backend:
    # from an empty cache, and with per-row dense prompts
    out = _run("test_decode_logits_in_interpreter_equal_reference")
    assert set(out["kernels"].values()) == {"triton"}, out
    for name in ("empty", "prompts"):
        assert out[name]["err"] < 1e-5 and out[name]["nan_same"], out


# the longest first (their durations on one CI core: ~140, 87, 62, 62, 54, 45, 20 s)
LAYERS_SCRIPT = r"""
import json
import dejavu.plugins.fc2 as FC2
from runtime_helpers import engine_from_dense, tiny_model
from dejavu.plugins import DEFAULT
from dejavu.runtime import Engine
h, t = engine_from_dense(tiny_model(seed=3), 0.5, 0.5, "attn_in", 1)  # 3 layers, K 32 neurons, 2 heads
layers = [{"fc2_dot1": {"SPLIT": s, "BLOCK_K": 8}} for s in (1, 2, 4)]
h = {**h, "target": {**h["target"], "kernel_settings": DEFAULT.to_dict(), "layer_kernel_settings": layers}}
grids = []  # fc2's launches of the tl.dot kernel (GROUP 1; the projection's have GROUP hd): their grids
real = FC2.jit


class Spy:
    def __init__(self, fn, dev):
        self.fn, self.k = fn, real(fn, dev)

    def __getitem__(self, g):
        def launch(*a, **kw):
            if self.fn.__name__ == "_gather_dot_t_kernel" and kw["GROUP"] == 1:
                grids.append(list(g))
            return self.k[g](*a, **kw)
        return launch


FC2.jit = Spy
a = Engine.from_tensors(h, t, "cpu", backend="triton")
P = [[2, 17, 40, 5, 88]]
a.generate(P, 1, stop_at_eos=False)  # activation: verify() runs each kernel once
grids.clear()
toks = a.generate(P, 3, stop_at_eos=False)
print(json.dumps({"grids": grids, "tokens": toks, "ref": Engine.from_tensors(h, t, "cpu").generate(P, 3, stop_at_eos=False),
                  "kernels": a.ops.kernels}))
"""


def test_each_layer_launches_with_its_recorded_settings():
    """An engine header's per-layer kernel settings (target.layer_kernel_settings) reach each layer's
    kernels: fc2 of layers 0, 1, 2 split K (32 neurons in blocks of 8) over 1, 2 and 4 programs per D
    block in every decode step, and the tokens equal the reference backend's."""
    out = _run("test_each_layer_launches_with_its_recorded_settings")
    assert out["kernels"]["sparse_fc2"] == "triton", out
    fc2 = [g[1] for g in out["grids"]]  # D 32: one D block
    assert len(fc2) >= 6 and fc2 == [1, 2, 4] * (len(fc2) // 3), out
    assert out["tokens"] == out["ref"], out


TOKEN_K_SCRIPT = r"""
import copy, torch, json, warnings
torch.set_num_threads(1)
from runtime_helpers import engine_from_dense, tiny_model, random_predictors
from dejavu.runtime import Engine
m = tiny_model(seed=3)
preds = {n: v * 6 if n.endswith("pred_mlp.b") else v for n, v in random_predictors(m.config).items()}
h, t = engine_from_dense(m, 0.25, 0.5, "attn_in", 1, preds=preds)
h["build_config"]["token_k"] = {"form": "share", "threshold": [0.02] * 3, "k_max": [32] * 3}
ids = torch.tensor([[2, 17, 40, 5, 88, 63, 9, 21, 22, 23], [2, 33, 7, 44, 45, 46, 47, 48, 49, 50]])
out = {}
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    engines = {"triton": Engine.from_tensors(h, t, "cpu", backend="triton"),
               "triton_no_overlap": Engine.from_tensors(h, t, "cpu", backend="triton", overlap=False),
               "ref": Engine.from_tensors(h, t, "cpu")}
out["warnings"] = [str(x.message) for x in w]
logits, kept = {}, {}
for name, eng in engines.items():
    run = eng.decoder.pred
    run.trace, rows = [], []
    real = eng.ops.sparse_fc1
    def fc1(*a, real=real, rows=rows):
        if len(a) > 4:
            rows.append(sorted(a[3][0][:a[4][0]].tolist()))  # batch row 0's kept neurons (the first n)
        return real(*a)
    eng.ops.sparse_fc1 = fc1
    logits[name] = eng.decode_logits(ids)
    kept[name] = rows
out["kernels"] = engines["triton"].ops.kernels
out["batch_policy"] = engines["triton"].batch_policy
out["err"] = float((logits["triton"] - logits["ref"]).abs().max() / logits["ref"].abs().max())
out["same_kept"] = kept["triton"] == kept["ref"] == kept["triton_no_overlap"]
out["n_kept"] = sorted({len(r) for r in kept["ref"]})
print(json.dumps(out))
"""


def test_per_token_k_in_interpreter_equals_reference():
    """A per-token K engine on the Triton backend (default batch policy: per_sequence): the kernels pass
    their check, each decode step keeps the same neurons as the reference backend (overlap on and off),
    whose count varies per token, and the logits agree."""
    out = _run("test_per_token_k_in_interpreter_equals_reference")
    assert out["kernels"]["sparse_fc1"] == out["kernels"]["sparse_fc2"] == out["kernels"]["predictor_topk"] == "triton", out
    assert out["batch_policy"] == "per_sequence" and not out["warnings"], out
    assert out["same_kept"] and len(out["n_kept"]) > 2, out
    assert out["err"] < 1e-5, out


COMPACT_SCRIPT = r"""
import importlib, torch, json, warnings
torch.set_num_threads(1)
CR = importlib.import_module("dejavu.plugins.compact_rows")  # the module (the package's name is the function)
from runtime_helpers import engine_from_dense, tiny_model, random_predictors
from dejavu.runtime import Engine
m = tiny_model(seed=3)
preds = {n: v * 6 if n.endswith("pred_mlp.b") else v for n, v in random_predictors(m.config).items()}
h, t = engine_from_dense(m, 0.25, 0.5, "attn_in", 1, preds=preds)
h_tk = {**h, "build_config": {**h["build_config"], "token_k": {"form": "share", "threshold": [0.02] * 3, "k_max": [32] * 3}}}
launches = []
real = CR.jit
CR.jit = lambda fn, dev: launches.append(fn.__name__) or real(fn, dev)
ids = {"fixed_b1": torch.tensor([[2, 17, 40, 5, 88, 63, 9, 21]]),
       "token_k_b2": torch.tensor([[2, 17, 40, 5, 88, 63, 9, 21], [2, 33, 7, 44, 45, 46, 47, 48]])}
out = {}
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    for name, hdr in (("fixed_b1", h), ("token_k_b2", h_tk)):
        logits = {}
        for backend in ("triton", "ref"):
            eng = Engine.from_tensors(hdr, t, "cpu", backend=backend)
            launches.clear()
            logits[backend] = eng.decode_logits(ids[name])
            out[name + "_" + backend + "_launches"] = len(launches)
            if backend == "triton":
                out[name + "_kernels"] = eng.ops.kernels
        ref = logits["ref"]
        out[name + "_err"] = float((logits["triton"] - ref).abs().max() / ref.abs().max())
out["warnings"] = [str(x.message) for x in w]
print(json.dumps(out))
"""


def test_compacted_fc2_in_interpreter_equals_reference():
    """The decode step on the Triton backend: fc2 over compact_rows' nonzero rows (a launch per sparse layer and
    step) at batch 1 with a fixed K and at batch 2 with a per-token K gives the reference backend's logits
    (compact_rows_ref against fc2 over every row: tests/plugins/test_plugin_compact_rows.py)."""
    out = _run("test_compacted_fc2_in_interpreter_equals_reference")
    assert not out["warnings"], out
    for name in ("fixed_b1", "token_k_b2"):
        assert out[name + "_kernels"]["compact_rows"] == out[name + "_kernels"]["sparse_fc2"] == "triton", out
        assert out[name + "_triton_launches"] >= 3 * 7 and out[name + "_ref_launches"] == 0, out
        assert out[name + "_err"] < 1e-5, out


BACKGROUND.update({
    "test_compacted_fc2_in_interpreter_equals_reference": (COMPACT_SCRIPT, 300),
    "test_per_token_k_in_interpreter_equals_reference": (TOKEN_K_SCRIPT, 300),
    "test_each_layer_launches_with_its_recorded_settings": (LAYERS_SCRIPT, 300),
    "test_deferred_layer_norm_in_interpreter_equals_separate_one": (DEFER_SCRIPT, 900),
    "test_decoder_refresh_heads_keep_lags_bounded": (REFRESH_SCRIPT, 300),
    "test_folded_qkv_finish_in_the_runtime_equals_reference": (FOLD_SCRIPT, 600),
    "test_triton_backend_in_interpreter_equals_reference": (SCRIPT, 300),
    "test_decode_logits_in_interpreter_equal_reference": (DECODE_LOGITS_SCRIPT, 300),
})
