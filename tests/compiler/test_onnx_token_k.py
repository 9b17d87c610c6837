"""`dejavu-compile --onnx-out` on opt-mini with the per-token MLP K: form (a) in ONNX Runtime equals
the CPU runtime's decode of the same engine on WikiText-2 test tokens (logits, and the rows each
token keeps in every layer).

The predictors are random (b scaled so the predicted shares are spread): the test is about the
export reproducing the engine's rule, not about the predictors' quality, and training them on
opt-mini would take minutes on the test machines."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from dejavu.compiler.build import build_engine
from dejavu.compiler.config import BuildConfig
from dejavu.compiler.onnx_export import run_onnxruntime
from dejavu.compiler.predictors import Predictors
from dejavu.datafiles import WIKITEXT2_TEST
from dejavu.engine_file import read_header
from dejavu.models.loader import load_config, load_tokenizer
from dejavu.models.presets import OPT_MINI_DIR
from dejavu.runtime.engine import Engine
from helpers_compiler import random_predictors

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(not (OPT_MINI_DIR / "config.json").is_file(), reason="models/opt-mini is not there")

PI = {"source": "attn_in", "lookahead": 1}
SEQ = 48


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("opt_mini_token_k")
    cfg = load_config(OPT_MINI_DIR)
    sd = {n: t * 8 if n.endswith("pred_mlp.b") else t for n, t in random_predictors(cfg, rank=16).items()}
    preds = Predictors.from_state_dict(sd, PI)
    s = build_engine("opt-mini", BuildConfig(mlp_density=0.2, attn_density=0.75, allocation="uniform",
                                             dtype="float32", heldout_tokens=512),
                     d / "m.engine", onnx_out=d / "onnx", progress=False, predictors=preds)
    ids = load_tokenizer(OPT_MINI_DIR).encode(WIKITEXT2_TEST.read_text()[:4000]).ids
    return d, s, cfg, torch.tensor([[cfg.bos_token_id, *ids[:SEQ - 1]]])


def _ort_rows(path, ids, L):
    """Form (a) from its path with each layer's idx / keep as extra outputs: (logits, {l: (idx, keep)})."""
    m = onnx.load(str(path))  # external data read: the model is re-serialised with the weights inside
    names = [f"layers.{l}.pred_mlp.{t}" for l in range(L) for t in ("idx", "keep")]
    m.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    out = run_onnxruntime(m, {"input_ids": ids.numpy()})
    return out["logits"], {l: (out[f"layers.{l}.pred_mlp.idx"], out[f"layers.{l}.pred_mlp.keep"]) for l in range(L)}


def _runtime_rows(engine, ids):
    """The runtime's decode logits, and each layer's (idx, keep) per position from its predictor op."""
    rec = []
    op = engine.decoder.pred.topk

    def topk(x, *args, min_share=None, **kw):
        out = op(x, *args, min_share=min_share, **kw)
        if min_share is not None:
            rec.append(tuple(t.clone() for t in out))
        return out

    engine.decoder.pred.topk = topk
    logits = engine.decode_logits(ids)
    return logits, rec


def _kept(F, idx, keep):
    """[..., F] bool: the rows kept, from idx / keep [..., k] (any order)."""
    m = np.zeros((*idx.shape[:-1], F), bool)
    np.put_along_axis(m, idx.astype(np.int64), keep, -1)
    return m


def test_onnx_equals_the_cpu_runtime_on_opt_mini(built):
    d, s, cfg, ids = built
    L, F = cfg.num_hidden_layers, cfg.ffn_dim
    tk = read_header(d / "m.engine")["build_config"]["token_k"]
    assert tk["form"] == "share" and s["token_k"]["k_max"] == tk["k_max"]
    assert s["onnx"]["form_a_max_abs_diff"] <= 2 * s["onnx"]["form_a_torch_same_dtype_max_abs_diff"] + 1e-4

    ort_logits, ort = _ort_rows(d / "onnx" / "prefill.sparse.onnx", ids, L)
    got, rec = _runtime_rows(Engine.load(d / "m.engine", "cpu"), ids)
    assert len(rec) == SEQ * L  # decode: one step per position, every layer's per-token K
    scale = np.abs(ort_logits).max()
    diff = np.abs(ort_logits - got.numpy()).max()
    assert diff <= 1e-5 * scale + 1e-4, (diff, scale)
    counts = []
    for l in range(L):
        idx, keep = ort[l]
        assert idx.shape == keep.shape == (1, SEQ, tk["k_max"][l])
        rt_idx = torch.stack([rec[t * L + l][0].reshape(-1) for t in range(SEQ)]).numpy()  # [S, k_max]
        rt_keep = torch.stack([rec[t * L + l][1].reshape(-1) for t in range(SEQ)]).numpy()
        assert np.array_equal(_kept(F, idx[0], np.ones_like(keep[0])), _kept(F, rt_idx, np.ones_like(rt_keep)))
        assert np.array_equal(_kept(F, idx[0], keep[0]), _kept(F, rt_idx, rt_keep)), l  # the same rows kept
        counts += keep[0].sum(-1).tolist()
    assert len(set(counts)) > 10 and min(counts) < max(counts) / 2  # a count per token, not a fixed K


def test_token_k_off_exports_the_fixed_k_graph(built, tmp_path):
    # the same engine without the per-token K: TopK of K_l and no keep flags, in both forms
    d, s, cfg, ids = built
    bc = read_header(d / "m.engine")["build_config"]
    sd = {n: t * 8 if n.endswith("pred_mlp.b") else t for n, t in random_predictors(cfg, rank=16).items()}
    off = build_engine("opt-mini", BuildConfig(mlp_density=0.2, attn_density=0.75, allocation="uniform",
                                               dtype="float32", heldout_tokens=512, token_k="off"),
                       tmp_path / "off.engine", onnx_out=tmp_path / "onnx", progress=False,
                       predictors=Predictors.from_state_dict(sd, PI))
    assert off["token_k"] is None and off["mlp_k"] == bc["mlp_k"]
    std = onnx.load(str(tmp_path / "onnx" / "decode.sparse.onnx"), load_external_data=False)
    assert not any(n.op_type in ("GreaterOrEqual", "GatherElements") for n in std.graph.node)
    inits = {t.name: t for t in std.graph.initializer}
    for l in range(cfg.num_hidden_layers):
        k = onnx.numpy_helper.to_array(inits[f"layers.{l}.pred_mlp.topk.k"])
        assert int(k[0]) == bc["mlp_k"][l]
    plugin = onnx.load(str(tmp_path / "onnx" / "decode.plugin.onnx"), load_external_data=False)
    assert all(len(n.input) == 6 for n in plugin.graph.node if n.op_type == "SparseMLP")
    ort_logits = run_onnxruntime(tmp_path / "onnx" / "prefill.sparse.onnx", {"input_ids": ids.numpy()})["logits"]
    got = Engine.load(tmp_path / "off.engine", "cpu").decode_logits(ids).numpy()
    assert np.abs(ort_logits - got).max() <= 1e-5 * np.abs(ort_logits).max() + 1e-4
