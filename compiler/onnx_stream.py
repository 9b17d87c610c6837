"""`--onnx-out` at any size: the six graphs written piece by piece, weights as external data.

The model is cut into pieces (the embeddings, decoder layer 0 .. L-1, the head), each read
from the checkpoint when reached. For each piece and mode (prefill, decode) the piece's dense
subgraph is built in memory in the engine's dtype by the builder of `build_dense_graph`
(`onnx_export.emit_*`), the passes rewrite that one layer (`PassSettings.layers`), and the
three forms' nodes are appended to the six graphs while their weights go to one data file and
are referenced from the graphs as external data (ONNX's answer to the 2 GB protobuf limit:
the graphs hold nodes and small constants only). Memory: one layer as stored plus its three
forms in the engine dtype (each tensor in a few copies while it is serialised), never the
whole model.

Files in the output folder:

    prefill.onnx, decode.onnx                 dense
    prefill.sparse.onnx, decode.sparse.onnx   form (a), standard ops
    prefill.plugin.onnx, decode.plugin.onnx   form (b), dejavu custom-domain nodes
    weights.onnx.data                         every tensor of >= 1 KiB once (by name, 4 KiB aligned)

Each graph is checked on its path (`onnx.checker.check_model`; dense and form (a) also by
strict shape inference, whose result is the file kept). On a model small enough to hold in
float64 (`ORT_CHECK_MAX_BYTES`, opt-mini and the test models), ONNX Runtime runs form (a) from its path and its logits are
compared with the masked-dense PyTorch model (`compiler/masking.py`; with the engine's per-token K
where it has one).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import zlib
from pathlib import Path

import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from dejavu.compiler.onnx_export import (GraphBuilder, emit_embeddings, emit_head, emit_layer, graph_io,
                                         new_model, run_onnxruntime)
from dejavu.compiler.passes import PASSES, PassSettings, run_passes
from dejavu.compiler.passes._graph import has_tensor, set_opset
from dejavu.compiler.passes.insert_predictors import predictor_source
from dejavu.errors import DejavuError

MODES = ("prefill", "decode")
FORMS = {"dense": "{mode}.onnx", "standard": "{mode}.sparse.onnx", "plugin": "{mode}.plugin.onnx"}
DATA_FILE = "weights.onnx.data"
INLINE_BYTES = 1024  # smaller tensors (shapes, scales) stay inside the graph
ALIGN = 4096  # data offsets on page boundaries: ONNX Runtime maps such tensors instead of copying
# float64 parameter bytes up to which form (a) is checked in ONNX Runtime: the check holds the
# whole model (in float64, the reference) and fits the build's 1 GiB slack up to here
ORT_CHECK_MAX_BYTES = 256 << 20


class ExternalData:
    """One data file; `reference(t)` appends t's bytes once per name and returns the external-data
    initializer that points at them (a name seen again must carry the same bytes)."""

    def __init__(self, path: Path):
        self.path, self.f, self.index = path, open(path, "wb"), {}

    def reference(self, t: TensorProto) -> TensorProto:
        raw = t.raw_data if t.HasField("raw_data") else numpy_helper.from_array(numpy_helper.to_array(t)).raw_data
        if len(raw) < INLINE_BYTES:
            return t
        crc = zlib.crc32(raw)
        if t.name in self.index:
            off, n, c = self.index[t.name]
            if (n, c) != (len(raw), crc):  # the builder and passes are deterministic: never expected
                raise DejavuError(f"ONNX export: tensor {t.name!r} differs between graphs")
        else:
            off = -(-self.f.tell() // ALIGN) * ALIGN
            self.f.write(b"\0" * (off - self.f.tell()))
            self.f.write(raw)
            self.index[t.name] = (off, len(raw), crc)
        ref = TensorProto(name=t.name, data_type=t.data_type, dims=t.dims, data_location=TensorProto.EXTERNAL)
        for k, v in (("location", self.path.name), ("offset", str(off)), ("length", str(len(raw)))):
            e = ref.external_data.add()
            e.key, e.value = k, v
        return ref

    def close(self) -> int:
        self.f.close()
        return self.path.stat().st_size


class _Graphs:
    """The six output models: nodes appended piece by piece, initializers as external references."""

    def __init__(self, cfg, elem_type: int, data: ExternalData):
        self.data, self.models, self.names = data, {}, {}
        for mode in MODES:
            for form in FORMS:
                graph = helper.make_graph([], f"opt_{mode}", [], [])
                graph_io(graph, cfg, mode, elem_type)
                self.models[mode, form], self.names[mode, form] = new_model(graph), set()

    def append(self, mode: str, form: str, piece: onnx.ModelProto) -> None:
        m, names = self.models[mode, form], self.names[mode, form]
        m.graph.node.extend(piece.graph.node)
        for t in piece.graph.initializer:
            ref = self.data.reference(t)
            if t.name not in names:  # embed_tokens: read by the embeddings and the tied LM head
                names.add(t.name)
                m.graph.initializer.append(ref)
        for o in piece.opset_import:
            if o.domain:
                set_opset(m, o.domain, o.version)


def _piece(dtype: str, emit, needs: tuple[str, ...] = ()) -> tuple[onnx.ModelProto, str]:
    """A model holding one piece's nodes and weights; `needs`: tensors of earlier pieces the
    passes look for (declared as inputs of the piece, never copied to the output)."""
    m = new_model(helper.make_graph([], "piece", [], []))
    g = GraphBuilder(m.graph, dtype)  # into the model's own graph: make_model copies the one it is given
    out = emit(g)
    g.flush()
    for name in needs:
        if not has_tensor(m, name):
            m.graph.input.append(helper.make_tensor_value_info(name, g.elem_type, None))
    return m, out


def _check(path: Path, form: str) -> None:
    try:
        if form != "plugin":  # strict inference knows no dejavu-domain op; the result is kept
            onnx.shape_inference.infer_shapes_path(str(path), str(path), check_type=True, strict_mode=True)
        onnx.checker.check_model(str(path))
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise DejavuError(f"ONNX graph {path.name} is invalid: {str(e).splitlines()[0]}") from None


def write_onnx(ckpt, dtype: str, mlp_k: list[int], attn_k: list[int], predictors_of, predictor_input: dict,
               topk_limit: int, out_dir: Path, token_k: dict | None = None) -> dict:
    """Write the six graphs of checkpoint `ckpt` (a `models.loader.Checkpoint`) to out_dir.

    predictors_of(l) -> layer l's fp32 predictor tensors by engine name (None: no predictors,
    every K = N). token_k: the engine's per-token MLP K record (`build_config.token_k`; None: K_l
    rows for every token). Files are written in a hidden folder and moved in when all are checked."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / ".onnx.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        files = _write_pieces(ckpt, dtype, mlp_k, attn_k, predictors_of, predictor_input, topk_limit, tmp, token_k)
    except BaseException:  # no partial graphs left behind (Ctrl-C included)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    data_bytes = (tmp / DATA_FILE).stat().st_size
    for name in [DATA_FILE, *files]:
        os.replace(tmp / name, out_dir / name)
    tmp.rmdir()
    report = {"dir": str(out_dir), "files": sorted(files), "dtype": dtype, "data_file": DATA_FILE,
              "data_bytes": data_bytes}
    report.update(check_form_a(ckpt, out_dir / "prefill.sparse.onnx", mlp_k, attn_k, predictors_of,
                               predictor_input, dtype, token_k=token_k))
    return report


