"""End-to-end decode benchmark on one GPU: dejavu engines against dense baselines.

    pip install --no-deps --no-build-isolation -q . && python benchmarks/e2e.py [--quick] [--smoke]

Models: OPT-30B, OPT-66B (--num-layers: the first N of its 64 layers) and OPT-1.3B shapes, and opt-mini's shape when its config is shipped, all
in fp16 with RANDOM weights and RANDOM predictors of the real shapes (ranks: dejavu.compiler's
defaults for the shape, MLP min(10%-budget rank, 512) in float, twice that as int8 rows (--predictor-dtype,
default the compiler's: int8), heads min(H, budget); --mlp-rank/--attn-rank override): latency does not
depend on the weights' values,
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
  dejavu_d{D}_{on|off}_tokenk  (--token-k) density D with a per-token MLP K: top-2K_l, theta_l fitted
                  (with_token_k) to --token-k-rows: read (the default, as dejavu-compile's) so that the mean rows
                  read (kept + kept with h != 0) are 2 K_l, selected so that the mean kept rows are K_l; batch 1 /
                  per sequence. Its floor counts the 2K_l selected rows; kept_mlp_mean: the mean kept rows a layer
                  over the probe's 8 steps.
(--overlaps on: the density rows with the overlap on only) and for each the bandwidth floor: bytes that
policy must read per step / copy bandwidth measured in this run. Per-step latency = decode time / steps (one token per sequence).

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
import dataclasses
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

from dejavu.compiler.config import PREDICTOR_DTYPES, TOKEN_K_ROWS, BuildConfig, PredictorSettings
from dejavu.fileio import write_json

ROOT = Path(__file__).resolve().parent.parent
PREDICTOR_DTYPE = PredictorSettings.dtype  # the random engines' MLP predictors: as the compiler's default
# "cpu" dry-runs the driver on tiny shapes (no graphs, reference ops): DEJAVU_E2E_DEVICE=cpu
DEV = os.environ.get("DEJAVU_E2E_DEVICE", "cuda")
SHAPES = {  # HF config fields of the released models (facebook/opt-*/config.json)
    "opt-30b": dict(vocab_size=50272, hidden_size=7168, num_hidden_layers=48, num_attention_heads=56,
                    ffn_dim=28672, max_position_embeddings=2048, word_embed_proj_dim=7168),
    "opt-66b": dict(vocab_size=50272, hidden_size=9216, num_hidden_layers=64, num_attention_heads=72,
                    ffn_dim=36864, max_position_embeddings=2048, word_embed_proj_dim=9216),
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
        write_json(self.out, self.data, indent=1, default=str)

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


def _options(**changes):
    """DecodeOptions fields for one row (SparseDecoder.set_options; the undo restores the old options)."""
    def apply(eng):
        dec = eng.decoder
        old = dec.options
        dec.set_options(**changes)

        def undo():
            dec.options = old
        return undo
    return apply


class Settings:
    """An ablation row that runs the engine with other kernel settings: fn(KernelSettings) -> KernelSettings
    (plugins.settings; passed to Engine(kernel_settings=...), no module global changes)."""

    def __init__(self, fn):
        self.fn = fn


def _replace(part: str, **kv):
    """Settings with fields of one kernel's settings (KernelSettings.<part>) replaced."""
    return Settings(lambda s: dataclasses.replace(s, **{part: dataclasses.replace(getattr(s, part), **kv)}))


def pdl_settings(s, mode):
    """The smoke test's PDL forms of settings s: None (as they are), "off", "late" (every trigger late),
    "early" (every trigger early)."""
    if mode is None:
        return s
    from dejavu.plugins import PDL_KINDS

    if mode == "off":
        return dataclasses.replace(s, pdl=dataclasses.replace(s.pdl, ENABLED=False))
    return dataclasses.replace(s, pdl=dataclasses.replace(s.pdl, ENABLED=True, EARLY=() if mode == "late" else PDL_KINDS))


