"""The runtime's Triton backend path (argument order, dtypes, index layouts) on CPU tensors
through Triton's interpreter, in a subprocess (TRITON_INTERPRET must be set before triton
is imported). Greedy tokens must equal the reference backend's."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch, warnings, json
torch.set_num_threads(1)
from runtime_helpers import engine_from_dense, tiny_model
from dejavu.runtime import Engine
m = tiny_model(seed=3)
P = [[2, 17, 40, 5, 88, 63, 9], [2, 33, 7]]
out = {}
for policy, kv in (("per_sequence", "deferred"), ("shared", "deferred"), ("per_sequence", "full")):
    h, t = engine_from_dense(m, 0.5, 0.5, "attn_in", 1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = Engine.from_tensors(h, t, "cpu", backend="triton", batch_policy=policy, kv_policy=kv)
    b = Engine.from_tensors(h, t, "cpu", batch_policy=policy, kv_policy=kv)
    out[policy if kv == "deferred" else "full"] = {"kernels": a.ops.kernels, "check": {k: str(v) for k, v in a.kernel_check.items()},
                   "same": a.generate(P, 4, stop_at_eos=False) == b.generate(P, 4, stop_at_eos=False),
                   "warnings": [str(x.message) for x in w]}
# batch 1 with fc1 + fc2 in one launch (SparseDecoder.fused_mlp): same greedy tokens
h, t = engine_from_dense(m, 0.5, 0.5, "attn_in", 1)
a = Engine.from_tensors(h, t, "cpu", backend="triton")
a.decoder.fused_mlp = True
b = Engine.from_tensors(h, t, "cpu")
calls = []
fused = a.ops.sparse_mlp
a.ops.sparse_mlp = lambda *args, **kw: calls.append(1) or fused(*args, **kw)
out["fused_mlp"] = {"same": a.generate(P[:1], 4, stop_at_eos=False) == b.generate(P[:1], 4, stop_at_eos=False),
                    "calls": len(calls), "check": str(a.kernel_check.get("sparse_mlp"))}
print(json.dumps(out))
"""


def test_triton_backend_in_interpreter_equals_reference():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).parent))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    out = json.loads(r.stdout.strip().splitlines()[-1])
    per = out["per_sequence"]
    assert per["kernels"] == {"predictor_topk": "triton", "sparse_fc1": "triton", "sparse_fc2": "triton",
                              "sparse_attn": "triton", "sparse_attn_deferred": "triton", "layer_norm": "triton",
                              "sparse_mlp": "triton"}, per
    assert per["same"], per
    assert out["fused_mlp"]["same"] and out["fused_mlp"]["calls"] > 0, out["fused_mlp"]
    assert out["full"]["same"], out["full"]
    assert out["shared"]["same"], out["shared"]  # kernels that fail their check fall back, still equal


FUSED_SCRIPT = r"""
import torch, json
torch.set_num_threads(1)
from runtime_helpers import engine_from_dense, tiny_model
from dejavu.runtime import Engine
import dejavu.plugins.sparse_mlp as SM
m = tiny_model(seed=3)
P = [[2, 17, 40, 5, 88, 63, 9], [2, 33, 7]]
h, t = engine_from_dense(m, 0.5, 0.5, "attn_in", 1)
out = {}
for policy in ("per_sequence", "shared"):
    logits = {}
    for name, fuse, finish in (("fused", True, True), ("separate", False, True), ("fallback", True, False)):
        SM.FUSED_FINISH = finish  # "fallback": ln= through the kernels' fallback (a layer_norm launch)
        eng = Engine.from_tensors(h, t, "cpu", backend="triton", batch_policy=policy)
        dec, got, calls = eng.decoder, [], []
        dec.fuse_ln, step, ln = fuse, dec.decode_step, eng.ops.layer_norm
        dec.decode_step = lambda tokens, pos: got.append(step(tokens, pos).clone()) or got[-1]
        eng.ops.layer_norm = lambda *a: calls.append(1) or ln(*a)
        eng.generate(P, 3, stop_at_eos=False)
        logits[name] = torch.stack(got)
        out[policy + "_kernels"] = eng.ops.kernels
        out[policy + "_ln_calls_" + name] = len(calls)
    ref = logits["separate"]
    out[policy] = {k: float((v - ref).abs().max() / ref.abs().max()) for k, v in logits.items()}
print(json.dumps(out))
"""


def test_fused_layer_norms_in_interpreter_equal_separate_ones():
    # the decode step with LayerNorms from the fused kernels (and from their fallback) against
    # the step with the separate LayerNorm kernel, Triton backend in the interpreter, fp32
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).parent))
    r = subprocess.run([sys.executable, "-c", FUSED_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for policy in ("per_sequence", "shared"):
        assert set(out[policy + "_kernels"].values()) == {"triton"}, out
        assert out[policy]["fused"] < 1e-5 and out[policy]["fallback"] < 1e-5, out
        # 2 steps x (3 layers x 2 + final) separate; fused: layer 0's ln_attn only
        assert (out[policy + "_ln_calls_separate"], out[policy + "_ln_calls_fused"]) == (14, 2), out