def _write_pieces(ckpt, dtype, mlp_k, attn_k, predictors_of, predictor_input, topk_limit, tmp: Path,
                  token_k: dict | None) -> dict:
    """The six graphs and their data file in folder tmp, checked; {file name: path}."""
    from dejavu.models.loader import iter_decoder_layers, load_decoder_shell

    cfg = ckpt.cfg
    data = ExternalData(tmp / DATA_FILE)
    graphs = _Graphs(cfg, GraphBuilder(onnx.GraphProto(), dtype).elem_type, data)
    st = PassSettings(mlp_k=mlp_k, attn_k=attn_k, predictor_input=predictor_input, topk_limit=topk_limit,
                      token_k=token_k)
    # the weights as stored: the builder rounds them to the graph dtype (as from fp32: a float16
    # or bfloat16 checkpoint converts exactly), and a float32 copy of a layer is never made
    shell, x = load_decoder_shell(ckpt, None, "cpu"), {}
    for mode in MODES:
        piece, x[mode] = _piece(dtype, lambda g: emit_embeddings(g, shell, mode))
        for form in FORMS:
            graphs.append(mode, form, piece)
    del shell, piece
    for l, layer in iter_decoder_layers(ckpt, None, "cpu"):
        sl = dataclasses.replace(st, predictors=predictors_of(l) if predictors_of else {}, layers=[l])
        for mode in MODES:
            dense, out = _piece(dtype, lambda g: emit_layer(g, layer, l, x[mode], mode, cfg),
                                needs=(predictor_source(l, predictor_input),))
            graphs.append(mode, "dense", dense)
            std = run_passes(dense, sl, passes=PASSES[:-1])
            del dense
            graphs.append(mode, "standard", std)
            graphs.append(mode, "plugin", run_passes(std, dataclasses.replace(sl, form="plugin"), passes=PASSES[-1:]))
            del std
            x[mode] = out
        del layer
    shell = load_decoder_shell(ckpt, None, "cpu")
    for mode in MODES:
        piece, _ = _piece(dtype, lambda g: emit_head(g, shell, x[mode]))
        for form in FORMS:
            graphs.append(mode, form, piece)
    del shell, piece
    data.close()
    files = {}
    for (mode, form), m in graphs.models.items():
        path = tmp / FORMS[form].format(mode=mode)
        path.write_bytes(m.SerializeToString())
        _check(path, form)
        files[path.name] = path
    return files


