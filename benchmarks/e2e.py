"""End-to-end decode benchmark on one GPU: dejavu engines against dense baselines.

    pip install --no-deps --no-build-isolation -q . && python benchmarks/e2e.py [--quick] [--smoke]

Models: OPT-30B and OPT-1.3B shapes, and opt-mini's shape when its config is shipped, all
in fp16 with RANDOM weights and RANDOM predictors of the real shapes (ranks: dejavu.compiler's
defaults for the shape, MLP min(10%-budget rank, 512) and heads min(H, budget);
--mlp-rank/--attn-rank override): latency does not depend on the weights' values,
and no OPT weights can be downloaded here. Engines are built in memory (`Engine.from_tensors`), one weight set per
model shared by every density (only K changes).

Systems per (model, batch), prompt 128 tokens, 128 new tokens (greedy, no EOS stop):
  hf_eager        transformers OPTForCausalLM fp16, eager (the paper's baseline)
  hf_static_compile   transformers static cache + its built-in compile (--hf-compile; slow to build)
  dense_graph     our dense decode step in a CUDA graph (FasterTransformer stand-in)
  dejavu_d{D}_{on|off}   density D, predictor overlap on / off (CUDA graph), kv_policy
                  "deferred" (K/V of the selected heads only; the headline)
  dejavu_d{D}_on_fullkv  the same with kv_policy "full" (K/V of every head each step),
                  at --full-kv-densities (default 0.3), overlap on
and for each the bandwidth floor: bytes that policy must read per step / copy bandwidth
measured in this run. Per-step latency = decode time / steps (one token per sequence).

--smoke first checks the GPU path against the CPU reference semantics on a tiny random
model (fp32 GPU vs fp32 CPU with kv_policy "full": same tokens and indices; graph vs eager;
overlap on vs off; kv_policy deferred and full; programmatic dependent launch with its default,
late, early triggers and off; batch 1 with the predictors' products in Triton; fp16 GPU close,
at batch 3 and 1). It runs by default before the timings (--no-smoke skips it); --smoke
alone runs only it. JSON to --out (default $OUT/e2e.json), rewritten after every
measurement, and a markdown table on stdout. Benchmarks assert nothing.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# "cpu" dry-runs the driver on tiny shapes (no graphs, reference ops): DEJAVU_E2E_DEVICE=cpu
DEV = os.environ.get("DEJAVU_E2E_DEVICE", "cuda")
SHAPES = {  # HF config fields of the released models (facebook/opt-*/config.json)
    "opt-30b": dict(vocab_size=50272, hidden_size=7168, num_hidden_layers=48, num_attention_heads=56,
                    ffn_dim=28672, max_position_embeddings=2048, word_embed_proj_dim=7168),
    "opt-1.3b": dict(vocab_size=50272, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                     ffn_dim=8192, max_position_embeddings=2048, word_embed_proj_dim=2048),
}
TINY = dict(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, ffn_dim=1024,
            max_position_embeddings=512, word_embed_proj_dim=256)
COMMON = dict(model_type="opt", activation_function="relu", do_layer_norm_before=True, enable_bias=True,
              pad_token_id=1, bos_token_id=2, eos_token_id=2, tie_word_embeddings=True)


class Run:
    """Results + the time budget; the JSON is rewritten after every record."""

    def __init__(self, out: Path, budget_s: float, meta: dict):
        self.out, self.t0, self.budget = out, time.perf_counter(), budget_s
        self.data = {"meta": meta, "smoke": None, "bandwidth": None, "results": [], "skipped": [], "errors": []}

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def save(self):
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.out)

    def add(self, key, value):
        self.data[key].append(value) if isinstance(self.data[key], list) else self.data.__setitem__(key, value)
        self.save()


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def free():
    gc.collect()
    if DEV == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _ablate_fused_mlp(eng):
    """fc1 + fc2 in one launch (plugins/fused_mlp.py) instead of the pair + fused LayerNorm."""
    eng.decoder.fused_mlp = True
    return None


def _ablate_mlp_overlap(eng):
    """Batch 1: fc2 starts on each K split once fc1 has stored it (sparse_mlp.fc2_overlap)."""
    eng.decoder.mlp_overlap = True
    return None


def _ablate_unfused_ln(eng):
    """The LayerNorms as separate launches (the split-K finish and LayerNorm not fused)."""
    eng.decoder.fuse_ln = False
    return None


def _ablate_fused_ln(eng):
    """Each LayerNorm after a sparse op from that op (ln=): at batch 1 the split-K reduction
    and the LayerNorm in one launch (sparse_mlp._split_reduce_ln_kernel)."""
    eng.decoder.fuse_ln = True
    return None


def _decoder_attr(name: str, value):
    """SparseDecoder.<name> = value for one row (the undo restores it)."""
    def apply(eng):
        dec = eng.decoder
        old = getattr(dec, name)
        setattr(dec, name, value)
        return lambda: setattr(dec, name, old)
    return apply


def _defer_ln(on: bool):
    """SparseDecoder.defer_ln for one row (the LayerNorm before a sparse MLP left to fc1)."""
    return _decoder_attr("defer_ln", on)


def _fold_ln(on: bool):
    """SparseDecoder.fold_ln for one row (with defer_ln: fc1 takes the LayerNorm folded into its
    rows, or normalises its input chunks in its loop)."""
    return _decoder_attr("fold_ln", on)


def _qkv_setting(key, value):
    """Set QKV_CONFIG[key] for one row (the undo restores it)."""
    import importlib

    cfg = importlib.import_module("dejavu.plugins.deferred_kv").QKV_CONFIG
    old = cfg[key]
    cfg[key] = value
    return lambda: cfg.__setitem__(key, old)


def _ablate_two_launch_qkv(eng):
    """The deferred Q/K/V finish as its own kernel again (QKV_CONFIG FUSED_FINISH off)."""
    return _qkv_setting("FUSED_FINISH", False)


def _ablate_no_fusion(eng):
    """Both fusions of this session off: separate LayerNorms and the two-launch Q/K/V."""
    _ablate_unfused_ln(eng)
    return _ablate_two_launch_qkv(eng)


def _ablate_no_fusion_at_all(eng):
    """nofuse, and fc2 / the out-projection reduced by their own kernel (sparse_mlp FUSED_FINISH off)."""
    import importlib

    SM = importlib.import_module("dejavu.plugins.sparse_mlp")
    undo_qkv = _ablate_no_fusion(eng)
    old = SM.FUSED_FINISH
    SM.FUSED_FINISH = False

    def undo():
        SM.FUSED_FINISH = old
        undo_qkv()
    return undo


def _side(window="attn_in", **prefetch_mb):
    """SparseDecoder.pred_window and .l2_prefetch ({"out": MB, "fc1": MB})."""
    def apply(eng):
        eng.decoder.pred_window = window
        eng.decoder.l2_prefetch = {k: int(v * 2**20) for k, v in prefetch_mb.items()}
    return apply


def _ablate_qkv_shared(eng):
    """Batches with a shared index set take the shared-set Q/K/V kernel (QKV_CONFIG SHARED_MIN_BATCH 2)."""
    return _qkv_setting("SHARED_MIN_BATCH", 2)


def _no_pdl(eng):
    """Plain launches (_common.PDL_CONFIG ENABLED off)."""
    import importlib

    cfg = importlib.import_module("dejavu.plugins._common").PDL_CONFIG
    old = cfg["ENABLED"]
    cfg["ENABLED"] = False
    return lambda: cfg.__setitem__("ENABLED", old)


def _pdl_mode(mode):
    """The smoke test's PDL forms: None (the defaults), "off", "late" (every trigger late,
    1 prefetched tile), "early" (every trigger early, 1 prefetched tile); returns the undo."""
    if mode is None:
        return None
    if mode == "off":
        return _no_pdl(None)
    return _pdl(1, () if mode == "late" else "all")(None)


PDL_SMALL = ("reduce", "qkv_finish", "commit", "attn", "attn_combine", "layer_norm")  # no main loop
PDL_LOOP = ("fc1", "qkv_full", "fc2", "proj", "qkv")
S5_EARLY = ("qkv_full", "fc2", "proj", "reduce", "qkv", "qkv_finish", "commit", "attn", "attn_combine", "layer_norm")


def _pdl(tiles, early=()):
    """Programmatic dependent launch for the main decode kernels (_common.PDL_CONFIG), with
    `tiles` weight tiles prefetched into L2 before each kernel's wait (0: none); the kinds of
    kernel in `early` ("all": every kind) let the next kernel in right after their wait, the
    others after their main loop or at exit."""
    def apply(eng):
        import importlib

        C = importlib.import_module("dejavu.plugins._common")
        cfg = C.PDL_CONFIG
        old = dict(cfg)
        cfg.update(ENABLED=True, PREFETCH_TILES=tiles, EARLY=C.PDL_KINDS if early == "all" else tuple(early))
        return lambda: cfg.update(old)
    return apply


def _pdl_prefetch(**tiles):
    """PDL_CONFIG["PREFETCH"] for one row: {kind: weight tiles prefetched into L2 before the wait}
    (the shipped trigger set unchanged)."""
    def apply(eng):
        import importlib

        cfg = importlib.import_module("dejavu.plugins._common").PDL_CONFIG
        old = dict(cfg.get("PREFETCH") or {})
        cfg["PREFETCH"] = {**old, **tiles}
        return lambda: cfg.__setitem__("PREFETCH", old)
    return apply


def _topk_split(eng):
    """The predictors' top-k in one launch per radix round (predictor.TOPK_CONFIG fused off):
    no grid barrier, whose spinning programs wait for SM room next to the main stream."""
    import importlib

    cfg = importlib.import_module("dejavu.plugins.predictor").TOPK_CONFIG
    old = cfg["fused"]
    cfg["fused"] = False
    return lambda: cfg.__setitem__("fused", old)


def _scoring(method, pdl="late"):
    """The predictors' two products by `method` (predictor.SCORE_METHOD: "torch" = cuBLAS,
    "triton" = gather_gemv at batch 1); pdl: their PDL trigger ("late", "early": right after
    the wait) or "plain" launches."""
    def apply(eng):
        import importlib

        PR = importlib.import_module("dejavu.plugins.predictor")
        C = importlib.import_module("dejavu.plugins._common")
        old, old_pdl = PR.SCORE_METHOD, dict(C.PDL_CONFIG)
        PR.SCORE_METHOD = method
        if pdl == "early":
            C.PDL_CONFIG["EARLY"] = tuple(old_pdl["EARLY"]) + ("pred",)
        elif pdl == "plain":
            C.PDL_CONFIG["PLAIN"] = tuple(old_pdl["PLAIN"]) + ("pred",)

        def undo():
            PR.SCORE_METHOD = old
            C.PDL_CONFIG.clear()
            C.PDL_CONFIG.update(old_pdl)
        return undo
    return apply


def _no_predictors(eng):
    """No predictor work at all: every layer gets a fixed random index set of its K (drawn
    once, sorted), so the step runs the same sparse kernels without predictor GEMVs and
    top-ks: the row's distance to the headline row is what the predictors cost."""
    sets: dict = {}

    def fixed(x, a, b, bias, k, shared=False):
        key = (b.shape[0], k, x.shape[0], shared, x.device)
        if key not in sets:
            g = torch.Generator().manual_seed(b.shape[0] * 7919 + k)
            one = torch.randperm(b.shape[0], generator=g)[:k].sort().values.to(torch.int32).to(x.device)
            sets[key] = one if shared else one.expand(x.shape[0], k).contiguous()
        return sets[key]

    pred = eng.decoder.pred
    old = pred.topk
    pred.topk = fixed
    return lambda: setattr(pred, "topk", old)


