"""The kernels on real shapes (OPT-30B / 66B layers; Llama-3 projections for the TEAL GEMV) on a CUDA GPU against float64 references: odd and
real shapes, fp16 / bf16 / fp32, per-sequence and shared indices, a CUDA-graph replay with a device-side
pos, the deferred Q/K/V routes (split, slow path, fold). Skipped without a GPU (the interpreter tests in
this folder cover the small shapes); run on the device in a process of its own, compiled (this folder's conftest
turns the interpreter on unless told otherwise): `TRITON_INTERPRET=0 python -m pytest tests/plugins/test_plugin_real_shapes.py`.
Bounds: max|out - ref| <= 2 * max|same-dtype torch - ref| + atol and a relative-norm bound."""
import dataclasses
import os

import pytest
import torch
import torch.nn.functional as Fn

import dejavu.plugins as P
from dejavu.plugins import DEFAULT

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="real-shape checks need a CUDA GPU"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="real-shape checks run the compiled kernels: TRITON_INTERPRET=0")]
DEV = "cuda"


def randn(*shape, dtype=torch.float16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def rand_idx(B, F, K, shared):
    if shared:
        return torch.randperm(F, device=DEV)[:K].to(torch.int32)
    return torch.stack([torch.randperm(F, device=DEV)[:K] for _ in range(B)]).to(torch.int32)


def _err_ok(out, ref, torch_out, atol, rel):
    err = (out.double() - ref).abs().max().item()
    terr = (torch_out.double() - ref).abs().max().item()
    relnorm = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    ok = bool(torch.isfinite(out).all()) and err <= 2 * terr + atol and relnorm <= rel
    return ok, {"err": err, "torch_err": terr, "relnorm": relnorm}


TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 5e-3), torch.bfloat16: (1e-2, 3e-2)}


def check_mlp(D, F, K, B, dtype, shared, idx_dtype, residual, dot_min_batch=None, ln=False, config=None,
              repeat=1):
    settings = dataclasses.replace(DEFAULT, fc1_dot_min_batch=dot_min_batch or DEFAULT.fc1_dot_min_batch)
    return _check_mlp(D, F, K, B, dtype, shared, idx_dtype, residual, ln, config, repeat, settings)


def _check_mlp(D, F, K, B, dtype, shared, idx_dtype, residual, ln=False, config=None, repeat=1, settings=None):
    """fc1 and fc2 vs float64; `ln`: fc2's LayerNorm output too (vs float64 LayerNorm of the
    kernel's own y); `repeat`: fc2 run that many times back to back without a sync, every result
    bit-equal to the first."""
    if ln:
        return _check_fc2_ln(D, F, K, B, dtype, shared, idx_dtype, residual, config, repeat, settings)
    x = randn(B, D, dtype=dtype)
    w1, b1 = randn(F, D, dtype=dtype, scale=D ** -0.5), randn(F, dtype=dtype)
    w2_t, b2 = randn(F, D, dtype=dtype, scale=K ** -0.5), randn(D, dtype=dtype)
    res = randn(B, D, dtype=dtype) if residual else None
    idx = rand_idx(B, F, K, shared).to(idx_dtype)
    h = torch.full((B, K), float("nan"), dtype=dtype, device=DEV)
    P.sparse_fc1(x, w1, b1, idx, out=h, validate=True, settings=settings)
    h_ref = P.sparse_fc1_ref(x.double(), w1.double(), b1.double(), idx)
    ok1, e1 = _err_ok(h, h_ref, P.sparse_fc1_ref(x, w1, b1, idx), *TOL[dtype])
    y = torch.full((B, D), float("nan"), dtype=dtype, device=DEV)
    P.sparse_fc2(h, w2_t, b2, idx, res, out=y, validate=True, config=config, settings=settings)
    args64 = (h.double(), w2_t.double(), b2.double(), idx, None if res is None else res.double())
    y_ref = P.sparse_fc2_ref(*args64)
    ok2, e2 = _err_ok(y, y_ref, P.sparse_fc2_ref(h, w2_t, b2, idx, res), *TOL[dtype])
    return ok1 and ok2, {"fc1": e1, "fc2": e2}