def _no_predictors(eng):
    """No predictor work at all: every layer gets a fixed random index set of its K (drawn
    once, sorted), so the step runs the same sparse kernels without predictor GEMVs and
    top-ks: the row's distance to the headline row is what the predictors cost."""
    sets: dict = {}

    def fixed(x, a, b, bias, k, shared=False, scales=None):
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
    step to step as the predictors' do on random weights (the deferred K/V slow path still runs;
    `nopred`'s fixed sets leave it nothing to do). Three tiny launches per call replace the
    predictor's GEMVs and top-k."""
    pools: dict = {}
    n = 61  # prime: a layer's call number modulo n differs from step to step

    def cycled(x, a, b, bias, k, shared=False, scales=None):
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


# Ablation rows (--ablations): the shipped path with one thing changed each, the few that explain it.
# The *_nooverlap and *_fullkv systems (predictors inline, K/V of every head) and the dense graph are
# systems of their own, not ablations. Modes that were measured slower and deleted: BENCHMARKS.md.
ABLATIONS = {"same": lambda eng: None,  # the headline row again (run-to-run spread)
             "same2": lambda eng: None,  # and once more, later in the run
             # the predictors' cost: fixed index sets (no predictor work, no K/V slow path), or sets that
             # change every step as the predictors' do on random weights (no predictor kernels)
             "nopred": _no_predictors, "nopredrand": _no_predictors_random,
             # programmatic dependent launch off (plain launches)
             "nopdl": _replace("pdl", ENABLED=False),
             # the predictors' products by cuBLAS instead of Triton's gather_gemv at batch 1
             "cublasscore": _replace("scoring", method="torch"),
             # the decode graph at the default stream priority (the predictors' stream's) instead of the highest
             "mainzero": _options(graph_priority=0),
             # refresh heads off, or 4 per layer at every density (the default: 4 from 40% of heads attending)
             "norefresh": _options(kv_refresh=0), "refresh4": _options(kv_refresh=4, kv_refresh_lags=(None, None)),
             # the LayerNorm before attention as its own launch (not in the Q/K/V kernel)
             "nolnqkv": _options(defer_ln_attn=False),
             # batch 1's Q/K/V choices: SHARED_P 16 on the unfolded route; the finish never folded into
             # attention; the partial kernel aimed at 528 programs (every SM slot) instead of 512
             "nounfolded": _replace("qkv_b1", SHARED_P_UNFOLDED=None),
             "nofoldfinish": _replace("qkv_b1", FOLD_FINISH=False), "qkvt528": _replace("qkv_b1", TARGET_PROGRAMS=528)}


def apply_tuned(path: str | None, s):
    """Settings s with the kernel blocks a `kernels.py` run picked (its JSON's "sweep_attn", "sweep" and
    "pred_gemv" sections; several JSONs: later ones win): (settings, what changed)."""
    if not path:
        return s, {}
    res = {}
    for one in path.split(","):
        if Path(one).is_file():
            res.update(json.loads(Path(one).read_text()))
        else:
            print(f"--tuned: {one} not found, skipped", flush=True)
    r, used = dataclasses.replace, {}
    found = res.get("sweep_attn") or {}
    for key, part in (("qkv", "qkv_b1"), ("attn", "attn")):  # swept at batch 1
        if found.get(key):
            s = r(s, **{part: r(getattr(s, part), **found[key])})
            used[key] = dict(found[key])
    routes = {"fc1": {"gemv": "fc1_gemv", "dot": "fc1_dot"},  # kernels.py --sweep
              "fc2": {"gemv": "fc2_gemv", "dot": "fc2_dot", "dot1": "fc2_dot1", "proj1": "proj1"}}
    for kernel, names in routes.items():
        for route, cfg in ((res.get("sweep") or {}).get(kernel) or {}).items():
            s = r(s, **{names[route]: r(getattr(s, names[route]), **cfg)})
            used[f"{kernel}/{route}"] = dict(cfg)
    pg = (res.get("pred_gemv") or {}).get("best")  # kernels.py --sections pred_gemv
    if pg:
        s = r(s, scoring=r(s.scoring, **{part: r(getattr(s.scoring, part), **cfg) for part, cfg in pg.items()}))
        used["pred_gemv"] = {k: dict(v) for k, v in pg.items()}
    print(f"kernel settings from {path}: {used}", flush=True)
    return s, used