def _no_predictors_random(eng):
    """No predictor GEMVs: every predictor call takes the next of a pool of 61 random index sets
    of its K (drawn once, sorted), by a device-side call counter, so a layer's heads change from
    step to step as the predictors' do on random weights (the deferred K/V catch-up still runs;
    `nopred`'s fixed sets leave it nothing to do). Three tiny launches per call replace the
    predictor's GEMVs and top-k."""
    pools: dict = {}
    n = 61  # prime: a layer's call number modulo n differs from step to step

    def cycled(x, a, b, bias, k, shared=False):
        key = (b.shape[0], k, x.device)
        if key not in pools:
            g = torch.Generator().manual_seed(b.shape[0] * 7919 + k)
            sets = torch.stack([torch.randperm(b.shape[0], generator=g)[:k].sort().values for _ in range(n)])
            pools[key] = (sets.to(torch.int32).to(x.device), torch.zeros(1, dtype=torch.long, device=x.device))
        sets, ctr = pools[key]
        ctr.add_(1)
        one = sets.index_select(0, ctr.remainder(n))  # [1, k]
        return one[0] if shared else one.expand(x.shape[0], k).contiguous()

    pred = eng.decoder.pred
    old = pred.topk
    pred.topk = cycled
    return lambda: setattr(pred, "topk", old)


def _table(module: str, name: str, **kv):
    """Entries of the config table dejavu.plugins.<module>.<name> for one row (undo restores it)."""
    def apply(eng):
        import importlib

        cfg = getattr(importlib.import_module(f"dejavu.plugins.{module}"), name)
        old = dict(cfg)
        cfg.update(kv)
        return lambda: (cfg.clear(), cfg.update(old))
    return apply


# the folded finish's slow-path layout in session 14's first runs (before "wide": Z 1, z-slices first)
_FOLD_S14 = {"FOLD_SLOW_Z": 1, "FOLD_SLOW_LAST": False}


def _qkv_b1(**kv):
    """QKV_CONFIG_B1 entries for one row (batch 1's deferred Q/K/V kernels)."""
    return _table("deferred_kv", "QKV_CONFIG_B1", **kv)


def _fc2_route(route: str, **kv):
    """sparse_mlp.FC2_CONFIG[route] entries for one row ("dot1": fc2 at batch 1, "proj1": the
    attention output projection at batch 1)."""
    return _table_entry("sparse_mlp", "FC2_CONFIG", route, **kv)


def _fc1_gemv(**kv):
    """sparse_mlp.FC1_CONFIG["gemv"] entries for one row (fc1 at batch 1, per-sequence sets)."""
    return _table_entry("sparse_mlp", "FC1_CONFIG", "gemv", **kv)


def _pred_gemv(**kv):
    """predictor.SCORE_CONFIG["a"] and ["b"] entries for one row (the predictors' GEMVs; they
    inherit the rest from sparse_mlp.FC1_CONFIG["gemv"])."""
    return _both(_pred_a(**kv), _pred_b(**kv))


def _pred_a(**kv):
    """predictor.SCORE_CONFIG["a"] entries for one row (the predictors' x @ a.T GEMV)."""
    return _table_entry("predictor", "SCORE_CONFIG", "a", **kv)


def _pred_b(**kv):
    """predictor.SCORE_CONFIG["b"] entries for one row (the predictors' h @ b.T GEMV)."""
    return _table_entry("predictor", "SCORE_CONFIG", "b", **kv)


def _pdl_early(*kinds):
    """PDL_CONFIG["EARLY"] plus `kinds` for one row (their next kernel launches right after their wait)."""
    def apply(eng):
        import importlib

        cfg = importlib.import_module("dejavu.plugins._common").PDL_CONFIG
        old = tuple(cfg["EARLY"])
        cfg["EARLY"] = old + tuple(kinds)
        return lambda: cfg.__setitem__("EARLY", old)
    return apply


def _table_entry(module, table, key, **kv):
    """dejavu.plugins.<module>.<table>[key] entries for one row (undo restores the entry)."""
    def apply(eng):
        import importlib

        t = getattr(importlib.import_module(f"dejavu.plugins.{module}"), table)
        old = dict(t[key])
        t[key] = {**old, **kv}
        return lambda: t.__setitem__(key, old)
    return apply


def _attn_setting(**kv):
    """sparse_attention.ATTN_CONFIG entries for one row."""
    return _table("sparse_attention", "ATTN_CONFIG", **kv)


def _neurons_before_heads(eng):
    """A layer's neuron predictor before its head predictor on the side stream (the main stream still
    waits for each kind's own event: PredictorRunner.neurons_first)."""
    pred = eng.decoder.pred
    pred.neurons_first = True
    return lambda: setattr(pred, "neurons_first", False)


def _neurons_first(eng):
    """The predictor schedule before session 6: a layer's neuron predictor first, and the main
    stream waits for both of its predictors before the layer's attention."""
    pred = eng.decoder.pred
    pred.heads_first = False
    return lambda: setattr(pred, "heads_first", True)


def _side_priority(eng):
    """The predictors' side stream at the highest priority (the block scheduler then gives
    its kernels freed SM slots before the main stream's queued ones)."""
    pred = eng.decoder.pred
    if pred.side is None:
        return None
    old = pred.side
    pred.side = torch.cuda.Stream(device=eng.device, priority=-100)  # mapped to the highest
    return lambda: setattr(pred, "side", old)


def _main_priority(prio):
    """The decode graph captured on a stream of priority `prio` (SparseDecoder.graph_priority;
    None: the highest, the default since session 9; 0: the default priority, the same as the
    predictors' side stream, as before)."""
    return _decoder_attr("graph_priority", prio)


_LN_LATE = _table("layer_norm", "LN_CONFIG", EARLY_WEIGHTS=False)  # LayerNorm's weights after the wait


def _topk_fused(eng):
    """The predictors' top-k in one launch with a grid barrier per round (TOPK_CONFIG fused on)."""
    import importlib

    cfg = importlib.import_module("dejavu.plugins.predictor").TOPK_CONFIG
    old = cfg["fused"]
    cfg["fused"] = True
    return lambda: cfg.__setitem__("fused", old)


def _both(*fs):
    """Several ablations in one row (undone in reverse)."""
    def apply(eng):
        undos = [f(eng) for f in fs]

        def undo():
            for u in reversed(undos):
                if u:
                    u()
        return undo
    return apply


SWEPT: dict = {}  # --swept-from: a kernels.py --sweep / --sweep-attn JSON, for the "*swept" rows


def _swept(*parts):
    """Apply parts of the SWEPT choices for one row: "qkv" (QKV_CONFIG_B1), "attn" (ATTN_CONFIG),
    "proj" (FC2_CONFIG proj1), "mlp" (FC1_CONFIG / FC2_CONFIG gemv, dot, dot1); undo restores."""
    import copy
    import importlib

    def apply(eng):
        if not SWEPT:
            raise ValueError("the *swept ablations need --swept-from FILE (a kernels.py sweep JSON)")
        DK = importlib.import_module("dejavu.plugins.deferred_kv")
        SA = importlib.import_module("dejavu.plugins.sparse_attention")
        SM = importlib.import_module("dejavu.plugins.sparse_mlp")
        tables = (DK.QKV_CONFIG_B1, SA.ATTN_CONFIG, SM.FC1_CONFIG, SM.FC2_CONFIG)
        saved = [copy.deepcopy(t) for t in tables]
        sa, sw = SWEPT.get("sweep_attn") or {}, SWEPT.get("sweep") or {}
        if "qkv" in parts and sa.get("qkv"):
            DK.QKV_CONFIG_B1.update(sa["qkv"])
        if "attn" in parts and sa.get("attn"):
            SA.ATTN_CONFIG.update(sa["attn"])
        for kernel, table in (("fc1", SM.FC1_CONFIG), ("fc2", SM.FC2_CONFIG)):
            for route, cfg in (sw.get(kernel) or {}).items():
                if ("proj" in parts and route == "proj1") or ("mlp" in parts and route != "proj1"):
                    table[route] = {**table[route], **cfg}

        def undo():
            for t, old in zip(tables, saved):
                t.clear()
                t.update(old)
        return undo
    return apply