def _check_fc2_ln(D, F, K, B, dtype, shared, idx_dtype, residual, config, repeat, settings):
    h = randn(B, K, dtype=dtype)
    w2_t, b2 = randn(F, D, dtype=dtype, scale=K ** -0.5), randn(D, dtype=dtype)
    lw, lb = 1.0 + 0.1 * randn(D, dtype=dtype), 0.1 * randn(D, dtype=dtype)
    res = randn(B, D, dtype=dtype) if residual else None
    idx = rand_idx(B, F, K, shared).to(idx_dtype)
    outs = []
    for _ in range(repeat):
        y = torch.full((B, D), float("nan"), dtype=dtype, device=DEV)
        y_ln = torch.full((B, D), float("nan"), dtype=dtype, device=DEV)
        P.sparse_fc2(h, w2_t, b2, idx, res, out=y, ln=(lw, lb), ln_out=y_ln, validate=True, config=config,
                     settings=settings)
        outs.append((y, y_ln))
    y, y_ln = outs[0]
    args64 = (h.double(), w2_t.double(), b2.double(), idx, None if res is None else res.double())
    ok1, e1 = _err_ok(y, P.sparse_fc2_ref(*args64), P.sparse_fc2_ref(h, w2_t, b2, idx, res), *TOL[dtype])
    ln64 = Fn.layer_norm(y.double(), (D,), lw.double(), lb.double(), 1e-5)
    ok2, e2 = _err_ok(y_ln, ln64, Fn.layer_norm(y, (D,), lw, lb, 1e-5), *TOL[dtype])
    same = all(torch.equal(a, y) and torch.equal(b, y_ln) for a, b in outs)
    return ok1 and ok2 and same, {"fc2": e1, "ln": e2, "repeats_equal": same}


def check_compact(D, F, K, B, dtype, keep=False, graph=True):
    """fc1 (keep: a per-token K's count), compact_rows, fc2 over the nonzero rows stopping at their count
    (the decode step's calls, runtime.ops.skips_zero), captured in a CUDA graph and replayed on new inputs
    (graph), vs fc2's float64 reference on the uncompacted (h, idx); the compaction bit-equal to its reference."""
    x, res = randn(B, D, dtype=dtype), randn(B, D, dtype=dtype)
    w1, b1 = randn(F, D, dtype=dtype, scale=D ** -0.5), randn(F, dtype=dtype, scale=0.1)
    w2_t, b2 = randn(F, D, dtype=dtype, scale=K ** -0.5), randn(D, dtype=dtype)
    idx = rand_idx(B, F, K, False)
    n = torch.randint(1, K + 1, (B,), device=DEV, dtype=torch.int32) if keep else None
    y = torch.full((B, D), float("nan"), dtype=dtype, device=DEV)
    bufs = {}

    def step():
        bufs["h"] = P.sparse_fc1(x, w1, b1, idx, n)
        bufs["c"] = P.compact_rows(bufs["h"], idx)
        hc, ic, nz = bufs["c"]
        P.sparse_fc2(hc, w2_t, b2, ic, res, out=y, n_kept=nz)

    step()  # compiles
    if graph:  # capture, then new inputs in place: the replay must follow them (the count read on the device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        x.copy_(randn(B, D, dtype=dtype))
        idx.copy_(rand_idx(B, F, K, False))
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
    h = bufs["h"]
    same = all(torch.equal(a, b) for a, b in zip(bufs["c"], P.compact_rows_ref(h, idx)))
    ok, e = _err_ok(y, P.sparse_fc2_ref(h.double(), w2_t.double(), b2.double(), idx, res.double()),
                    P.sparse_fc2_ref(h, w2_t, b2, idx, res), *TOL[dtype])
    return ok and same, {"fc2": e, "compaction_equal": same, "nonzero": bufs["c"][2].tolist()[:8]}