# ------------------------------------------------------------------ engines in memory
def default_ranks(c: dict, mlp: int | None = None, attn: int | None = None,
                  predictor_dtype: str = PREDICTOR_DTYPE) -> tuple[tuple[int, int], str]:
    """(mlp_rank, attn_rank), source: the compiler's defaults for this shape and MLP predictor dtype (the
    benchmark may import the compiler; the runtime never does), unless given on the command line."""
    from dejavu.compiler.predictors import default_ranks as compiler_ranks
    from dejavu.models.opt import OPTConfig

    s = PredictorSettings(dtype=predictor_dtype)
    comp = tuple(int(r) for r in compiler_ranks(OPTConfig.from_hf_dict({**COMMON, **c}), s))
    if mlp or attn:
        return (mlp or comp[0], attn or comp[1]), "command line"
    return comp, "dejavu.compiler default"


def random_tensors(c: dict, dtype, device, ranks, seed: int = 0, predictor_dtype: str = PREDICTOR_DTYPE) -> dict:
    """Kernel-layout engine tensors with random values (created on the device directly); predictor_dtype
    "int8": the MLP predictors' a and b as the compiler stores them (int8 rows, .a_scale / .b_scale fp16)."""
    from dejavu.compiler.predictors import quantize_rows

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
            if kind == "pred_mlp" and predictor_dtype == "int8":
                for m in ("a", "b"):
                    t[p + kind + "." + m], t[p + kind + f".{m}_scale"] = quantize_rows(t[p + kind + "." + m])
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
        """From an engine, or from the part of its header this reads saved as JSON
        (benchmarks/gpu/k/, `speed_opt.sh --save-k`), so a GPU run needs no engine build."""
        from dejavu.engine_file import read_header

        h = json.loads(Path(path).read_text()) if path.endswith(".json") else read_header(path)
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


def header_for(c: dict, density, dtype_name: str, ranks, predictor_dtype: str = PREDICTOR_DTYPE) -> dict:
    """Engine header; density None = dense (K = N, no predictors used); a float = that fraction of
    neurons and heads in every layer; a KFrom = a built engine's per-layer K scaled to this shape.
    predictor_dtype: the MLP predictors' storage, as random_tensors made them."""
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
                             "predictor_dtype": {"mlp": predictor_dtype, "attn": "float"},
                             "note": "random weights and random predictors of the real shapes"},
            "target": {"device": "cuda", "arch": None, "kernel_settings": {}}}