# --ablations at --ablate-densities and --ablate-batches: rows `dejavu_d{D}_on[_shared]_{name}`,
# each one change from the row without the suffix
ABLATIONS = {"fusedmlp": _ablate_fused_mlp, "mlpov": _ablate_mlp_overlap, "unfusedln": _ablate_unfused_ln, "fuseln": _ablate_fused_ln,
             "twolaunchqkv": _ablate_two_launch_qkv,
             # session 17: deferred K/V slots past the Q/K/V partials caught up on the predictors' side
             # stream (SparseDecoder.catch_up) instead of the finishing kernel's slow path; with 4 / 16
             # programs per row block (CATCHUP_CONFIG Z, default 8), or 512-column chunks (a quarter of
             # the serial loads)
             "catchup": _decoder_attr("catch_up", True),
             # session 18: refresh heads (SparseDecoder.kv_refresh, batch 1): up to N heads that do not attend
             # but lag hist_slots behind get their K/V in the step's Q/K/V launches (no slow path later);
             # refreshN: any lag past hist_slots (the most lagging first), refreshNh: exactly hist_slots (the
             # default is decoder.REFRESH_AUTO's rule: 4 heads from 40% of the heads attending, hidden >= 4096;
             # norefresh: kv_refresh 0, autorefresh: None)
             "refresh1": _both(_decoder_attr("kv_refresh", 1), _decoder_attr("kv_refresh_lags", (None, None))),
             "refresh2": _both(_decoder_attr("kv_refresh", 2), _decoder_attr("kv_refresh_lags", (None, None))),
             "refresh4": _both(_decoder_attr("kv_refresh", 4), _decoder_attr("kv_refresh_lags", (None, None))),
             "refresh8": _both(_decoder_attr("kv_refresh", 8), _decoder_attr("kv_refresh_lags", (None, None))),
             "norefresh": _decoder_attr("kv_refresh", 0), "norefresh2": _decoder_attr("kv_refresh", 0),
             "autorefresh": _decoder_attr("kv_refresh", None),
             # ... only heads at exactly hist_slots missing slots (none already past the partials), or at 12-15
             "refresh2h": _both(_decoder_attr("kv_refresh", 2), _decoder_attr("kv_refresh_lags", (None, "hist"))),
             "refresh4h": _both(_decoder_attr("kv_refresh", 4), _decoder_attr("kv_refresh_lags", (None, "hist"))),
             "refresh8h": _both(_decoder_attr("kv_refresh", 8), _decoder_attr("kv_refresh_lags", (None, "hist"))),
             "refresh4w12": _both(_decoder_attr("kv_refresh", 4), _decoder_attr("kv_refresh_lags", (12, "hist"))),
             "refresh4h2": _both(_decoder_attr("kv_refresh", 4), _decoder_attr("kv_refresh_lags", (None, "hist"))),
             "catchupz4": _both(_decoder_attr("catch_up", True), _table("deferred_kv", "CATCHUP_CONFIG", Z=4)),
             "catchupz16": _both(_decoder_attr("catch_up", True), _table("deferred_kv", "CATCHUP_CONFIG", Z=16)),
             "catchupd512": _both(_decoder_attr("catch_up", True),
                                  _table("deferred_kv", "CATCHUP_CONFIG", BLOCK_D=512, num_warps=8)),
             # ... or in the Q/K/V partial kernel's slow z-slices (QKV_CONFIG_B1 PARTIAL_SLOW; FOLD_SLOW_Z
             # chunk sets, default 4)
             "partslow": _qkv_b1(PARTIAL_SLOW=True), "partslowz2": _qkv_b1(PARTIAL_SLOW=True, FOLD_SLOW_Z=2),
             "partslowz8": _qkv_b1(PARTIAL_SLOW=True, FOLD_SLOW_Z=8),
             # registers per thread capped (maxnreg; ptxas spills the rest) so more programs fit per SM: the
             # Q/K/V partial kernel (255 registers, 2 programs of 4 warps per SM), fc2's and the output
             # projection's tl.dot kernel (230), or all three
             "qkvreg168": _qkv_b1(maxnreg=168), "qkvreg128": _qkv_b1(maxnreg=128),
             "fc2reg168": _fc2_route("dot1", maxnreg=168), "fc2reg128": _fc2_route("dot1", maxnreg=128),
             "projreg168": _fc2_route("proj1", maxnreg=168),
             "allreg168": _both(_qkv_b1(maxnreg=168), _fc2_route("dot1", maxnreg=168), _fc2_route("proj1", maxnreg=168)),
             "allreg128": _both(_qkv_b1(maxnreg=128), _fc2_route("dot1", maxnreg=128), _fc2_route("proj1", maxnreg=128)),
             # the slow path's columns per load (SLOW_D, default BLOCK_D 128) and slots per whole-D pass (SLOW_P, default 16)
             "slowd256": _qkv_b1(SLOW_D=256), "slowd512": _qkv_b1(SLOW_D=512),
             "slowp32": _qkv_b1(SLOW_P=32), "slowp64": _qkv_b1(SLOW_P=64), "slowp128": _qkv_b1(SLOW_P=128),
             "nofuse": _ablate_no_fusion, "nofuseall": _ablate_no_fusion_at_all,
             # side-stream timing: predictors after Q/K/V; L2 warm-up of out-proj (and fc1) rows
             "predqkv": _side("after_qkv"), "predattnin": _side("attn_in"),
             "pfout": _side(out=64), "pfout16": _side(out=16), "pfall": _side(out=64, fc1=16),
             "predqkvpfout": _side("after_qkv", out=64), "predqkvpfall": _side("after_qkv", out=64, fc1=16),
             "predqkvpfall32": _side("after_qkv", out=64, fc1=32), "qkvswept": _swept("qkv"), "projswept": _swept("proj"), "mlpswept": _swept("mlp"),
             "allswept": _swept("qkv", "attn", "proj", "mlp"), "qkvshared": _ablate_qkv_shared,
             "pdl0": _pdl(0), "pdl": _pdl(1), "pdl2": _pdl(2), "pdl4": _pdl(4),
             "pdl0early": _pdl(0, "all"), "pdl1early": _pdl(1, "all"), "tksplit": _topk_split, "tkfused": _topk_fused,
             "pdl0tk": _both(_pdl(0), _topk_split), "pdl0earlytk": _both(_pdl(0, "all"), _topk_split),
             "pdl1earlytk": _both(_pdl(1, "all"), _topk_split),
             "nopdl": _no_pdl, "same": lambda eng: None,  # the headline row again (run-to-run spread)
             "same2": lambda eng: None,  # and once more, later in the run
             "tritonscore": _scoring("triton"), "tritonscoreearly": _scoring("triton", "early"),
             "tritonscoreplain": _scoring("triton", "plain"),
             "cublasscore": _scoring("torch"), "nopred": _no_predictors, "nopredrand": _no_predictors_random,
             "nopredrand2": _no_predictors_random,  # a second row in one run (spread)
             # deferred K/V at batch 1: 31 missing slots per tl.dot (heads unselected for up to 31
             # steps catch up in the partial kernel, not the finishing kernel's serial slow path)
             "qkvp32": _qkv_b1(BLOCK_P=32, SHARED_P=32),
             # ... with the partial kernel kept at 4 programs per SM (2 stages / a 128-register cap), or one
             # wave of 3 per SM (396 programs)
             "qkvp32s2": _qkv_b1(BLOCK_P=32, SHARED_P=32, num_stages=2),
             "qkvp32r128": _qkv_b1(BLOCK_P=32, SHARED_P=32, maxnreg=128),
             "qkvp32t396": _qkv_b1(BLOCK_P=32, SHARED_P=32, TARGET_PROGRAMS=396),
             # session 19: the wide tile only for the heads more than 15 slots behind (SHARED_P_WIDE; off by
             # default since): 32 (wide), off (nowide, the default), 64 slots (with a 128-register cap), with a
             # 128-register cap; refresh heads at exactly 31 (with wide)
             # batch 1's unfolded route with SHARED_P 32 and a 128-register cap (SHARED_P_UNFOLDED, the default
             # since session 19): off (SHARED_P 16 everywhere, the default before)
             "nounfolded": _qkv_b1(SHARED_P_UNFOLDED=None), "nounfolded2": _qkv_b1(SHARED_P_UNFOLDED=None),
             # (measured on SHARED_P 16, before SHARED_P_UNFOLDED: these rows turn it off to stay that)
             "wide": _qkv_b1(SHARED_P_WIDE=32, SHARED_P_UNFOLDED=None),
             "nowide": _qkv_b1(SHARED_P_WIDE=0, SHARED_P_UNFOLDED=None),
             "nowide2": _qkv_b1(SHARED_P_WIDE=0, SHARED_P_UNFOLDED=None),
             "wide64": _qkv_b1(SHARED_P_WIDE=64, SHARED_P_UNFOLDED=None),
             "wide64r128": _qkv_b1(SHARED_P_WIDE=64, SHARED_P_UNFOLDED=None, maxnreg=128),
             "wider128": _qkv_b1(SHARED_P_WIDE=32, SHARED_P_UNFOLDED=None, maxnreg=128),
             "refresh4h31": _both(_qkv_b1(SHARED_P_WIDE=32, SHARED_P_UNFOLDED=None), _decoder_attr("kv_refresh", 4),
                                  _decoder_attr("kv_refresh_lags", (31, 31))),
             # session 20: the wide tile for every K/V program of a launch in which some selected head is past
             # 15 slots (SHARED_P_WIDE_ALL: one branch per launch), none otherwise; with the 128-register cap of
             # the unfolded route (wideall) or without (wideallnc)
             "wideall": _qkv_b1(SHARED_P_WIDE=32, SHARED_P_WIDE_ALL=True, SHARED_P_UNFOLDED=None, maxnreg=128),
             "wideall2": _qkv_b1(SHARED_P_WIDE=32, SHARED_P_WIDE_ALL=True, SHARED_P_UNFOLDED=None, maxnreg=128),
             "wideallnc": _qkv_b1(SHARED_P_WIDE=32, SHARED_P_WIDE_ALL=True, SHARED_P_UNFOLDED=None),
             # ... the partial kernel's head, pos and valid_len (and those lags) read before the PDL wait
             # (PARTIAL_EARLY_READS): on the default path, with wideall, with the per-program wide tile
             "earlyrows": _qkv_b1(PARTIAL_EARLY_READS=True), "earlyrows2": _qkv_b1(PARTIAL_EARLY_READS=True),
             "wideallearly": _qkv_b1(SHARED_P_WIDE=32, SHARED_P_WIDE_ALL=True, SHARED_P_UNFOLDED=None, maxnreg=128,
                                     PARTIAL_EARLY_READS=True),
             "wideearly": _qkv_b1(SHARED_P_WIDE=32, SHARED_P_UNFOLDED=None, maxnreg=128, PARTIAL_EARLY_READS=True),
             # the finishing kernel's blocks: 32 rows per program (204 at d0.3 instead of 408), or a register cap
             # (QKV_CONFIG FINISH_MAXNREG; its decode form has 64 registers, so 408 programs are one wave already)
             "finishr32": _qkv_b1(FINISH_R=32), "finishreg128": _qkv_b1(FINISH_MAXNREG=128),
             "finishr32b": _qkv_b1(FINISH_R=32), "finishreg128b": _qkv_b1(FINISH_MAXNREG=128),
             "finishreg96": _qkv_b1(FINISH_MAXNREG=96),
             # the Q/K/V partial kernel's first weight tiles prefetched into L2 before its PDL wait (the window of
             # fc2's split reduction, where the predictors' stream is idle): 1 / 2 / 4 tiles of 128 columns
             "pfqkv1": _pdl_prefetch(qkv=1), "pfqkv2": _pdl_prefetch(qkv=2), "pfqkv4": _pdl_prefetch(qkv=4),
             "pfqkv2b": _pdl_prefetch(qkv=2),
             # session 21: the attention kernel's stable cache slots (below min(valid_len, pos)) loaded before its
             # PDL wait, valid_len committed by the combine kernel (ATTN_CONFIG EARLY_KV); with 16- / 64-slot chunks
             "earlykv": _attn_setting(EARLY_KV=True), "earlykv2": _attn_setting(EARLY_KV=True),
             "earlykvc16": _attn_setting(EARLY_KV=True, CHUNK=16, BLOCK_S=16),
             "earlykvc64": _attn_setting(EARLY_KV=True, CHUNK=64, BLOCK_S=64),
             # ... with the predictors' top-k in one launch (their stream's chain shorter), or fc2 at batch 1 on
             # 528 / 264 programs (the predictors then spill into the MLP: fc2's one wave of 396 is broken)
             "earlykvtk": _both(_attn_setting(EARLY_KV=True), _topk_fused),
             # the Q/K/V partial kernel (4 programs per SM fill the register file) aimed at 512 / 480 programs, so
             # free SM slots let the predictors' first GEMVs start beside it (TARGET_PROGRAMS 528 fills every slot
             # at head density 0.2: 8 slices x 66 row blocks; 512 -> 7 slices, 462; 480 also d0.3 -> 4 slices, 408)
             "qkvt512": _qkv_b1(TARGET_PROGRAMS=512), "qkvt480": _qkv_b1(TARGET_PROGRAMS=480),
             "qkvt528": _qkv_b1(TARGET_PROGRAMS=528),  # the default before session 21 (512 since)
             # session 22: the tl.dot fc2 / projection kernel with its row indices loaded one K block ahead
             # (ROWS_AHEAD), so its weight tiles are multi-buffered (cp.async) instead of one at a time
             "fc2ahead": _fc2_route("dot1", ROWS_AHEAD=True),
             "fc2ahead4": _fc2_route("dot1", ROWS_AHEAD=True, num_stages=4),
             "fc2aheadt528": _fc2_route("dot1", ROWS_AHEAD=True, TARGET_PROGRAMS=528),
             "projahead": _fc2_route("proj1", ROWS_AHEAD=True, num_stages=3),
             "projahead4": _fc2_route("proj1", ROWS_AHEAD=True),
             "ahead": _both(_fc2_route("dot1", ROWS_AHEAD=True), _fc2_route("proj1", ROWS_AHEAD=True, num_stages=3)),
             "ahead4": _both(_fc2_route("dot1", ROWS_AHEAD=True, num_stages=4),
                             _fc2_route("proj1", ROWS_AHEAD=True, num_stages=3)),
             "aheadt528": _both(_fc2_route("dot1", ROWS_AHEAD=True, TARGET_PROGRAMS=528),
                                _fc2_route("proj1", ROWS_AHEAD=True, num_stages=3)),
             # the Q/K/V partial kernel's LayerNorm input loaded a D chunk ahead (x_new / with the LN weights)
             "lnahead1": _qkv_b1(LN_AHEAD=1), "lnahead2": _qkv_b1(LN_AHEAD=2), "lnahead1b": _qkv_b1(LN_AHEAD=1),
             # many waves instead of one (the one-wave weight kernels' tail): fc2 / projection / Q/K/V programs
             "fc2t1188": _fc2_route("dot1", TARGET_PROGRAMS=1188), "fc2t2376": _fc2_route("dot1", TARGET_PROGRAMS=2376),
             "projt1056": _fc2_route("proj1", TARGET_PROGRAMS=1056), "projt2112": _fc2_route("proj1", TARGET_PROGRAMS=2112),
             "qkvt1024": _qkv_b1(TARGET_PROGRAMS=1024), "qkvt2048": _qkv_b1(TARGET_PROGRAMS=2048),
             # the neuron predictor first on the side stream (its 37 MB read beside the Q/K/V kernel, the head
             # predictor's latency-bound chain beside attention), alone and with earlykv
             "nfirst": _neurons_before_heads, "nfirst2": _neurons_before_heads,
             "nfirstearlykv": _both(_neurons_before_heads, _attn_setting(EARLY_KV=True)),
             # the predictors' x @ a.T with 4 / 8 rows per program (fewer programs for the few SM slots the Q/K/V
             # kernel leaves: the head predictor's chain shorter), alone and with earlykv
             "preda4": _pred_a(BLOCK_R=4), "preda4earlykv": _both(_pred_a(BLOCK_R=4), _attn_setting(EARLY_KV=True)),
             "preda8earlykv": _both(_pred_a(BLOCK_R=8), _attn_setting(EARLY_KV=True)),
             # ... the neuron predictor's h @ b.T (29 MB beside the attention chain) with 16 rows / the whole rank /
             # 8 warps per program, with earlykv (its chain must end sooner for the shorter attention chain)
             "earlykvb16": _both(_pred_b(BLOCK_R=16), _attn_setting(EARLY_KV=True)),
             "earlykvbd512": _both(_pred_b(BLOCK_D=512), _attn_setting(EARLY_KV=True)),
             "earlykvbw8": _both(_pred_b(num_warps=8), _attn_setting(EARLY_KV=True)),
             "earlykvt512": _both(_attn_setting(EARLY_KV=True), _qkv_b1(TARGET_PROGRAMS=512)),
             "earlykvt480": _both(_attn_setting(EARLY_KV=True), _qkv_b1(TARGET_PROGRAMS=480)),
             "earlykvf528": _both(_attn_setting(EARLY_KV=True), _fc2_route("dot1", TARGET_PROGRAMS=528)),
             "earlykvf264": _both(_attn_setting(EARLY_KV=True), _fc2_route("dot1", TARGET_PROGRAMS=264)),
             # the finishing kernel sums FINISH_S slices of D per load (default 1); the partial
             # kernel's programs (default 528: 5 slices at head density 0.3, 14 at 0.1)
             "finishs4": _qkv_b1(FINISH_S=4), "finishs16": _qkv_b1(FINISH_S=16),
             "qkvt264": _qkv_b1(TARGET_PROGRAMS=264), "qkvt1056": _qkv_b1(TARGET_PROGRAMS=1056),
             # the finishing kernel's slow path (slots beyond the partials) shared out over Z programs
             "slowz1": _qkv_b1(SLOW_Z=1), "slowz2": _qkv_b1(SLOW_Z=2), "slowz4": _qkv_b1(SLOW_Z=4), "slowz8": _qkv_b1(SLOW_Z=8),
             "slowz4finishs16": _qkv_b1(SLOW_Z=4, FINISH_S=16),
             # batch 1: the attention chunks combined inside the output projection (no combine launch)
             "foldcombine": _attn_setting(FOLD_COMBINE=True),
             # block shapes of the weight-streaming kernels inside the step (batch 1)
             "qkvr32": _qkv_b1(BLOCK_R=32), "qkvs4": _qkv_b1(num_stages=4), "qkvd256": _qkv_b1(BLOCK_D=256),
             "proj1056": _fc2_route("proj1", TARGET_PROGRAMS=1056), "fc2t1056": _fc2_route("dot1", TARGET_PROGRAMS=1056),
             "fc2s4": _fc2_route("dot1", num_stages=4),
             # session 9: the main stream's graph at the highest priority (default since) or at the
             # side stream's (mainzero: before); the attention chunks combined by the last chunk
             # program of each head (no combine launch)
             "mainhigh": _main_priority(None), "mainzero": _main_priority(0),
             "lastcombine": _attn_setting(LAST_COMBINE=True),
             "lastcombinehigh": _both(_main_priority(None), _attn_setting(LAST_COMBINE=True)),
             # the held predictors launched after a layer's Q/K/V kernels (they then overlap the
             # latency-bound attention kernels), with the main stream at the highest priority
             "predqkvhigh": _both(_side("after_qkv"), _main_priority(None)), "mainhigh2": _main_priority(None),
             # LayerNorm's weight and bias loaded after the PDL wait and the statistics (before session 9)
             "lnlate": _LN_LATE,
             # ... and the attention / Q/K/V finishing kernels' index and position reads after it too
             "latereads": _both(_LN_LATE, _attn_setting(EARLY_READS=False), _qkv_b1(EARLY_READS=False)),
             # fc2 at batch 1 with few programs: SPLIT 1 (one program per D block walks all of K, no
             # reduction launch) with 64- / 128- / 32-wide D blocks
             "fc2lowa": _fc2_route("dot1", BLOCK_K=128, BLOCK_D=64, num_stages=4, TARGET_PROGRAMS=112),
             "fc2lowb": _fc2_route("dot1", BLOCK_K=64, BLOCK_D=128, num_stages=4, TARGET_PROGRAMS=56),
             "fc2lowc": _fc2_route("dot1", BLOCK_K=128, BLOCK_D=32, num_stages=4, TARGET_PROGRAMS=224),
             # the held predictors launched after a layer's attention op (they overlap its MLP)
             "predattn": _side("after_attn"), "predattnhigh": _both(_side("after_attn"), _main_priority(None)),
             # attention chunk length (positions per program; fewer chunks to combine)
             "chunk64": _attn_setting(CHUNK=64), "chunk64s64": _attn_setting(CHUNK=64, BLOCK_S=64),
             "chunk128": _attn_setting(CHUNK=128), "chunk16": _attn_setting(CHUNK=16, BLOCK_S=16),
             "foldslowz4": _both(_attn_setting(FOLD_COMBINE=True), _qkv_b1(SLOW_Z=4)),
             # session 10: the MLP's LayerNorm as its own launch again (before: fc1 applies it from the
             # output projection reduction's block stats, SparseDecoder.defer_ln)
             "nodeferln": _defer_ln(False), "nodeferln2": _defer_ln(False), "deferloop": _fold_ln(False),
             # fc1's GEMV with 4 / 8 rows per program (x, or with defer_ln y and the LayerNorm's
             # weight and bias, read once for more rows), with and without the deferred LayerNorm
             "fc1r4": _fc1_gemv(BLOCK_R=4), "fc1r8": _fc1_gemv(BLOCK_R=8),
             "nodeferlnr4": _both(_defer_ln(False), _fc1_gemv(BLOCK_R=4)),
             # fc1's weight loads L2-only (.cg) or evict-first in L1, so the input vector every
             # program re-reads stays in L1; with and without the deferred LayerNorm
             "fc1cg": _fc1_gemv(W_CM=".cg"), "fc1ef": _fc1_gemv(W_EV="evict_first"),
             "nodeferlncg": _both(_defer_ln(False), _fc1_gemv(W_CM=".cg")),
             "nodeferlnef": _both(_defer_ln(False), _fc1_gemv(W_EV="evict_first")),
             # session 10 final: fc1 (and the predictors' GEMVs, which share its config) without the
             # evict-first hint (before); the deferred LayerNorm on (fold); the same hint on fc2 /
             # the output projection (tl.dot kernel at batch 1) / the Q/K/V partial kernel
             "fc1noef": _fc1_gemv(W_EV=""), "deferln": _defer_ln(True),
             # session 11: the LayerNorm before a deferred-K/V attention left to its Q/K/V kernel
             # (SparseDecoder.defer_ln_attn; fc2's reduction stores block stats; the default since
             # session 11: `nolnqkv` is the row without it), alone and with the MLP's LayerNorm
             # left to fc1 too
             "lnqkv": _decoder_attr("defer_ln_attn", True), "lnqkv2": _decoder_attr("defer_ln_attn", True),
             # session 12: attention and the output projection in one launch at batch 1 (short
             # contexts; sparse_attention.attend_project), and its block / program / prefetch variants
             "attnproj": _attn_setting(PROJ_MAX_S=4096), "attnproj2": _attn_setting(PROJ_MAX_S=4096),
             "noattnproj": _attn_setting(PROJ_MAX_S=0),
             "attnprojd128": _attn_setting(PROJ_MAX_S=4096, PROJ_BLOCK_D=128, PROJ_WARPS=8),
             "attnprojw8": _attn_setting(PROJ_MAX_S=4096, PROJ_WARPS=8),
             "attnprojnopf": _attn_setting(PROJ_MAX_S=4096, PROJ_PF=False),
             "attnprojt132": _attn_setting(PROJ_MAX_S=4096, PROJ_TARGET=132),
             "attnprojt528": _attn_setting(PROJ_MAX_S=4096, PROJ_TARGET=528),
             "attnprojs64": _attn_setting(PROJ_MAX_S=4096, PROJ_BLOCK_S=64),
             "attnprojs16": _attn_setting(PROJ_MAX_S=4096, PROJ_BLOCK_S=16),
             # one wave of programs: the Q/K/V partial kernel (3 per SM at 3 stages: 510 programs are
             # 1.3 waves) at 396 programs or 2 stages; the output projection at 396 programs or 3 stages
             "qkvt396": _qkv_b1(TARGET_PROGRAMS=396), "qkvs2": _qkv_b1(num_stages=2),
             "projt396": _fc2_route("proj1", TARGET_PROGRAMS=396), "projs3": _fc2_route("proj1", num_stages=3),
             # the MLP's LayerNorm computed by the output projection's split-K reduction (one launch:
             # its last program normalises; SparseDecoder.ln_from_attn)
             "lnfromattn": _decoder_attr("ln_from_attn", True),
             # weight tiles prefetched into L2 before the PDL wait, per kind of kernel (the output
             # projection waits behind the attention and its combine, both early triggers; fc1
             # behind the reduction and the LayerNorm)
             "pfproj1": _pdl_prefetch(proj=1), "pfproj2": _pdl_prefetch(proj=2), "pfproj4": _pdl_prefetch(proj=4),
             "pffc1": _pdl_prefetch(fc1=1), "pfproj2fc1": _pdl_prefetch(proj=2, fc1=1),
             # the weight kernels' blocks inside the step (batch 1): warps, row / column blocks, programs
             "qkvw8": _qkv_b1(num_warps=8), "qkvr128": _qkv_b1(BLOCK_R=128), "qkvd64": _qkv_b1(BLOCK_D=64),
             "qkvt792": _qkv_b1(TARGET_PROGRAMS=792),
             "fc2w8": _fc2_route("dot1", num_warps=8), "fc2d64": _fc2_route("dot1", BLOCK_D=64),
             "fc2k128": _fc2_route("dot1", BLOCK_K=128), "fc2t396": _fc2_route("dot1", TARGET_PROGRAMS=396),
             "fc2t528": _fc2_route("dot1", TARGET_PROGRAMS=528),  # before session 12's switch to 396
             "fc2t264": _fc2_route("dot1", TARGET_PROGRAMS=264), "fc2t132": _fc2_route("dot1", TARGET_PROGRAMS=132),
             # longer pieces of each gathered row (session 15: 0.5-1% faster in isolation at OPT-30B d0.2-0.3)
             "fc2d256": _fc2_route("dot1", BLOCK_K=32, BLOCK_D=256, num_stages=4),
             "fc2d1024": _fc2_route("dot1", BLOCK_K=16, BLOCK_D=1024, num_warps=8, num_stages=3, TARGET_PROGRAMS=264),
             "projd256": _fc2_route("proj1", BLOCK_K=32, BLOCK_D=256),
             "projw8": _fc2_route("proj1", num_warps=8), "projd64": _fc2_route("proj1", BLOCK_D=64),
             "projk32": _fc2_route("proj1", BLOCK_K=32),
             "fc1w8": _fc1_gemv(num_warps=8), "fc1s3": _fc1_gemv(num_stages=3),
             # fc2 started per K split while fc1 runs (session 16), with fc1's default blocks / 4 rows
             # per program (fewer programs: fc2 may launch sooner) / fc2 on 528 programs
             "mlpovr4": _both(_ablate_mlp_overlap, _fc1_gemv(BLOCK_R=4)),
             "mlpovt528": _both(_ablate_mlp_overlap, _fc2_route("dot1", TARGET_PROGRAMS=528)),
             # ... with the waiting fc2 tiles sleeping between polls of their counter
             "mlpovs512": _both(_ablate_mlp_overlap, _fc2_route("dot1", SPIN_NS=512)),
             "mlpovs2048": _both(_ablate_mlp_overlap, _fc2_route("dot1", SPIN_NS=2048)),
             # the side stream's predictor GEMVs with fewer, longer programs (scores = h @ b.T: 8 rows
             # of r per program by default; h = x @ a.T: 1 row of D in 1024-wide chunks)
             "predb16": _pred_b(BLOCK_R=16),
             "predb32": _pred_b(BLOCK_R=32),
             "predbw8": _pred_b(num_warps=8),
             "preda2048": _pred_a(BLOCK_D=2048),
             # session 13: fc2's first weight tiles into L2 before its PDL wait (behind fc1's late trigger);
             # fc1 with an early trigger (fc2's programs launch beside fc1's), alone and with fc2's prefetch.
             # (Also measured that session, code since removed: the predictors' GEMVs on a persistent grid
             # and weight rows loaded into registers before the PDL wait; BENCHMARKS.md, session 13.)
             "pffc2a": _pdl_prefetch(fc2=1), "pffc2b": _pdl_prefetch(fc2=2),
             "fc1early": _pdl_early("fc1"), "fc1earlypffc2": _both(_pdl_early("fc1"), _pdl_prefetch(fc2=2)),
             # the side stream's scores = h @ b.T with shorter programs (default 8 rows of 256: two chunks
             # of r = 512): 4 rows, or the whole rank in one chunk (2 / 4 / 8 rows)
             "predbr4": _pred_b(BLOCK_R=4),
             "predbr2d512": _pred_b(BLOCK_R=2, BLOCK_D=512),
             "predbr4d512": _pred_b(BLOCK_R=4, BLOCK_D=512),
             "predbr8d512": _pred_b(BLOCK_R=8, BLOCK_D=512),
             # the head predictors at the layer's input, the neuron predictors held until after the
             # Q/K/V kernels / the attention op (SparseDecoder.pred_window "split_qkv" / "split_attn")
             "predsplitqkv": _side("split_qkv"), "predsplitattn": _side("split_attn"),
             # session 14: no Q/K/V finishing kernel at batch 1: attention sums the partials (Q, and K/V
             # at pos and the 15 missing slots the partials hold) and the partial kernel's first
             # z-slices fill longer gaps (FOLD_FINISH); with 2 slow-path chunk sets / 32-row sub-blocks.
             # Every setting the rows were measured with is spelled out (the defaults moved since).
             "foldfinish": _qkv_b1(FOLD_FINISH=True, **_FOLD_S14),
             "foldfinish2": _qkv_b1(FOLD_FINISH=True, **_FOLD_S14),
             "foldfinishz2": _qkv_b1(FOLD_FINISH=True, **{**_FOLD_S14, "FOLD_SLOW_Z": 2}),
             "foldfinishr32": _qkv_b1(FOLD_FINISH=True, **{**_FOLD_S14, "FOLD_SLOW_R": 32}),
             # ... up to 16 slices of D unrolled (d0.1 has 14), or the partial kernel on 264 programs
             "foldfinishm16": _qkv_b1(FOLD_FINISH=True, FOLD_MAX_SPLIT=16, **_FOLD_S14),
             "foldfinisht264": _qkv_b1(FOLD_FINISH=True, TARGET_PROGRAMS=264, **_FOLD_S14),
             "foldfinishz4m16": _qkv_b1(FOLD_FINISH=True, FOLD_MAX_SPLIT=16, **{**_FOLD_S14, "FOLD_SLOW_Z": 4}),
             # ... the slow-path z-slices after the D slices; at most 8 D slices instead of the finishing kernel
             "foldlast": _qkv_b1(FOLD_FINISH=True, **{**_FOLD_S14, "FOLD_SLOW_LAST": True}),
             "foldcap": _qkv_b1(FOLD_FINISH=True, FOLD_CAP=True, **_FOLD_S14),
             "foldcaplast": _qkv_b1(FOLD_FINISH=True, FOLD_CAP=True, **{**_FOLD_S14, "FOLD_SLOW_LAST": True}),
             "foldcaplastz2": _qkv_b1(FOLD_FINISH=True, FOLD_CAP=True, FOLD_SLOW_LAST=True, FOLD_SLOW_Z=2),
             # the default since is FOLD_FINISH "wide" (capped, slow z-slices last; Z 2 in the final run,
             # Z 4 since run 6): always folded (never: nofoldfinish), slow z-slices first, Z 1 / 2 / 4 / 8
             "foldalways": _qkv_b1(FOLD_FINISH=True, FOLD_SLOW_Z=2),
             "foldfirst": _qkv_b1(FOLD_SLOW_LAST=False, FOLD_SLOW_Z=2), "foldz1": _qkv_b1(FOLD_SLOW_Z=1),
             "foldz2": _qkv_b1(FOLD_SLOW_Z=2), "foldz4": _qkv_b1(FOLD_SLOW_Z=4), "foldz8": _qkv_b1(FOLD_SLOW_Z=8),
             "nofoldfinish": _qkv_b1(FOLD_FINISH=False),
             "nolnqkv": _decoder_attr("defer_ln_attn", False),
             "lnqkvdeferln": _both(_decoder_attr("defer_ln_attn", True), _defer_ln(True)),
             # ... the MLP's LayerNorm left to fc1 through the centred product z (fold_ln "z": fc1
             # reads z instead of x and the LayerNorm weight), alone and with lnqkv
             "deferlnz": _both(_defer_ln(True), _fold_ln("z")),
             "lnqkvz": _both(_decoder_attr("defer_ln_attn", True), _defer_ln(True), _fold_ln("z")),
             "fc2ef": _fc2_route("dot1", W_EV="evict_first"), "projef": _fc2_route("proj1", W_EV="evict_first"),
             "qkvef": _qkv_b1(W_EV="evict_first"),
             # the predictors' GEMVs without the evict-first hint (fc1 keeps it)
             "prednoef": _pred_gemv(W_EV=""),
             # with the input vector in L1: fc1 with 1 row per program / 2048-wide chunks; the
             # predictors' x @ a.T with 2 rows per program
             "fc1r1": _fc1_gemv(BLOCK_R=1), "fc1d2048": _fc1_gemv(BLOCK_D=2048),
             "preda2": _pred_a(BLOCK_R=2),
             "neuronsfirst": _neurons_first, "neuronsfirstsmall": _both(_neurons_first, _pdl(0, PDL_SMALL)),
             "pdl0small2": _pdl(0, PDL_SMALL),  # pdl0small again, a second row in one run
             # session 5's defaults: its early-trigger set, neuron predictor first, cuBLAS scoring
             "s5early": _pdl(0, S5_EARLY),
             "s5defaults": _both(_neurons_first, _scoring("torch"), _pdl(0, S5_EARLY)),
             "sidehigh": _side_priority, "sidehightsp": _both(_side_priority, _scoring("triton", "plain")),
             "sidehighsmall": _both(_side_priority, _pdl(0, PDL_SMALL)),
             "tspsmall": _both(_scoring("triton", "plain"), _pdl(0, PDL_SMALL)),
             "sidehightspsmall": _both(_side_priority, _scoring("triton", "plain"), _pdl(0, PDL_SMALL)),
             "pdlxqkv": _pdl(0, tuple(k for k in PDL_SMALL + PDL_LOOP if k not in ("fc1", "qkv"))),
             "pdl0small": _pdl(0, PDL_SMALL), "pdl0loop": _pdl(0, PDL_LOOP), "pdl1small": _pdl(1, PDL_SMALL),
             **{f"pdl0e{k.replace('_', '')}": _pdl(0, (k,)) for k in PDL_SMALL + PDL_LOOP}}