def check_sliced(N, M, B, dtype, t, graph=True):
    """The TEAL GEMV on a Llama projection's shape (input_sparse: select, the pairs' GEMV, the split-K sum with
    the residual) vs float64, captured in a CUDA graph and replayed on new inputs 20 times back to back: every
    replay's y bit-equal to an eager step's on those inputs."""
    from dejavu.plugins import input_sparse as IS

    x, res = randn(B, N, dtype=dtype), randn(B, M, dtype=dtype)
    w_t = randn(N, M, dtype=dtype, scale=(N / 2) ** -0.5)
    split = IS.split_k_for(B, N, M, DEFAULT.input_sparse)
    y = torch.full((B, M), float("nan"), dtype=dtype, device=DEV)

    def step(out=None):
        return IS.sliced_gemv(*IS.select_slices(x, t, split), w_t, res, out=out)

    step(y)  # compiles
    same, replays = True, 20
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(y)
        for _ in range(replays):
            x.copy_(randn(B, N, dtype=dtype))
            y.fill_(float("nan"))
            g.replay()
            same &= torch.equal(y, step())
        torch.cuda.synchronize()
    h = x * (x.float().abs() > t)
    ok, e = _err_ok(y, h.double() @ w_t.double() + res.double(), h @ w_t + res, *TOL[dtype])
    return ok and same, {"gemv": e, "graph_equal_eager": same, "split": split,
                         "kept": float((x.float().abs() > t).float().mean())}


def check_sliced_add(N, M, B, dtype, t):
    """The fp32 residual stream's TEAL GEMV on a Llama projection's shape (input_sparse.fp32_residual: select,
    then each split adding its fp32 sum into the stream with an atomic) vs float64, captured in a CUDA graph and
    replayed on new inputs 20 times back to back: every replay's stream equal to an eager step's on those inputs
    to fp32 rounding (the splits' adds land in no fixed order)."""
    from dejavu.plugins import input_sparse as IS

    x, base = randn(B, N, dtype=dtype), randn(B, M, dtype=torch.float32)
    w_t = randn(N, M, dtype=dtype, scale=(N / 2) ** -0.5)
    split = IS.split_k_for(B, N, M, DEFAULT.input_sparse)
    acc = base.clone()

    def step(stream):
        return IS.sliced_gemv_add(*IS.select_slices(x, t, split), w_t, stream)

    step(acc)  # compiles
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(acc)
    worst = 0.0
    for _ in range(20):
        x.copy_(randn(B, N, dtype=dtype))
        acc.copy_(base)
        g.replay()
        eager = step(base.clone())
        worst = max(worst, float((acc - eager).abs().max() / eager.abs().max()))
    torch.cuda.synchronize()
    h = x * (x.float().abs() > t)
    ok, e = _err_ok(acc, h.double() @ w_t.double() + base.double(), (h @ w_t).float() + base, *TOL[dtype])
    return ok and worst < 1e-6, {"gemv": e, "graph_vs_eager_rel": worst, "split": split,
                                 "kept": float((x.float().abs() > t).float().mean())}