def with_token_k(header: dict, t: dict, c: dict | None = None, steps: int = 32, seed: int = 0, *,
                 rows: str) -> dict:
    """header with a per-token MLP K (build_config.token_k, form "share"): each sparse layer selects its
    top k_max = 2 K_l and keeps the rows whose share passes theta_l, fitted (compiler.token_k.fit_theta) so
    that the mean kept rows are K_l on the inputs its predictor sees in decode: a fixed-K engine of the same
    header decodes `steps` tokens of a random prompt eagerly (no graph, no side stream) and each layer's MLP
    predictor input is recorded (as the compiler fits theta on held-out text through the engine). Random
    predictors: the kept count per token follows their score distribution, not a trained one. c: the
    model's config (None: inputs of unit variance, not the decode's). rows "read" (c needed): theta_l fitted
    (fit_theta_read) so that the mean kept rows plus kept rows with h != 0 are 2 K_l, h = relu(fc1) over
    every neuron of the MLP inputs the same decode records (the last `steps` of each layer's, paired in order)."""
    from dejavu.compiler.token_k import cap_rows, fit_theta, fit_theta_read
    from dejavu.runtime import Engine

    bc, F = header["build_config"], header["model_config"]["ffn_dim"]
    L = len(bc["mlp_k"])
    seen: dict[int, list] = {l: [] for l in range(L)}
    mlp_in: dict[int, list] = {l: [] for l in range(L)}
    if rows == "read" and c is None:
        raise ValueError("with_token_k: rows 'read' needs the model's config (the decode's MLP inputs)")
    if c is not None:
        eng = Engine.from_tensors(header, t, DEV, overlap=False, use_graphs=False)
        pr, orig = eng.decoder.pred, eng.decoder.pred._predict
        layer_of = {t[f"layers.{l}.mlp.w1"].data_ptr(): l for l in range(L)}
        fc1 = eng.ops.sparse_fc1

        def record(l, x, done=None):
            seen[l].append(x.detach().float().clone())
            return orig(l, x, done)

        def record_fc1(x, w1, *rest, **kw):  # the MLP input (after its LayerNorm) of the layer whose w1 this is
            mlp_in[layer_of[w1.data_ptr()]].append(x.detach().float().clone())
            return fc1(x, w1, *rest, **kw)

        pr._predict = record
        eng.ops.sparse_fc1 = record_fc1
        g = torch.Generator().manual_seed(seed)
        with torch.inference_mode():
            eng.generate([torch.randint(4, c["vocab_size"], (32,), generator=g).tolist()], steps, stop_at_eos=False)
        del eng
        free()
    g = torch.Generator(device=t["embed_tokens"].device).manual_seed(seed)
    th, km = [], []
    for l, k in enumerate(bc["mlp_k"]):
        a, b, bias = (t[f"layers.{l}.pred_mlp.{n}"].float() for n in ("a", "b", "bias"))
        if f"layers.{l}.pred_mlp.a_scale" in t:  # int8 rows: dequantized
            a, b = (w * t[f"layers.{l}.pred_mlp.{n}_scale"].float()[:, None] for w, n in ((a, "a"), (b, "b")))
        x = torch.cat(seen[l])[-steps:] if seen[l] else torch.randn(256, a.shape[1], generator=g, device=a.device)
        km.append(cap_rows(k, F) if k < F else k)
        if k >= F:
            th.append(1.0)
        elif rows == "read":
            xm = torch.cat(mlp_in[l])[-steps:]
            n = min(len(x), len(xm))
            h = torch.relu(xm[-n:] @ t[f"layers.{l}.mlp.w1"].float().T + t[f"layers.{l}.mlp.b1"].float())
            th.append(fit_theta_read(((x[-n:] @ a.T) @ b.T + bias), h, 2 * k, km[-1]))
        else:
            th.append(fit_theta((x @ a.T) @ b.T + bias, k, km[-1]))
    fitted = "decode inputs, {} steps".format(steps) if c is not None else "random inputs"
    return {**header, "build_config": {**bc, "token_k": {"form": "share", "threshold": th, "k_max": km,
                                                         "k_mean": list(bc["mlp_k"]), "fitted_on": fitted,
                                                         "rows": rows}}}


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
                ranks=None, kv_policy: str = "full", predictor_dtype: str = "float") -> float:
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
            # predictors; int8 MLP rows: r (D + F) bytes with 2 (r + F) bytes of scales, in 2-byte elements
            mlp_pred = ranks[0] * (D + F) / 2 + ranks[0] + F if predictor_dtype == "int8" else ranks[0] * (D + F)
            total += mlp_pred + F + ranks[1] * (D + H) + H
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


def base_settings():
    """The kernel settings for this run's device (plugins.resolve_kernel_settings), what the compiler
    would record in an engine built for it."""
    from dejavu.plugins import resolve_kernel_settings

    if DEV != "cuda":
        return resolve_kernel_settings(None)
    major, minor = torch.cuda.get_device_capability()
    return resolve_kernel_settings(f"sm_{major}{minor}", torch.cuda.get_device_properties(0).multi_processor_count)