def apply_tuned(path: str | None) -> dict:
    """Use the kernel configs a `kernels.py --sweep-attn` run picked (its JSON's "sweep_attn"
    section) for this process: benchmarks only; the shipped defaults live in the plugins."""
    if not path:
        return {}
    import importlib

    res = {}
    for one in path.split(","):  # several kernels.py JSONs: later ones win
        if Path(one).is_file():
            res.update(json.loads(Path(one).read_text()))
        else:
            print(f"--tuned: {one} not found, skipped", flush=True)
    found = res.get("sweep_attn") or {}
    used = {}
    for key, mod, name in (("qkv", "dejavu.plugins.deferred_kv", "QKV_CONFIG_B1"),  # swept at batch 1
                           ("attn", "dejavu.plugins.sparse_attention", "ATTN_CONFIG")):
        if found.get(key):
            table = getattr(importlib.import_module(mod), name)
            table.update(found[key])
            used[key] = dict(found[key])
    SM = importlib.import_module("dejavu.plugins.sparse_mlp")
    for kernel, table in (("fc1", SM.FC1_CONFIG), ("fc2", SM.FC2_CONFIG)):  # kernels.py --sweep
        for route, cfg in ((res.get("sweep") or {}).get(kernel) or {}).items():
            table[route] = dict(cfg)
            used[f"{kernel}/{route}"] = dict(cfg)
    pg = (res.get("pred_gemv") or {}).get("best")  # kernels.py --sections pred_gemv
    if pg:
        PR = importlib.import_module("dejavu.plugins.predictor")
        for part, cfg in pg.items():
            PR.SCORE_CONFIG[part] = {**PR.SCORE_CONFIG[part], **cfg}
        used["pred_gemv"] = {k: dict(v) for k, v in PR.SCORE_CONFIG.items()}
    best = (res.get("fused_mlp_summary") or {}).get("best")  # kernels.py --sections fused_mlp
    if best and best.get("cfg"):
        FM = importlib.import_module("dejavu.plugins.fused_mlp")
        FM.FUSED_MLP_CONFIG.update(best["cfg"])
        used["fused_mlp"] = dict(FM.FUSED_MLP_CONFIG)
    print(f"kernel configs from {path}: {used}", flush=True)
    return used