def check_form_a(ckpt, path: Path, mlp_k, attn_k, predictors_of, predictor_input: dict, dtype: str,
                 seq: int = 16, token_k: dict | None = None) -> dict:
    """Form (a) from its path in ONNX Runtime vs the masked-dense PyTorch model (with the per-token
    K record `token_k` where given) on a fixed token sequence: max |logits diff| against the float64
    model, and for scale the same PyTorch model in the graph dtype against float64. Skipped (None)
    for models over ORT_CHECK_MAX_BYTES in float64 or without onnxruntime."""
    import numpy as np

    from dejavu.compiler.masking import masked_sparsity
    from dejavu.compiler.predictors import Predictors
    from dejavu.compiler.token_k import TokenK
    from dejavu.models.loader import load_model

    cfg = ckpt.cfg
    n_params = _n_params(cfg)
    skipped = {"form_a_max_abs_diff": None, "form_a_torch_same_dtype_max_abs_diff": None}
    if 8 * n_params > ORT_CHECK_MAX_BYTES:
        return {**skipped, "form_a_check": f"skipped: the model is {8 * n_params / 2**20:.0f} MiB in float64, "
                                          f"over the {ORT_CHECK_MAX_BYTES >> 20} MiB this check may hold"}
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return {**skipped, "form_a_check": "skipped: onnxruntime is not installed"}
    ids = torch.arange(seq, dtype=torch.int64)[None] * 7919 % cfg.vocab_size  # fixed, spread tokens
    ids = ids[:, :min(seq, cfg.max_position_embeddings)]
    ort_logits = run_onnxruntime(path, {"input_ids": ids.numpy()})["logits"].astype(np.float64)
    model, _ = load_model(ckpt.folder, dtype=torch.float64)
    preds = None
    if predictors_of is not None:
        sd = {}
        for l in range(cfg.num_hidden_layers):
            sd.update(predictors_of(l))
        preds = Predictors.from_state_dict(sd, predictor_input)
    tk = None if token_k is None else \
        TokenK(tuple(token_k["k_max"]), tuple(token_k["threshold"]), tuple(mlp_k), token_k["form"])

    def logits(dt):
        m = model.to(dt)
        with torch.no_grad():
            if preds is None:
                return m(ids).double().numpy()
            with masked_sparsity(m, mlp_k, attn_k, "predicted", preds.to("cpu", dt), token_k=tk):
                return m(ids).double().numpy()

    ref = logits(torch.float64)
    same = logits(GraphBuilder(onnx.GraphProto(), dtype).torch_dtype)
    d = lambda a: float(np.abs(a - ref).max())
    return {"form_a_max_abs_diff": d(ort_logits), "form_a_torch_same_dtype_max_abs_diff": d(same),
            "form_a_check": f"ONNX Runtime, {ids.shape[1]} tokens, vs the masked-dense model in float64"}


def _n_params(cfg) -> int:
    V, E, D, F = cfg.vocab_size, cfg.word_embed_proj_dim, cfg.hidden_size, cfg.ffn_dim
    layer = 4 * D * D + 2 * D * F + F + 9 * D
    return V * E + (cfg.max_position_embeddings + 2) * D + cfg.num_hidden_layers * layer + 2 * D * E