def smoke(ks=None) -> dict:
    """Tiny random model: GPU fp32 (graph/eager, overlap on/off, kv_policy deferred/full)
    against the CPU reference with kv_policy full (the contract's description); ks: the run's kernel settings."""
    from dejavu.runtime import Engine

    ks = ks or base_settings()

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
        # programmatic dependent launch (settings.pdl; its trigger), graph and eager, side stream or not
        (True, True, "deferred", "late"), (False, True, "deferred", "late"), (True, False, "deferred", "late"),
        (True, True, "full", "late"), (True, True, "deferred", "early"), (False, True, "deferred", "early"),
        (True, True, "deferred", "off"), (False, True, "deferred", "off")]
    for overlap, graphs, kv, pdl in combos:
        key = f"fp32 overlap={'on' if overlap else 'off'} graph={'on' if graphs else 'off'} kv={kv}"
        key += f" pdl {pdl}" if pdl else ""
        try:
            e = Engine.from_tensors(h32, t32, DEV, overlap=overlap, use_graphs=graphs, kv_policy=kv,
                                   batch_policy="per_sequence", kernel_settings=pdl_settings(ks, pdl))
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
    # batch 1 with the predictors' products in Triton (settings.scoring.method "triton": batch 1
    # only), fp32 against the CPU reference of the same single prompt
    want1 = cpu.generate(prompts[:1], n, stop_at_eos=False)
    lg1 = _forced_logits(cpu, prompts[:1], toks[:1])
    for overlap, graphs in ((True, True), (False, False)):
        key = f"fp32 batch 1 triton scoring overlap={'on' if overlap else 'off'} graph={'on' if graphs else 'off'}"
        try:
            triton_scoring = dataclasses.replace(ks, scoring=dataclasses.replace(ks.scoring, method="triton"))
            e = Engine.from_tensors(h32, t32, DEV, overlap=overlap, use_graphs=graphs, kernel_settings=triton_scoring)
            got = e.generate(prompts[:1], n, stop_at_eos=False)
            err = float((_forced_logits(e, prompts[:1], toks[:1]) - lg1).norm() / lg1.norm())
            checks[key] = {"tokens_equal": got == want1, "logits_rel_err": err, "kernels": e.ops.kernels,
                           "ok": bool(got == want1 and err < 1e-3)}
            del e
        except Exception as ex:  # noqa: BLE001
            checks[key] = {"ok": False, "error": f"{type(ex).__name__}: {ex}", "trace": traceback.format_exc()[-2000:]}
    # the LayerNorm before attention left to the Q/K/V kernel (DecodeOptions.defer_ln_attn, the default),
    # fp32, graph on, against the CPU reference of the same batch policy
    for key, kw, attrs, nb in (("fp32 batch 1 defer_ln_attn", {}, {"defer_ln_attn": True}, 1),):
        try:
            ref = Engine.from_tensors(h32, {k: v.cpu() for k, v in t32.items()}, "cpu", kv_policy="full", **kw)
            e = Engine.from_tensors(h32, t32, DEV, kernel_settings=ks, **kw)
            e.decoder.set_options(**attrs)
            from dejavu.plugins import PendingLN
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
        try:
            t16 = {k: v.half() for k, v in t32.items()}
            h16 = header_for(c, 0.3, "float16", ranks)
            ref = Engine.from_tensors(h16, {k: v.cpu() for k, v in t16.items()}, "cpu", dtype="float32",
                                      **{**kw, "kv_policy": "full"})
            e = Engine.from_tensors(h16, t16, DEV, kernel_settings=pdl_settings(ks, pdl), **kw)
            lg, rl = _forced_logits(e, prompts[:nb], toks[:nb]), _forced_logits(ref, prompts[:nb], toks[:nb])
            err = float((lg - rl).norm() / rl.norm())
            checks[key] = {"logits_rel_err_vs_cpu_fp32": err, "kernels": e.ops.kernels,
                           "kernel_check": e.kernel_check, "ok": err < 0.15}  # top-k flips from fp16 rounding: ~0.03-0.07 seen on CPU
            del e
        except Exception as ex:  # noqa: BLE001
            checks[key] = {"ok": False, "error": f"{type(ex).__name__}: {ex}", "trace": traceback.format_exc()[-2000:]}
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
    pr = eng.decoder.pred
    kept_steps = []  # a per-token K: mean kept rows over the layers, each probe step (read between steps)

    def count(_):
        ks = [float(n.float().mean()) for n in pr.n_kept if n is not None]
        if ks:
            kept_steps.append(statistics.mean(ks))

    eng.generate(prompts, 8, stop_at_eos=False, stream=count)
    est_ms = eng.stats.ms_per_token
    n = N if est_ms * N <= 1e3 * cap_s else max(16, int(1e3 * cap_s / est_ms))
    eng.generate(prompts, n, stop_at_eos=False)
    st = eng.stats
    row = {"ms_per_step": st.ms_per_token, "tokens_per_s": st.tokens_per_s, "prefill_ms": 1e3 * st.prefill_s,
           "setup_s": setup, "steps": st.decode_steps, "probe_ms_per_step": est_ms,
           "cuda_graph": eng.use_graphs}
    um = [int(torch.unique(pr.idx[l]["mlp"]).numel()) if pr.idx[l]["mlp"] is not None else c["ffn_dim"]
          for l in range(c["num_hidden_layers"])]
    ua = [int(torch.unique(pr.idx[l]["attn"]).numel()) if pr.idx[l]["attn"] is not None else c["num_attention_heads"]
          for l in range(c["num_hidden_layers"])]
    row["union_mlp_mean"], row["union_attn_mean"] = statistics.mean(um), statistics.mean(ua)
    if kept_steps:  # the probe's steps (the first is the prefill's last position)
        row["kept_mlp_mean"] = statistics.mean(kept_steps)
        row["kept_mlp_steps"] = [round(k, 1) for k in kept_steps]
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