# ------------------------------------------------------------------ engines in memory
def default_ranks(c: dict, mlp: int | None = None, attn: int | None = None) -> tuple[tuple[int, int], str]:
    """(mlp_rank, attn_rank), source: the compiler's defaults for this shape (the benchmark
    may import the compiler; the runtime never does), unless given on the command line."""
    from dejavu.compiler.predictors import PredictorSettings, default_ranks as compiler_ranks
    from dejavu.models.opt import OPTConfig

    comp = tuple(int(r) for r in compiler_ranks(OPTConfig.from_hf_dict({**COMMON, **c}), PredictorSettings()))
    if mlp or attn:
        return (mlp or comp[0], attn or comp[1]), "command line"
    return comp, "dejavu.compiler default"


def random_tensors(c: dict, dtype, device, ranks, seed: int = 0) -> dict:
    """Kernel-layout engine tensors with random values (created on the device directly)."""
    torch.manual_seed(seed)
    D, F, H, L, V, E = (c[k] for k in ("hidden_size", "ffn_dim", "num_attention_heads", "num_hidden_layers",
                                       "vocab_size", "word_embed_proj_dim"))
    P = c["max_position_embeddings"] + 2

    def w(*shape, std=0.02):
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std)

    def ln():
        return 1.0 + w(D, std=0.05), w(D, std=0.02)

    t = {"embed_tokens": w(V, E), "embed_positions": w(P, D)}
    t["final_ln.weight"], t["final_ln.bias"] = ln()
    for l in range(L):
        p = f"layers.{l}."
        t[p + "ln_attn.weight"], t[p + "ln_attn.bias"] = ln()
        t[p + "ln_mlp.weight"], t[p + "ln_mlp.bias"] = ln()
        t.update({p + "attn.wq": w(D, D, std=0.02 * (D // H) ** -0.5), p + "attn.bq": w(D), p + "attn.wkv": w(2 * D, D),
                  p + "attn.bkv": w(2 * D), p + "attn.wo_t": w(D, D), p + "attn.bo": w(D),
                  p + "mlp.w1": w(F, D), p + "mlp.b1": w(F), p + "mlp.w2_t": w(F, D), p + "mlp.b2": w(D)})
        for kind, n, r in (("pred_mlp", F, ranks[0]), ("pred_attn", H, ranks[1])):
            t.update({p + kind + ".a": w(r, D, std=D ** -0.5), p + kind + ".b": w(n, r, std=r ** -0.5),
                      p + kind + ".bias": w(n, std=0.1)})
    return t


@dataclass(frozen=True)
class KFrom:
    """Per-layer K of a built engine (--k-from), as fractions of N, for another shape.

    Layer l of a target with L layers takes source layer floor(l * L_src / L) (proportional
    mapping), and K = round(fraction * N) in [1, N], so speed and quality describe the same
    allocation. Its str() names the systems (dejavu_d{KFrom}_on)."""

    name: str
    density: float  # the source engine's byte density (its header)
    mlp: tuple  # [L_src] K / F of the source
    attn: tuple  # [L_src] K / H of the source

    @classmethod
    def from_engine(cls, path: str) -> "KFrom":
        from dejavu.engine_file import read_header

        h = read_header(path)
        bc, mc = h["build_config"], h["model_config"]
        return cls(Path(path).stem, float(bc["density"]),
                   tuple(k / mc["ffn_dim"] for k in bc["mlp_k"]),
                   tuple(k / mc["num_attention_heads"] for k in bc["attn_k"]))

    def ks(self, L: int, F: int, H: int) -> tuple[list[int], list[int]]:
        src = [l * len(self.mlp) // L for l in range(L)]
        k = lambda f, n: min(n, max(1, round(f * n)))  # noqa: E731
        return [k(self.mlp[j], F) for j in src], [k(self.attn[j], H) for j in src]

    def __str__(self) -> str:
        return f"kfrom-{self.name}"

    def __float__(self) -> float:
        return self.density


def header_for(c: dict, density, dtype_name: str, ranks) -> dict:
    """Engine header; density None = dense (K = N, no predictors used); a float = that fraction of
    neurons and heads in every layer; a KFrom = a built engine's per-layer K scaled to this shape."""
    L, F, H = c["num_hidden_layers"], c["ffn_dim"], c["num_attention_heads"]
    d = 1.0 if density is None else float(density)
    if isinstance(density, KFrom):
        mlp_k, attn_k = density.ks(L, F, H)
    else:
        mlp_k, attn_k = [max(1, round(d * F))] * L, [max(1, round(d * H))] * L
    return {"format": "dejavu-engine", "format_version": 1, "model_config": {**COMMON, **c}, "dtype": dtype_name,
            "build_config": {"density": d, "mlp_density": round(sum(mlp_k) / (F * L), 4),
                             "attn_density": round(sum(attn_k) / (H * L), 4),
                             "mlp_k": mlp_k, "attn_k": attn_k,
                             "predictors": density is not None, "predictor_rank_mlp": ranks[0],
                             "predictor_rank_attn": ranks[1],
                             "predictor_input": {"source": "attn_in", "lookahead": 1},
                             "note": "random weights and random predictors of the real shapes"},
            "target": {"device": "cuda", "arch": None, "kernel_settings": {}}}


# ------------------------------------------------------------------ bytes and bandwidth
def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> dict:
    """Device-to-device copy: (bytes read + bytes written) / median time."""
    if DEV != "cuda":
        nbytes, reps = 64 << 20, 3
    x = torch.empty(nbytes // 2, dtype=torch.float16, device=DEV).normal_()
    y = torch.empty_like(x)
    times = []
    for _ in range(reps + 3):
        if DEV == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            y.copy_(x)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            y.copy_(x)
            times.append(time.perf_counter() - t0)
    t = statistics.median(times[3:])
    del x, y
    return {"copy_GBps": 2 * nbytes / t / 1e9, "bytes": nbytes, "median_s": t}


def floor_bytes(c: dict, B: int, ctx: float, esize: int, union_mlp=None, union_attn=None, k_attn=None,
                ranks=None, kv_policy: str = "full") -> float:
    """Bytes one decode step must read: weights (selected rows: the union over the batch;
    None = all rows, dense), predictors, the K/V read by the attending heads (ctx positions),
    the K/V written, the LM head. kv_policy "full": wkv read whole (K/V of every head);
    "deferred": only the selected heads' wkv rows, plus the input written to and read back
    from the history (one position per step in steady state)."""
    D, F, H, L, V, E = (c[k] for k in ("hidden_size", "ffn_dim", "num_attention_heads", "num_hidden_layers",
                                       "vocab_size", "word_embed_proj_dim"))
    hd = D // H
    total = V * E + B * (E + D)  # LM head (tied embedding) + embedding rows
    for l in range(L):
        um = F if union_mlp is None else union_mlp[l]
        ua = H if union_attn is None else union_attn[l]
        heads = H if k_attn is None else k_attn[l]
        deferred = kv_policy == "deferred" and union_attn is not None and ua < H
        total += 4 * D  # LayerNorms
        if deferred:  # wkv rows and bkv of the selected heads; x_ln written + read back
            total += 2 * ua * hd * D + 2 * ua * hd + 2 * B * D
        else:
            total += 2 * D * D + 2 * D  # wkv, bkv (K/V of every head)
        total += 2 * ua * hd * D + ua * hd + D  # wq rows, wo_t rows, bq, bo
        total += 2 * um * D + um + D  # w1 rows, w2_t rows, b1, b2
        if union_mlp is not None and ranks:
            total += ranks[0] * (D + F) + F + ranks[1] * (D + H) + H  # predictors
        kv_heads = heads if deferred else H
        total += B * 2 * ctx * hd * heads + B * 2 * hd * kv_heads  # K/V read by attending heads, K/V written
    return total * esize


# ------------------------------------------------------------------ smoke (GPU vs CPU semantics)
def _forced_logits(eng, prompts, toks) -> torch.Tensor:
    """Prefill + decode steps fed the given tokens toks [B, n]: logits [n, B, V] (float32, CPU)."""
    from dejavu.runtime.generate import right_pad

    dec, dev = eng.decoder, eng.device
    ids, lens = right_pad(prompts, 1, eng.spec.vocab_size)
    with torch.inference_mode():
        step = eng.activate(len(prompts), int(lens.max()) + toks.shape[1])
        pos = lens.to(dev)
        out = [dec.prefill(ids.to(dev), pos).float().cpu()]
        for i in range(toks.shape[1] - 1):
            out.append(step(toks[:, i].to(dev), pos).float().cpu())  # clone: graph output is static
            pos = pos + 1
    return torch.stack(out)


def _traced(eng, prompts, n):
    eng.decoder.pred.trace = []
    eng.generate(prompts, n, stop_at_eos=False)
    tr = [(l, k, i.long().sort(-1).values.cpu()) for l, k, i in eng.decoder.pred.trace]
    eng.decoder.pred.trace = None
    return tr


def _same_sets(a, b) -> float:
    if len(a) != len(b) or not a:
        return 0.0
    return sum(x[:2] == y[:2] and torch.equal(x[2], y[2]) for x, y in zip(a, b)) / len(a)


def _cache_err(eng, ref) -> float | None:
    """Relative error of eng's cache slots that its deferred layers mark valid, against ref's
    (kv_policy full) caches; both after the same _forced_logits run. None: nothing deferred."""
    dec, num, den = eng.decoder, 0.0, 0.0
    for l, vl in enumerate(dec.valid_len):
        if vl is None:
            continue
        T = dec.k_cache[l].shape[2]
        mask = (torch.arange(T, device=vl.device)[None, None, :] < vl[:, :, None]).cpu()  # [B, H, T]
        for mine, theirs in ((dec.k_cache[l], ref.decoder.k_cache[l]), (dec.v_cache[l], ref.decoder.v_cache[l])):
            a, b = mine.float().cpu()[mask], theirs.float().cpu()[:, :, :T][mask]
            num += float((a - b).norm() ** 2)
            den += float(b.norm() ** 2)
    return None if den == 0 else (num / den) ** 0.5


def smoke() -> dict:
    """Tiny random model: GPU fp32 (graph/eager, overlap on/off, kv_policy deferred/full)
    against the CPU reference with kv_policy full (the contract's description)."""
    from dejavu.runtime import Engine

    c, ranks, n = TINY, (64, 8), 24
    out = {"model": c, "new_tokens": n}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, c["vocab_size"], (k,), generator=g).tolist() for k in (17, 9, 30)]
    t32 = random_tensors(c, torch.float32, DEV, ranks, seed=1)
    h32 = header_for(c, 0.3, "float32", ranks)
    cpu = Engine.from_tensors(h32, {k: v.cpu() for k, v in t32.items()}, "cpu", kv_policy="full")
    want = cpu.generate(prompts, n, stop_at_eos=False)
    want_trace = _traced(cpu, prompts, n)
    toks = torch.tensor(want)
    want_logits = _forced_logits(cpu, prompts, toks)
    checks = {}
    try:  # the CPU references of the two policies agree
        cd = Engine.from_tensors(h32, {k: v.cpu() for k, v in t32.items()}, "cpu", kv_policy="deferred")
        same = cd.generate(prompts, n, stop_at_eos=False) == want
        lg = _forced_logits(cd, prompts, toks)
        err = float((lg - want_logits).norm() / want_logits.norm())
        cerr = _cache_err(cd, cpu)
        checks["cpu deferred vs full"] = {"tokens_equal": same, "logits_rel_err": err, "cache_rel_err": cerr,
                                          "ok": bool(same and err < 1e-4 and (cerr or 0) < 1e-4)}
        del cd
    except Exception as ex:  # noqa: BLE001
        checks["cpu deferred vs full"] = {"ok": False, "error": f"{type(ex).__name__}: {ex}",
                                          "trace": traceback.format_exc()[-2000:]}
    combos = [(o, gr, "deferred", None) for o in (True, False) for gr in (True, False)] + [
        (True, True, "full", None), (False, False, "full", None),
        # programmatic dependent launch (_common.PDL_CONFIG; its trigger), graph and eager, side stream or not
        (True, True, "deferred", "late"), (False, True, "deferred", "late"), (True, False, "deferred", "late"),
        (True, True, "full", "late"), (True, True, "deferred", "early"), (False, True, "deferred", "early"),
        (True, True, "deferred", "off"), (False, True, "deferred", "off")]
    for overlap, graphs, kv, pdl in combos:
        key = f"fp32 overlap={'on' if overlap else 'off'} graph={'on' if graphs else 'off'} kv={kv}"
        key += f" pdl {pdl}" if pdl else ""
        undo = _pdl_mode(pdl)
        try:
            e = Engine.from_tensors(h32, t32, DEV, overlap=overlap, use_graphs=graphs, kv_policy=kv,
                                   batch_policy="per_sequence")
            got = e.generate(prompts, n, stop_at_eos=False)
            lg = _forced_logits(e, prompts, toks)
            err = float((lg - want_logits).norm() / want_logits.norm())
            row = {"tokens_equal": got == want, "logits_rel_err": err, "kernels": e.ops.kernels,
                   "kernel_check": e.kernel_check, "cache_rel_err": _cache_err(e, cpu)}
            if not graphs:
                row["index_sets_equal_frac"] = _same_sets(_traced(e, prompts, n), want_trace)
            row["ok"] = bool(row["tokens_equal"] and err < 1e-3 and row.get("index_sets_equal_frac", 1.0) > 0.98
                             and (row["cache_rel_err"] or 0.0) < 1e-3)
            checks[key] = row
            del e
        except Exception as ex:  # noqa: BLE001 - report and go on
            checks[key] = {"ok": False, "error": f"{type(ex).__name__}: {ex}", "trace": traceback.format_exc()[-2000:]}
        finally:
            if undo:
                undo()
    # batch 1 with the predictors' products in Triton (predictor.SCORE_METHOD "triton": batch 1
    # only), fp32 against the CPU reference of the same single prompt
    want1 = cpu.generate(prompts[:1], n, stop_at_eos=False)
    lg1 = _forced_logits(cpu, prompts[:1], toks[:1])
    for overlap, graphs in ((True, True), (False, False)):
        key = f"fp32 batch 1 triton scoring overlap={'on' if overlap else 'off'} graph={'on' if graphs else 'off'}"
        undo = _scoring("triton")(None)
        try:
            e = Engine.from_tensors(h32, t32, DEV, overlap=overlap, use_graphs=graphs)
            got = e.generate(prompts[:1], n, stop_at_eos=False)
            err = float((_forced_logits(e, prompts[:1], toks[:1]) - lg1).norm() / lg1.norm())
            checks[key] = {"tokens_equal": got == want1, "logits_rel_err": err, "kernels": e.ops.kernels,
                           "ok": bool(got == want1 and err < 1e-3)}
            del e
        except Exception as ex:  # noqa: BLE001
            checks[key] = {"ok": False, "error": f"{type(ex).__name__}: {ex}", "trace": traceback.format_exc()[-2000:]}
        finally:
            undo()
    # LayerNorms left to the kernels that read them (SparseDecoder.defer_ln_attn / defer_ln), fp32,
    # graph on, against the CPU reference of the same batch policy
    for key, kw, attrs, nb in (("fp32 batch 1 defer_ln_attn", {}, {"defer_ln_attn": True}, 1),

                               ("fp32 batch 1 defer_ln_attn defer_ln", {}, {"defer_ln_attn": True, "defer_ln": True}, 1),
                               ("fp32 batch 1 defer_ln_attn defer_ln z", {},
                                {"defer_ln_attn": True, "defer_ln": True, "fold_ln": "z"}, 1)):
        try:
            ref = Engine.from_tensors(h32, {k: v.cpu() for k, v in t32.items()}, "cpu", kv_policy="full", **kw)
            e = Engine.from_tensors(h32, t32, DEV, **kw)
            for name, value in attrs.items():
                setattr(e.decoder, name, value)
            from dejavu.plugins.layer_norm import PendingLN
            att, pend = e.ops.sparse_attn_deferred, []  # the attention calls that got a PendingLN
            e.ops.sparse_attn_deferred = lambda x, *a, **k: pend.append(isinstance(x, PendingLN)) or att(x, *a, **k)
            got, want_b = e.generate(prompts[:nb], n, stop_at_eos=False), ref.generate(prompts[:nb], n, stop_at_eos=False)
            lg, rl = _forced_logits(e, prompts[:nb], toks[:nb]), _forced_logits(ref, prompts[:nb], toks[:nb])
            err = float((lg - rl).norm() / rl.norm())
            exercised = sum(pend) > 0 or e.ops.kernels["sparse_attn_deferred"] != "triton"  # (graphs: capture calls)
            checks[key] = {"tokens_equal": got == want_b, "logits_rel_err": err, "kernels": e.ops.kernels,
                           "kernel_check": e.kernel_check, "pending_attn_calls": sum(pend),
                           "ok": bool(got == want_b and err < 1e-3 and exercised)}
            del e, ref
        except Exception as ex:  # noqa: BLE001
            checks[key] = {"ok": False, "error": f"{type(ex).__name__}: {ex}", "trace": traceback.format_exc()[-2000:]}
    fp16 = [("fp16 per_sequence", {"batch_policy": "per_sequence"}, None, 3),
            ("fp16 shared", {"batch_policy": "shared"}, None, 3),
            ("fp16 per_sequence kv=full", {"kv_policy": "full", "batch_policy": "per_sequence"}, None, 3),
            ("fp16 batch 1", {}, None, 1), ("fp16 batch 1 pdl off", {}, "off", 1), ("fp16 batch 1 pdl", {}, "late", 1),
            ("fp16 batch 1 pdl early", {}, "early", 1), ("fp16 shared pdl", {"batch_policy": "shared"}, "late", 3)]
    for key, kw, pdl, nb in fp16:
        undo = _pdl_mode(pdl)
        try:
            t16 = {k: v.half() for k, v in t32.items()}
            h16 = header_for(c, 0.3, "float16", ranks)
            ref = Engine.from_tensors(h16, {k: v.cpu() for k, v in t16.items()}, "cpu", dtype="float32",
                                      **{**kw, "kv_policy": "full"})
            e = Engine.from_tensors(h16, t16, DEV, **kw)
            lg, rl = _forced_logits(e, prompts[:nb], toks[:nb]), _forced_logits(ref, prompts[:nb], toks[:nb])
            err = float((lg - rl).norm() / rl.norm())
            checks[key] = {"logits_rel_err_vs_cpu_fp32": err, "kernels": e.ops.kernels,
                           "kernel_check": e.kernel_check, "ok": err < 0.15}  # top-k flips from fp16 rounding: ~0.03-0.07 seen on CPU
            del e
        except Exception as ex:  # noqa: BLE001
            checks[key] = {"ok": False, "error": f"{type(ex).__name__}: {ex}", "trace": traceback.format_exc()[-2000:]}
        finally:
            if undo:
                undo()
    out["checks"] = checks
    out["ok"] = all(r.get("ok") for r in checks.values())
    del t32
    free()
    return out


# ------------------------------------------------------------------ timed systems
def time_engine(eng, c: dict, B: int, P: int, N: int, cap_s: float, seed: int = 0) -> dict:
    """Generate N tokens for B random prompts of P tokens; decode latency per step.

    A short probe first (it also warms the prefill); if N steps would take longer than
    cap_s, fewer are timed (recorded as steps)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, c["vocab_size"], (B, P), generator=g).tolist()
    t0 = time.perf_counter()
    with torch.inference_mode():
        eng.activate(B, P + N)  # KV cache + CUDA-graph capture (warm-up compiles the kernels)
    sync()
    setup = time.perf_counter() - t0
    eng.generate(prompts, 8, stop_at_eos=False)
    est_ms = eng.stats.ms_per_token
    n = N if est_ms * N <= 1e3 * cap_s else max(16, int(1e3 * cap_s / est_ms))
    eng.generate(prompts, n, stop_at_eos=False)
    st = eng.stats
    row = {"ms_per_step": st.ms_per_token, "tokens_per_s": st.tokens_per_s, "prefill_ms": 1e3 * st.prefill_s,
           "setup_s": setup, "steps": st.new_tokens, "probe_ms_per_step": est_ms,
           "cuda_graph": eng.use_graphs}
    pr = eng.decoder.pred
    um = [int(torch.unique(pr.idx[l]["mlp"]).numel()) if pr.idx[l]["mlp"] is not None else c["ffn_dim"]
          for l in range(c["num_hidden_layers"])]
    ua = [int(torch.unique(pr.idx[l]["attn"]).numel()) if pr.idx[l]["attn"] is not None else c["num_attention_heads"]
          for l in range(c["num_hidden_layers"])]
    row["union_mlp_mean"], row["union_attn_mean"] = statistics.mean(um), statistics.mean(ua)
    return row, um, ua


def hf_model(c: dict, dtype):
    """transformers OPTForCausalLM with random weights, built on meta then materialised on cuda."""
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(**{**COMMON, **c})
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            m = OPTForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    m = m.to_empty(device=DEV)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    try:
        m.tie_weights()
    except Exception:  # noqa: BLE001 - to_empty keeps the shared Parameter tied anyway
        pass
    return m.eval()


def time_hf(m, c: dict, B: int, P: int, N: int, static: bool = False) -> dict:
    """Per-step decode latency of model.generate: (T(N) - T(1)) / (N - 1)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, c["vocab_size"], (B, P), generator=g).to(DEV)
    am = torch.ones_like(ids)
    kw = dict(do_sample=False, pad_token_id=1)
    if static:
        kw["cache_implementation"] = "static"

    def gen(n):
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            m.generate(input_ids=ids, attention_mask=am, max_new_tokens=n, min_new_tokens=n, **kw)
        sync()
        return time.perf_counter() - t

    t_first = gen(N if static else 2)  # warm-up (static: compiles for this cache length)
    tn = gen(N)
    t1 = gen(1) if not static else None  # static: another length would recompile
    row = {"total_s": tn, "warmup_s": t_first}
    if t1 is not None:
        row.update(ms_per_step=1e3 * (tn - t1) / (N - 1), prefill_ms=1e3 * t1)
    else:
        row.update(ms_per_step=1e3 * tn / N, note="total / N (prefill included: an upper bound)")
    row["tokens_per_s"] = B * 1e3 / row["ms_per_step"]
    return row


def mini_shape() -> dict | None:
    p = ROOT / "models" / "opt-mini" / "config.json"
    if not p.is_file():
        return None
    d = json.loads(p.read_text())
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "ffn_dim",
            "max_position_embeddings", "word_embed_proj_dim")
    return {k: d.get(k) or d["hidden_size"] for k in keys}