def check_sliced_qkv(N, H, Hkv, hd, B, dtype, t, T=64, bias=False, norm=False, rot=None):
    """The fused q/k/v TEAL GEMV with RoPE and the cache writes over 20 CUDA-graph replays on new inputs and
    positions: q and both caches bit-equal to an eager step's; q vs float64. bias: q/k/v biases (Qwen2); norm:
    each q and k head's RMSNorm before RoPE (Qwen3); rot: RoPE over a head's first rot dimensions (Phi-4-mini)."""
    from dejavu.plugins import input_sparse as IS

    M = (H + 2 * Hkv) * hd
    x, w_t = randn(B, N, dtype=dtype), randn(N, M, dtype=dtype, scale=(N / 2) ** -0.5)
    r = rot or hd
    ang = torch.rand(B, r // 2, device=DEV) * 6
    pad = torch.ones(B, hd - r, device=DEV), torch.zeros(B, hd - r, device=DEV)  # past the rotary dimensions
    cos = torch.cat((ang.cos(), ang.cos(), pad[0]), -1).to(dtype)
    sin = torch.cat((-ang.sin(), ang.sin(), pad[1]), -1).to(dtype)
    pos = torch.randint(0, T, (B,), device=DEV)
    b = randn(M, dtype=dtype) if bias else None
    qk_norm = (1 + 0.3 * randn(hd, dtype=dtype), 1 + 0.3 * randn(hd, dtype=dtype), 1e-6) if norm else None
    split = IS.split_k_for(B, N, M, DEFAULT.input_sparse)
    caches = {k: [torch.zeros(B, Hkv, T, hd, dtype=dtype, device=DEV) for _ in range(2)] for k in ("graph", "eager")}
    qs = {}

    def step(which):
        qs[which] = IS.sliced_qkv_rope(*IS.select_slices(x, t, split), w_t, cos, sin, pos, *caches[which], bias=b,
                                       qk_norm=qk_norm, rot=rot)
        return qs[which]

    step("graph")  # compiles
    step("eager")  # the same cache writes in both
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step("graph")
    same = True
    for _ in range(20):
        x.copy_(randn(B, N, dtype=dtype))
        pos.copy_(torch.randint(0, T, (B,), device=DEV))
        g.replay()
        step("eager")
        same &= torch.equal(qs["graph"], qs["eager"]) and all(torch.equal(a, b) for a, b in zip(*caches.values()))
    torch.cuda.synchronize()
    h = x * (x.float().abs() > t)
    qkv64, qkvt = h.double() @ w_t.double(), h @ w_t
    if bias:
        qkv64, qkvt = qkv64 + b.double(), qkvt + b
    qkv64, qkvt = qkv64.view(B, -1, hd)[:, :H], qkvt.view(B, -1, hd)[:, :H]
    if norm:
        qkv64 = qkv64 / (qkv64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * qk_norm[0].double()
        qkvt = IS.produce_ref(qkvt, qk_norm[0], 1e-6)

    def mate(v):  # rotate_half's partner over the first r dimensions (sin 0 past them)
        return torch.cat((v[..., :r].roll(r // 2, -1), v[..., r:]), -1)

    q64 = qkv64 * cos.double()[:, None] + mate(qkv64) * sin.double()[:, None]
    qt = qkvt * cos[:, None] + mate(qkvt) * sin[:, None]
    ok, e = _err_ok(qs["graph"], q64, qt, *TOL[dtype])
    return ok and same, {"q": e, "graph_equal_eager": same, "split": split}


def _attn_inputs(B, H, hd, S, dtype):
    D = H * hd
    w = {"wq": randn(D, D, dtype=dtype, scale=D ** -0.5), "bq": randn(D, dtype=dtype, scale=0.1),
         "wkv": randn(2 * D, D, dtype=dtype, scale=D ** -0.5), "bkv": randn(2 * D, dtype=dtype, scale=0.1),
         "wo_t": randn(D, D, dtype=dtype, scale=D ** -0.5), "bo": randn(D, dtype=dtype, scale=0.1)}
    kc, vc = randn(B, H, S, hd, dtype=dtype), randn(B, H, S, hd, dtype=dtype)
    return randn(B, D, dtype=dtype), w, kc, vc


def check_attn(B, H, hd, S, pos, kh, dtype, shared, graph=False, attn=None):
    """sparse_attn_decode vs float64 (output and cache); `graph`: through a captured CUDA graph
    replayed at another pos; `attn`: settings.attn overrides."""
    x, w, kc, vc = _attn_inputs(B, H, hd, S, dtype)
    res = randn(B, H * hd, dtype=dtype)
    hidx = rand_idx(B, H, kh, shared)
    wl = [w[k] for k in ("wq", "bq", "wkv", "bkv", "wo_t", "bo")]
    kc1, vc1 = kc.clone(), vc.clone()
    pos_t = torch.tensor([pos], device=DEV, dtype=torch.int32)
    y = torch.full((B, H * hd), float("nan"), dtype=dtype, device=DEV)
    if graph:  # capture with one pos, replay with another: the kernel must follow pos_t
        pos_t.fill_(1)
        P.sparse_attn_decode(x, *wl, hidx, kc1, vc1, pos_t, res, out=y, config=attn)  # warm up / compile
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            P.sparse_attn_decode(x, *wl, hidx, kc1, vc1, pos_t, res, out=y, config=attn)
        kc1.copy_(kc), vc1.copy_(vc), y.fill_(float("nan"))
        pos_t.fill_(pos)
        g.replay()
    else:
        P.sparse_attn_decode(x, *wl, hidx, kc1, vc1, pos_t, res, out=y, validate=True, config=attn)
    kc2, vc2 = kc.double(), vc.double()
    ref = P.sparse_attn_decode_ref(x.double(), *[t.double() for t in wl], hidx, kc2, vc2, pos_t,
                                   res.double())
    kc3, vc3 = kc.clone(), vc.clone()
    t_out = P.sparse_attn_decode_ref(x, *wl, hidx, kc3, vc3, pos_t, res)
    ok, e = _err_ok(y, ref, t_out, *TOL[dtype])
    cache_err = (kc1.double() - kc2).abs().max().item()
    ok = ok and cache_err <= 2 * (kc3.double() - kc2).abs().max().item() + TOL[dtype][0]
    e["cache_err"] = cache_err
    return ok, e


def _deferred_inputs(B, H, hd, S, pos, kh, dtype, shared, gap):
    """Inputs of sparse_attn_decode_deferred with every head missing up to `gap` slots before pos."""
    x, w, kc, vc = _attn_inputs(B, H, hd, S, dtype)
    hist = randn(B, S, H * hd, dtype=dtype)
    pos_t = torch.full((B,), pos, device=DEV, dtype=torch.int64)
    vl = (pos - torch.randint(0, gap + 1, (B, H), device=DEV)).clamp_min(0).to(torch.int32)
    wl = [w[k] for k in ("wq", "bq", "wkv", "bkv", "wo_t", "bo")]
    return x, wl, kc, vc, hist, vl, pos_t, rand_idx(B, H, kh, shared)


def check_deferred(B, H, hd, S, pos, kh, dtype, shared, gap, config=None, attn=None):
    """Deferred K/V decode (Q/K/V kernel + attention with commit + out-proj) vs float64;
    `config`: settings.qkv overrides (SPLIT, SLOW_Z, ...); `attn`: settings.attn
    overrides."""
    x, wl, kc, vc, hist, vl, pos_t, hidx = _deferred_inputs(B, H, hd, S, pos, kh, dtype, shared, gap)
    res = randn(B, H * hd, dtype=dtype)
    st = [t.clone() for t in (kc, vc, hist, vl)]
    y = torch.full((B, H * hd), float("nan"), dtype=dtype, device=DEV)
    cfg = {k: v for k, v in (("qkv", config), ("attn", attn)) if v}
    P.sparse_attn_decode_deferred(x, *wl, hidx, *st, pos_t, res, out=y, validate=True, config=cfg or None)
    s64 = [kc.double(), vc.double(), hist.double(), vl.clone()]
    ref = P.sparse_attn_decode_deferred_ref(x.double(), *[t.double() for t in wl], hidx, *s64, pos_t, res.double())
    s16 = [t.clone() for t in (kc, vc, hist, vl)]
    t_out = P.sparse_attn_decode_deferred_ref(x, *wl, hidx, *s16, pos_t, res)
    ok, e = _err_ok(y, ref, t_out, *TOL[dtype])
    written = st[0].double() != kc.double()  # slots this call wrote
    e["cache_err"] = (st[0].double() - s64[0]).abs().max().item()
    e["valid_len_equal"] = bool(torch.equal(st[3], s64[3]))
    e["hist_equal"] = bool(torch.equal(st[2].double(), s64[2]))
    e["slots_written"] = int(written.any(-1).sum())
    ok = ok and e["valid_len_equal"] and e["hist_equal"] and \
        e["cache_err"] <= 2 * (s16[0].double() - s64[0]).abs().max().item() + TOL[dtype][0]
    return ok, e


def _check_predictor(B, D, N, r, k, shared, method, dtype, scoring, settings):
    x, a = randn(B, D, dtype=dtype), randn(r, D, dtype=dtype, scale=D ** -0.5)
    b, bias = randn(N, r, dtype=dtype, scale=r ** -0.5), randn(N, dtype=dtype)
    idx = P.predictor_topk(x, a, b, bias, k, shared=shared, method=method, scoring=scoring, settings=settings)
    scores = P.predictor_scores(x.double(), a.double(), b.double(), bias.double())
    if shared:
        scores = scores.amax(0)
    kth = scores.topk(k, dim=-1).values[..., -1:]
    picked = scores.gather(-1, idx.long())
    # the picked set is a top-k set up to rounding at the boundary (h and the scores are
    # rounded to the input dtype: a few of its ulps of the largest score)
    margin = (picked.min(-1, keepdim=True).values - kth).min().item()
    tol = (1e-4 if dtype == torch.float32 else 8 * torch.finfo(dtype).eps) * scores.abs().max().item()
    ok = (margin >= -tol and idx.dtype == torch.int32
          and idx.device.type == DEV
          and all(r.unique().numel() == k for r in idx.reshape(-1, k)))
    return ok, {"margin": margin}


def check_predictor(B, D, N, r, k, shared, method="torch", dtype=torch.float32, scoring=None):
    return _check_predictor(B, D, N, r, k, shared, method, dtype, scoring, DEFAULT)


def cases():
    """(kind, arguments) of every check."""
    cases = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for B, shared in ((1, False), (3, False), (3, True), (8, True), (32, True), (5, False)):
            for idx_dtype in ((torch.int32, torch.int64) if dtype == torch.float16 else (torch.int32,)):
                cases.append(("mlp", dict(D=200, F=1000, K=333, B=B, dtype=dtype, shared=shared,
                                          idx_dtype=idx_dtype, residual=B % 2 == 1)))
    big = True
    for B, shared in ((1, False), (8, True), (8, False))[:3 if big else 0]:
        cases.append(("mlp", dict(D=7168, F=28672, K=2867, B=B, dtype=torch.float16, shared=shared,
                                  idx_dtype=torch.int32, residual=True)))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):  # batch 1 through the dot kernels
        cases.append(("mlp", dict(D=200, F=1000, K=333, B=1, dtype=dtype, shared=False,
                                  idx_dtype=torch.int32, residual=True, dot_min_batch=1)))
    if big:
        cases.append(("mlp", dict(D=7168, F=28672, K=2867, B=1, dtype=torch.float16, shared=False,
                                  idx_dtype=torch.int32, residual=True, dot_min_batch=1)))
        cases.append(("mlp", dict(D=9216, F=36864, K=11059, B=4, dtype=torch.bfloat16, shared=True,
                                  idx_dtype=torch.int64, residual=False)))
    # fc2 over h's nonzero rows (compact_rows): batch 1 (dot kernel) and per-sequence sets (GEMV kernel), fixed K
    # and a per-token K at OPT-30B's MLP 0.1 (top-2K) and OPT-66B's 0.3; odd shapes in every dtype
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for B, keep in ((1, False), (1, True), (3, True)):
            cases.append(("compact", dict(D=200, F=1000, K=333, B=B, dtype=dtype, keep=keep)))
    for (D, F, K), B, keep in ((((7168, 28672, 2867), 1, False), ((7168, 28672, 5734), 1, True),
                                ((9216, 36864, 11059), 1, False), ((7168, 28672, 5734), 4, True)) if big else ()):
        cases.append(("compact", dict(D=D, F=F, K=K, B=B, dtype=torch.float16, keep=keep)))
    # TEAL's input-sparse GEMV at Llama-3-8B's o and down and the 70B TP-8 rank's o (|x| > 0.67: about half
    # kept), gate/up's width, batch 1 and 4, each dtype on an odd shape
    for (N, M), B in (((4096, 4096), 1), ((14336, 4096), 1), ((1024, 8192), 1), ((4096, 28672), 1),
                      ((14336, 4096), 4)):
        cases.append(("sliced", dict(N=N, M=M, B=B, dtype=torch.float16, t=0.67)))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        cases.append(("sliced", dict(N=1000, M=333, B=3, dtype=dtype, t=0.67)))
    # the fp32 residual stream's o and down (Llama-3-8B's, the 70B TP-8 rank's o), batch 1 and 4, an odd shape
    for (N, M), B in (((4096, 4096), 1), ((14336, 4096), 1), ((1024, 8192), 1), ((14336, 4096), 4)):
        cases.append(("sliced_add", dict(N=N, M=M, B=B, dtype=torch.float16, t=0.67)))
    cases.append(("sliced_add", dict(N=1000, M=333, B=3, dtype=torch.bfloat16, t=0.67)))
    # q/k/v with RoPE: Llama-3-8B (32 / 8 heads of 128), the 70B TP-8 rank (8 / 1), heads of 64 at batch 2
    for N, H, Hkv, hd, B in ((4096, 32, 8, 128, 1), (8192, 8, 1, 128, 1), (2048, 16, 4, 64, 2)):
        cases.append(("sliced_qkv", dict(N=N, H=H, Hkv=Hkv, hd=hd, B=B, dtype=torch.float16, t=0.67)))
    # with q/k/v biases: Qwen2-7B (28 / 4 heads of 128), bf16 at batch 3
    cases.append(("sliced_qkv", dict(N=3584, H=28, Hkv=4, hd=128, B=1, dtype=torch.float16, t=0.67, bias=True)))
    cases.append(("sliced_qkv", dict(N=896, H=14, Hkv=2, hd=64, B=3, dtype=torch.bfloat16, t=0.67, bias=True)))
    # with the q and k heads' RMSNorm: Qwen3-8B (32 / 8 heads of 128), bf16 at batch 2
    cases.append(("sliced_qkv", dict(N=4096, H=32, Hkv=8, hd=128, B=1, dtype=torch.float16, t=0.67, norm=True)))
    cases.append(("sliced_qkv", dict(N=4096, H=32, Hkv=8, hd=128, B=2, dtype=torch.bfloat16, t=0.67, norm=True)))
    # RoPE over 96 of a head's 128 dimensions: Phi-4-mini (24 / 8 heads), bf16 at batch 2
    cases.append(("sliced_qkv", dict(N=3072, H=24, Hkv=8, hd=128, B=1, dtype=torch.float16, t=0.67, rot=96)))
    cases.append(("sliced_qkv", dict(N=3072, H=24, Hkv=8, hd=128, B=2, dtype=torch.bfloat16, t=0.67, rot=96)))
    # fc2 + the next LayerNorm (split reduction, then the layer_norm kernel): dot path at B 1 and 8, the
    # GEMV-T path (B 8 per sequence), SPLIT 1, more programs than fit at once; repeats
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for B in (1, 3):
            cases.append(("mlp", dict(D=200, F=1000, K=333, B=B, dtype=dtype, shared=False, idx_dtype=torch.int32,
                                      residual=True, ln=True)))
    if big:
        for B, shared, cfg, rep in ((1, False, None, 20), (8, True, None, 5), (8, False, None, 5),
                                    (1, False, {"SPLIT": 1}, 1), (3, False, {"SPLIT": 1}, 1),
                                    (1, False, {"SPLIT": 64, "BLOCK_D": 64}, 5)):
            cases.append(("mlp", dict(D=7168, F=28672, K=2867, B=B, dtype=torch.float16, shared=shared,
                                      idx_dtype=torch.int32, residual=True, ln=True, config=cfg, repeat=rep)))
        cases.append(("mlp", dict(D=9216, F=36864, K=11059, B=4, dtype=torch.bfloat16, shared=True,
                                  idx_dtype=torch.int64, residual=False, ln=True, repeat=3)))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for B, shared in ((1, False), (3, False), (3, True)):
            cases.append(("attn", dict(B=B, H=6, hd=24, S=90, pos=70, kh=4, dtype=dtype, shared=shared)))
    for B, shared in ((1, False), (4, True), (4, False))[:3 if big else 0]:
        cases.append(("attn", dict(B=B, H=56, hd=128, S=320, pos=300, kh=17, dtype=torch.float16,
                                   shared=shared)))
    cases.append(("attn", dict(B=2, H=56 if big else 6, hd=128 if big else 16, S=320, pos=200,
                               kh=17 if big else 3, dtype=torch.bfloat16, shared=False, graph=big)))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for B, shared, gap in ((1, False, 3), (3, False, 40), (3, True, 0)):
            cases.append(("deferred", dict(B=B, H=6, hd=24, S=90, pos=70, kh=4, dtype=dtype, shared=shared, gap=gap)))
    for B, shared, gap in ((1, False, 3), (1, False, 100), (4, True, 5))[:3 if big else 0]:
        cases.append(("deferred", dict(B=B, H=56, hd=128, S=320, pos=300, kh=17, dtype=torch.float16,
                                       shared=shared, gap=gap)))
    # the Q/K/V finishing kernel on real shapes: many slices of D, SPLIT 1, the slow path (gap 40)
    deep = dict(H=56, hd=128, S=320, pos=300, kh=17, dtype=torch.float16)
    for gap in ((0, 3, 40) if big else ()):
        for cfg in ({}, {"SPLIT": 56}, {"SPLIT": 56, "FINISH_S": 2}, {"SPLIT": 1}):
            cases.append(("deferred", dict(B=1, shared=False, gap=gap, config=cfg, **deep)))
        cases.append(("deferred", dict(B=4, shared=False, gap=gap, config={"SPLIT": 28}, **deep)))
        cases.append(("deferred", dict(B=4, shared=True, gap=gap, config={"SHARED_MIN_BATCH": 2, "SPLIT": 28}, **deep)))
        cases.append(("deferred", dict(B=4, shared=True, gap=gap, config={"SHARED_MIN_BATCH": 2, "SPLIT": 1}, **deep)))
        cases.append(("deferred", dict(B=2, shared=False, gap=gap, config={"SPLIT": 56}, **deep)))
    # the slow path shared out over SLOW_Z programs
    for gap in ((3, 40, 100) if big else ()):
        cases.append(("deferred", dict(B=1, shared=False, gap=gap, config={"SLOW_Z": 4}, **deep)))
    # 2026-12-03: batch 1 with the Q/K/V finish folded into attention (FOLD_FINISH): the partials
    # summed by the attention kernel, longer gaps by the partial kernel's slow z-slices
    fold_shape = deep if big else dict(H=6, hd=24, S=90, pos=70, kh=4, dtype=torch.float16)
    for gap in ((0, 3, 40, 100) if big else (0, 40)):
        for cfg in ({"FOLD_FINISH": True}, {"FOLD_FINISH": True, "FOLD_SLOW_Z": 2, "FOLD_SLOW_R": 32},
                    {"FOLD_FINISH": True, "FOLD_MAX_SPLIT": 4}):
            cases.append(("deferred", dict(B=1, shared=False, gap=gap, config=cfg, **fold_shape)))
        # batch 1's default ("wide"): 6 heads (OPT-30B d0.1: 14 slices, capped to 8, folded)
        cases.append(("deferred", dict(B=1, shared=False, gap=gap, **{**fold_shape, "kh": 6 if big else 2})))
    for dtype in (torch.bfloat16, torch.float32):  # fp32: the DOT_FP32 path; D=144 in 9 slices of 16
        cases.append(("deferred", dict(B=3, H=6, hd=24, S=90, pos=70, kh=4, dtype=dtype, shared=False, gap=40,
                                       config={"BLOCK_D": 16, "SPLIT": 9})))
    for method in ("torch", "triton"):
        for B, shared in ((1, False), (4, False), (4, True)):
            cases.append(("pred", dict(B=B, D=512, N=2000, r=64, k=150, shared=shared, method=method)))
        if big:
            for B, shared, N in ((1, False, 28672), (8, False, 36864), (8, True, 28672), (1, False, 56)):
                cases.append(("pred", dict(B=B, D=1024, N=N, r=128, k=max(1, N // 10), shared=shared,
                                           method=method)))
    # batch 1 scoring by Triton (settings.scoring.method) and cuBLAS, in each dtype; real shapes on the GPU
    for scoring in ("triton", "torch"):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            cases.append(("pred", dict(B=1, D=200, N=1000, r=40, k=300, shared=False, method="triton",
                                       dtype=dtype, scoring=scoring)))
        for (D, N, r), dtype in ((((7168, 28672, 512), torch.float16), ((7168, 56, 56), torch.float16),
                                  ((9216, 36864, 512), torch.bfloat16)) if big else ()):
            cases.append(("pred", dict(B=1, D=D, N=N, r=r, k=max(1, int(0.3 * N)), shared=False, method="triton",
                                       dtype=dtype, scoring=scoring)))
    return cases


CHECKS = {"mlp": check_mlp, "attn": check_attn, "pred": check_predictor, "deferred": check_deferred,
          "compact": check_compact, "sliced": check_sliced, "sliced_add": check_sliced_add,
          "sliced_qkv": check_sliced_qkv}
CASES = cases()


@pytest.mark.parametrize("n", range(len(CASES)), ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_kernel_on_real_shapes_matches_float64(n):
    kind, kw = CASES[n]
    torch.manual_seed(n)
    ok, info = CHECKS[kind](**kw)
    assert ok, (kind, kw, info)