def gpu_clocks() -> dict | None:
    """SM / memory clocks (MHz) and temperature now, from nvidia-smi; None where it is absent."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
        sm, mem, temp = (float(x) for x in out.splitlines()[0].split(","))
    except Exception:  # noqa: BLE001 - no driver tool, no figure
        return None
    return {"sm_mhz": sm, "mem_mhz": mem, "temp_c": temp}


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
    ranks, rank_source = default_ranks(c, a.mlp_rank, a.attn_rank, a.predictor_dtype)
    print(f"  predictor ranks {ranks} ({rank_source}), MLP predictors {a.predictor_dtype}", flush=True)
    P, N = a.prompt_len, a.new_tokens
    ctx = P + N / 2  # mean context length over the decode
    hf_reserve = later_s + (0.0 if a.no_hf else (a.hf_reserve if name == "opt-30b" else 15.0))
    base = {"model": name, "shape": c, "dtype": "float16", "weights": "random", "predictors": "random",
            "predictor_ranks": list(ranks), "predictor_rank_source": rank_source, "predictor_dtype": a.predictor_dtype,
            "prompt_len": P, "new_tokens": N}
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
    t = random_tensors(c, dtype, DEV, ranks, predictor_dtype=a.predictor_dtype)
    try:
        for B in a.batches:  # batch 1 first: the headline numbers
            systems = [("dense_graph", None, True, "per_sequence", "full")]
            kv0 = a.kv_policies[0]  # the headline policy (deferred by default)
            sfx = lambda kv: "" if kv == kv0 else ("_fullkv" if kv == "full" else "_deferredkv")  # noqa: E731
            extra = [kv for kv in a.kv_policies[1:]]
            if a.batch_policy != "shared" or B == 1:  # at batch 1 both policies are the same
                for d in a.densities:
                    systems += [(f"dejavu_d{d}_{'on' if o else 'off'}", d, o, "per_sequence", kv0) for o in a.overlaps]
                    if a.token_k:  # the per-token K beside it (with_token_k)
                        systems += [(f"dejavu_d{d}_{'on' if o else 'off'}_tokenk", d, o, "per_sequence", kv0)
                                    for o in a.overlaps]
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
                undo, row_ks = None, a.kernel_settings
                if variant and isinstance(ABLATIONS[variant], Settings):
                    row_ks = ABLATIONS[variant].fn(row_ks)
                try:
                    hdr = header_for(c, d, str(dtype)[6:], ranks, a.predictor_dtype)
                    hdr = with_token_k(hdr, t, c, rows=a.token_k_rows) if "_tokenk" in system else hdr
                    eng = Engine.from_tensors(hdr, t, DEV, overlap=overlap,
                                              batch_policy=policy, kv_policy=kv, kernel_settings=row_ks)
                    if variant and not isinstance(ABLATIONS[variant], Settings):
                        undo = ABLATIONS[variant](eng)
                    row, um, ua = time_engine(eng, c, B, P, N, a.cap_s)
                    if variant:
                        row["variant"] = variant
                    row.update(kernels=dict(eng.ops.kernels), kernel_check=eng.kernel_check, overlap=overlap,
                               density=1.0 if d is None else float(d), batch_policy=policy, kv_policy=kv)
                    if isinstance(d, KFrom):
                        row.update(k_from=str(d), mlp_k=list(eng.spec.mlp_k), attn_k=list(eng.spec.attn_k))
                    fb = dense_floor[B] if d is None else floor_bytes(
                        c, B, ctx, esize, um, ua, list(eng.spec.attn_k), ranks, kv, a.predictor_dtype)
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
                for rep in range(a.hf_repeats):  # HF eager has spread widely across runs: repeat, with the clocks
                    record("hf_eager", B, {**time_hf(m, c, B, P, N), "repeat": rep, "clocks": gpu_clocks()},
                           dense_floor[B])
                    if run.left() < later_s + 5:
                        break
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
    p.add_argument("--k-from", default=None, metavar="ENGINE[,ENGINE...]",
                   help="also time the per-layer K of these built .engine files (headers only), scaled to each "
                        "shape (KFrom: layers mapped proportionally); alone unless --densities is given")
    p.add_argument("--num-layers", type=int, default=None,
                   help="time the first N layers of each shape (OPT-66B's 64 layers, ~130 GB in fp16, do not fit one GPU)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (quick: 64)")
    p.add_argument("--batch-policy", default="both", choices=["per_sequence", "shared", "both"],
                   help="index sets per sequence [B,K], one shared [K], or both (shared with overlap on)")
    p.add_argument("--kv-policies", default="deferred,full",
                   help="K/V policies; the first is the headline (every density), the others run "
                        "at --full-kv-densities with overlap on")
    p.add_argument("--full-kv-densities", default="0.3", help="densities that also get the other K/V policies")
    p.add_argument("--mlp-rank", type=int, default=None,
                   help="MLP predictor rank (default: the compiler's for --predictor-dtype: min(budget rank, 512) "
                        "in float, twice that in int8)")
    p.add_argument("--predictor-dtype", default=PREDICTOR_DTYPE, choices=PREDICTOR_DTYPES,
                   help="MLP predictors as the compiler stores them: int8 rows with an fp16 scale a row, or float")
    p.add_argument("--attn-rank", type=int, default=None, help="head predictor rank (default: the compiler's, min(H, budget))")
    p.add_argument("--cap-s", type=float, default=4.0, help="max seconds of timed decode per configuration")
    p.add_argument("--no-hf", action="store_true", help="skip transformers baselines")
    p.add_argument("--hf-batches", default=None, help="default: the same as --batches")
    p.add_argument("--hf-repeats", type=int, default=1, help="HF eager timings per batch (each with the GPU clocks)")
    p.add_argument("--hf-compile", action="store_true", help="also HF static cache + compile at batch 1 (slow build)")
    p.add_argument("--hf-compile-min-left", type=float, default=150.0)
    p.add_argument("--hf-reserve", type=float, default=60.0, help="seconds kept for OPT-30B's HF runs")
    p.add_argument("--budget", type=float, default=400.0, help="seconds; later measurements are skipped")
    p.add_argument("--tuned", default=None,
                   help="kernels.py JSON(s), comma-separated, whose sweep / sweep_attn / pred_gemv choices to use")
    p.add_argument("--token-k", action="store_true",
                   help="also each density with a per-token MLP K (top-2K, fitted to --token-k-rows; batch 1 / per "
                        "sequence), overlap on and off: dejavu_d{D}_{on|off}_tokenk")
    p.add_argument("--token-k-rows", default=BuildConfig.token_k_rows, choices=TOKEN_K_ROWS,
                   help="the per-token K's fit: mean kept rows K (selected) or mean rows read 2K (read: kept + "
                        "kept with h != 0), as dejavu-compile --token-k-rows")
    p.add_argument("--overlaps", default="on,off", help="predictor overlap of the density rows: on,off / on / off")
    p.add_argument("--ablations", default="same,nolnqkv,nopredrand",
                   help="ablation rows, from: " + ", ".join(ABLATIONS))
    p.add_argument("--ablate-densities", default="0.3", help="densities that get the ablation rows")
    p.add_argument("--ablate-batches", default="1", help="batches that get the ablation rows")
    p.add_argument("--qkv-shared-min-batch", type=int, default=None,
                   help="use the shared-set Q/K/V kernel from this batch (settings.qkv SHARED_MIN_BATCH; "
                        "default: the plugin's, 2)")
    a = p.parse_args(argv)
    q = a.quick
    a.batches = [int(x) for x in (a.batches or ("1,8" if q else "1,8,32")).split(",")]
    a.hf_batches = [int(x) for x in (a.hf_batches or ",".join(map(str, a.batches))).split(",")]
    dens = a.densities or (None if a.k_from else ("0.3,0.1" if q else "0.3,0.1,0.5,0.2"))
    a.densities = [KFrom.from_engine(e) for e in a.k_from.split(",") if e] if a.k_from else []
    a.densities += [float(x) for x in dens.split(",")] if dens else []
    a.new_tokens = a.new_tokens or (64 if q else 128)
    a.kv_policies = [x for x in a.kv_policies.split(",") if x]
    if not a.kv_policies or any(x not in ("deferred", "full") for x in a.kv_policies):
        p.error("--kv-policies: a comma list of deferred, full")
    a.full_kv_densities = [float(x) for x in a.full_kv_densities.split(",") if x]
    a.ablate_densities = [float(x) for x in a.ablate_densities.split(",") if x]
    a.ablate_batches = [int(x) for x in a.ablate_batches.split(",") if x]
    a.overlaps = [{"on": True, "off": False}.get(x, x) for x in a.overlaps.split(",") if x]
    if not a.overlaps or any(not isinstance(x, bool) for x in a.overlaps):
        p.error("--overlaps: a comma list of on, off")
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
    from dejavu.provenance import tree_commit

    meta = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu dry run", "torch": torch.__version__, "args": vars(a),
            "commit": tree_commit(Path(__file__)), "note": "random weights and random predictors of the real shapes; latency per decode step "
                    "(one token per sequence); floor = bytes that must be read / copy bandwidth"}
    if a.k_from:  # the allocation timed, as read from the engine
        meta["k_from"] = [{"engine": str(d), **{k: getattr(d, k) for k in ("density", "mlp", "attn")}}
                          for d in a.densities if isinstance(d, KFrom)]
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except ImportError:
        a.no_hf = True
    a.kernel_settings, meta["tuned"] = apply_tuned(a.tuned, base_settings())
    if a.qkv_shared_min_batch is not None:  # this run's settings only
        qkv = dataclasses.replace(a.kernel_settings.qkv, SHARED_MIN_BATCH=a.qkv_shared_min_batch)
        a.kernel_settings = dataclasses.replace(a.kernel_settings, qkv=qkv)
        meta["tuned"]["qkv_shared_min_batch"] = a.qkv_shared_min_batch
    meta["kernel_settings"] = a.kernel_settings.to_dict()
    run = Run(out, a.budget, meta)
    if not a.no_smoke:
        s = smoke(a.kernel_settings)
        run.add("smoke", s)
        print("smoke:", "PASS" if s["ok"] else "FAIL", json.dumps({k: {kk: v for kk, v in r.items() if kk != "trace"}
                                                                  for k, r in s["checks"].items()}, default=str), flush=True)
        if a.smoke:
            return 0 if s["ok"] else 1
    bw = copy_bandwidth()
    run.add("bandwidth", bw)
    print(f"copy bandwidth {bw['copy_GBps']:.0f} GB/s", flush=True)
    shapes = {**SHAPES, "tiny": TINY}
    if a.num_layers:  # every figure of the run is then of an N-layer model; the JSON's shape says so
        shapes = {k: {**v, "num_hidden_layers": min(a.num_layers, v["num_hidden_layers"])} for k, v in shapes.items()}
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