# ------------------------------------------------------------------ driver
SHARE_S = {"opt-30b": 150.0, "opt-1.3b": 60.0, "opt-mini": 30.0}  # time kept for models still to run


def bench_model(run: Run, name: str, c: dict, a, bw: float, later_s: float = 0.0) -> None:
    from dejavu.runtime import Engine

    dtype, esize = torch.float16, 2
    ranks, rank_source = default_ranks(c, a.mlp_rank, a.attn_rank)
    print(f"  predictor ranks {ranks} ({rank_source})", flush=True)
    P, N = a.prompt_len, a.new_tokens
    ctx = P + N / 2  # mean context length over the decode
    hf_reserve = later_s + (0.0 if a.no_hf else (a.hf_reserve if name == "opt-30b" else 15.0))
    base = {"model": name, "shape": c, "dtype": "float16", "weights": "random", "predictors": "random",
            "predictor_ranks": list(ranks), "predictor_rank_source": rank_source, "prompt_len": P, "new_tokens": N}
    dense_floor = {B: floor_bytes(c, B, ctx, esize) for B in a.batches}

    def record(system, B, row, floor_b):
        row = {**base, "system": system, "batch": B, **row, "floor_bytes": floor_b,
               "floor_ms": 1e3 * floor_b / (bw * 1e9)}
        row["vs_floor"] = row["ms_per_step"] / row["floor_ms"] if row.get("ms_per_step") else None
        run.add("results", row)
        print(f"  {name:9s} B={B:<3d} {system:24s} {row.get('ms_per_step', float('nan')):8.3f} ms/step "
              f"(floor {row['floor_ms']:.3f} ms)", flush=True)

    if DEV != "cuda":
        dtype = torch.float32
    t = random_tensors(c, dtype, DEV, ranks)
    try:
        for B in a.batches:  # batch 1 first: the headline numbers
            systems = [("dense_graph", None, True, "per_sequence", "full")]
            kv0 = a.kv_policies[0]  # the headline policy (deferred by default)
            sfx = lambda kv: "" if kv == kv0 else ("_fullkv" if kv == "full" else "_deferredkv")  # noqa: E731
            extra = [kv for kv in a.kv_policies[1:]]
            if a.batch_policy != "shared" or B == 1:  # at batch 1 both policies are the same
                for d in a.densities:
                    systems += [(f"dejavu_d{d}_{'on' if o else 'off'}", d, o, "per_sequence", kv0) for o in (True, False)]
                    if d in a.full_kv_densities:  # the other policy next to it, overlap on
                        systems += [(f"dejavu_d{d}_on{sfx(kv)}", d, True, "per_sequence", kv) for kv in extra]
            if B in a.ablate_batches:  # one change at a time against the headline row, overlap on
                systems += [(f"dejavu_d{d}_on_{v}", d, True, "per_sequence", kv0)
                            for d in a.ablate_densities for v in a.ablations]
            if a.batch_policy != "per_sequence" and B > 1:
                systems += [(f"dejavu_d{d}_{'on' if o else 'off'}_shared", d, o, "shared", kv0)
                            for d in a.densities for o in ((True,) if a.batch_policy == "both" else (True, False))]
                if B in a.ablate_batches:
                    systems += [(f"dejavu_d{d}_on_shared_{v}", d, True, "shared", kv0)
                                for d in a.ablate_densities for v in a.ablations]
            for system, d, overlap, policy, kv in systems:
                if run.left() < hf_reserve:
                    run.add("skipped", {"model": name, "system": system, "batch": B, "why": "time budget"})
                    continue
                variant = system.rsplit("_", 1)[-1] if system.rsplit("_", 1)[-1] in ABLATIONS else None
                undo = None
                try:
                    eng = Engine.from_tensors(header_for(c, d, str(dtype)[6:], ranks), t, DEV, overlap=overlap,
                                              batch_policy=policy, kv_policy=kv)
                    if variant:
                        undo = ABLATIONS[variant](eng)
                    row, um, ua = time_engine(eng, c, B, P, N, a.cap_s)
                    if variant:
                        row["variant"] = variant
                    row.update(kernels=dict(eng.ops.kernels), kernel_check=eng.kernel_check, overlap=overlap,
                               density=1.0 if d is None else float(d), batch_policy=policy, kv_policy=kv)
                    if isinstance(d, KFrom):
                        row.update(k_from=str(d), mlp_k=list(eng.spec.mlp_k), attn_k=list(eng.spec.attn_k))
                    fb = dense_floor[B] if d is None else floor_bytes(
                        c, B, ctx, esize, um, ua, list(eng.spec.attn_k), ranks, kv)
                    record(system, B, row, fb)
                except Exception as ex:  # noqa: BLE001 - record and go on
                    run.add("errors", {"model": name, "system": system, "batch": B,
                                       "error": f"{type(ex).__name__}: {ex}", "trace": traceback.format_exc()[-3000:]})
                    print(f"  {name} B={B} {system}: {type(ex).__name__}: {ex}", flush=True)
                finally:
                    if undo:
                        undo()
                    eng = None
                    free()
    finally:
        t = None
        free()
    if a.no_hf:
        return
    try:
        m = hf_model(c, dtype)
    except Exception as ex:  # noqa: BLE001
        run.add("errors", {"model": name, "system": "hf_eager", "error": f"{type(ex).__name__}: {ex}"})
        return
    try:
        for B in a.hf_batches:
            if run.left() < later_s + 5:
                run.add("skipped", {"model": name, "system": "hf_eager", "batch": B, "why": "time budget"})
                continue
            try:
                record("hf_eager", B, time_hf(m, c, B, P, N), dense_floor[B])
            except Exception as ex:  # noqa: BLE001
                run.add("errors", {"model": name, "system": "hf_eager", "batch": B, "error": f"{type(ex).__name__}: {ex}"})
                print(f"  {name} B={B} hf_eager: {type(ex).__name__}: {ex}", flush=True)
        if a.hf_compile and run.left() > a.hf_compile_min_left + later_s:
            try:
                record("hf_static_compile", 1, time_hf(m, c, 1, P, N, static=True), dense_floor[1])
            except Exception as ex:  # noqa: BLE001
                run.add("errors", {"model": name, "system": "hf_static_compile", "batch": 1,
                                   "error": f"{type(ex).__name__}: {ex}"})
    finally:
        m = None
        if a.hf_compile:  # compiled code keeps references to the model's weights
            try:
                torch._dynamo.reset()
            except Exception:  # noqa: BLE001
                pass
        free()


def table(results: list[dict]) -> str:
    base = {(r["model"], r["batch"], r["system"]): r for r in results}
    lines = ["| model | batch | system | kv | ms/step | tokens/s | floor ms | x floor | speedup vs dense_graph | vs hf_eager |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        ms = r.get("ms_per_step")
        if not ms:
            continue
        dg, hf = base.get((r["model"], r["batch"], "dense_graph")), base.get((r["model"], r["batch"], "hf_eager"))
        sp = lambda o: f"{o['ms_per_step'] / ms:.2f}x" if o and o.get("ms_per_step") else "-"  # noqa: E731
        kv = r.get("kv_policy", "-") if r.get("density", 1.0) < 1.0 else "-"
        lines.append(f"| {r['model']} | {r['batch']} | {r['system']} | {kv} | {ms:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['floor_ms']:.3f} | {r['vs_floor']:.2f} | {sp(dg)} | {sp(hf)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer batches, densities and tokens (~2-3 min)")
    p.add_argument("--smoke", action="store_true", help="only the GPU-vs-CPU correctness smoke test")
    p.add_argument("--no-smoke", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/e2e.json, else ./e2e.json)")
    p.add_argument("--models", default="opt-30b,opt-1.3b,opt-mini")
    p.add_argument("--batches", default=None, help="default 1,8,32 (quick: 1,8)")
    p.add_argument("--densities", default=None, help="default 0.3,0.1,0.5,0.2 (quick: 0.3,0.1); run in this order")
    p.add_argument("--k-from", default=None, metavar="ENGINE",
                   help="also time the per-layer K of this built .engine (header only), scaled to each shape "
                        "(KFrom: layers mapped proportionally); alone unless --densities is given")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (quick: 64)")
    p.add_argument("--batch-policy", default="both", choices=["per_sequence", "shared", "both"],
                   help="index sets per sequence [B,K], one shared [K], or both (shared with overlap on)")
    p.add_argument("--kv-policies", default="deferred,full",
                   help="K/V policies; the first is the headline (every density), the others run "
                        "at --full-kv-densities with overlap on")
    p.add_argument("--full-kv-densities", default="0.3", help="densities that also get the other K/V policies")
    p.add_argument("--mlp-rank", type=int, default=None, help="MLP predictor rank (default: the compiler's, min(budget rank, 512))")
    p.add_argument("--attn-rank", type=int, default=None, help="head predictor rank (default: the compiler's, min(H, budget))")
    p.add_argument("--cap-s", type=float, default=4.0, help="max seconds of timed decode per configuration")
    p.add_argument("--no-hf", action="store_true", help="skip transformers baselines")
    p.add_argument("--hf-batches", default=None, help="default: the same as --batches")
    p.add_argument("--hf-compile", action="store_true", help="also HF static cache + compile at batch 1 (slow build)")
    p.add_argument("--hf-compile-min-left", type=float, default=150.0)
    p.add_argument("--hf-reserve", type=float, default=60.0, help="seconds kept for OPT-30B's HF runs")
    p.add_argument("--budget", type=float, default=400.0, help="seconds; later measurements are skipped")
    p.add_argument("--tuned", default=None,
                   help="kernels.py JSON(s), comma-separated, whose sweep / sweep_attn / fused_mlp choices to use")
    p.add_argument("--ablations", default="unfusedln,twolaunchqkv,nofuse",
                   help="ablation rows, from: " + ", ".join(ABLATIONS))
    p.add_argument("--ablate-densities", default="0.3", help="densities that get the ablation rows")
    p.add_argument("--ablate-batches", default="1", help="batches that get the ablation rows")
    p.add_argument("--qkv-shared-min-batch", type=int, default=None,
                   help="use the shared-set Q/K/V kernel from this batch (QKV_CONFIG SHARED_MIN_BATCH; "
                        "default: the plugin's, 2)")
    p.add_argument("--swept-from", default=None, help="kernels.py --sweep/--sweep-attn JSON for the *swept ablation rows")
    a = p.parse_args(argv)
    q = a.quick
    a.batches = [int(x) for x in (a.batches or ("1,8" if q else "1,8,32")).split(",")]
    a.hf_batches = [int(x) for x in (a.hf_batches or ",".join(map(str, a.batches))).split(",")]
    dens = a.densities or (None if a.k_from else ("0.3,0.1" if q else "0.3,0.1,0.5,0.2"))
    a.densities = [KFrom.from_engine(a.k_from)] if a.k_from else []
    a.densities += [float(x) for x in dens.split(",")] if dens else []
    a.new_tokens = a.new_tokens or (64 if q else 128)
    a.kv_policies = [x for x in a.kv_policies.split(",") if x]
    if not a.kv_policies or any(x not in ("deferred", "full") for x in a.kv_policies):
        p.error("--kv-policies: a comma list of deferred, full")
    a.full_kv_densities = [float(x) for x in a.full_kv_densities.split(",") if x]
    a.ablate_densities = [float(x) for x in a.ablate_densities.split(",") if x]
    a.ablate_batches = [int(x) for x in a.ablate_batches.split(",") if x]
    a.ablations = [x for x in a.ablations.split(",") if x]
    if any(x not in ABLATIONS for x in a.ablations):
        p.error("--ablations: a comma list of " + ", ".join(ABLATIONS))
    out = Path(a.out or Path(os.environ.get("OUT", ".")) / "e2e.json")
    if DEV == "cuda" and not torch.cuda.is_available():
        print("e2e: no CUDA GPU here; this benchmark needs one", file=sys.stderr)
        return 2
    try:
        import dejavu.runtime  # noqa: F401
    except ImportError as e:
        print(f"e2e: cannot import dejavu.runtime ({e}); run `pip install --no-deps --no-build-isolation -q .` "
              "or `source benchmarks/device_env.sh` first", file=sys.stderr)
        return 2
    meta = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu dry run", "torch": torch.__version__, "args": vars(a),
            "note": "random weights and random predictors of the real shapes; latency per decode step "
                    "(one token per sequence); floor = bytes that must be read / copy bandwidth"}
    if a.k_from:  # the allocation timed, as read from the engine
        meta["k_from"] = {"engine": a.k_from, **{k: getattr(a.densities[0], k) for k in ("density", "mlp", "attn")}}
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except ImportError:
        a.no_hf = True
    meta["tuned"] = apply_tuned(a.tuned)
    if a.swept_from:
        if Path(a.swept_from).is_file():
            found = json.loads(Path(a.swept_from).read_text())
            SWEPT.update({k: found[k] for k in ("sweep", "sweep_attn") if found.get(k)})
        meta["swept_from"] = {k: {kk: v for kk, v in d.items() if kk != "rows"} for k, d in SWEPT.items()}
        print(f"--swept-from: {meta['swept_from'] or 'nothing found'}", flush=True)
    if a.qkv_shared_min_batch is not None:  # benchmark-only override of the plugin default
        import importlib

        importlib.import_module("dejavu.plugins.deferred_kv").QKV_CONFIG["SHARED_MIN_BATCH"] = a.qkv_shared_min_batch
        meta["tuned"]["qkv_shared_min_batch"] = a.qkv_shared_min_batch
    run = Run(out, a.budget, meta)
    if not a.no_smoke:
        s = smoke()
        run.add("smoke", s)
        print("smoke:", "PASS" if s["ok"] else "FAIL", json.dumps({k: {kk: v for kk, v in r.items() if kk != "trace"}
                                                                  for k, r in s["checks"].items()}, default=str), flush=True)
        if a.smoke:
            return 0 if s["ok"] else 1
    bw = copy_bandwidth()
    run.add("bandwidth", bw)
    print(f"copy bandwidth {bw['copy_GBps']:.0f} GB/s", flush=True)
    shapes = {**SHAPES, "tiny": TINY}
    ms = mini_shape()
    if ms:
        shapes["opt-mini"] = ms
    names = a.models.split(",")
    for i, name in enumerate(names):
        if name not in shapes:
            run.add("skipped", {"model": name, "why": "shape unknown (opt-mini config not shipped?)"})
            continue
        if run.left() < 10:
            run.add("skipped", {"model": name, "why": "time budget"})
            continue
        print(f"{name}: {shapes[name]}", flush=True)
        later = sum(SHARE_S.get(m, 10.0) for m in names[i + 1:] if m in shapes)
        bench_model(run, name, shapes[name], a, bw["copy_GBps"], later)
    run.data["meta"]["elapsed_s"] = time.perf_counter() - run.t0
    run.save()
    print()
    print(table(run.data["results"]))
    if run.data["errors"]:
        print(f"\n{len(run.data['errors'])} errors (see {out}):")
        for e in run.data["errors"]:
            print(f"  {e.get('model')} {e.get('system')} B={e.get('batch')}: {e['error'][:200]}")
    if run.data["skipped"]:
        print(f"{len(run.data['skipped'])} measurements skipped (time budget or missing shape)")
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
