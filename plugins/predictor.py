"""Low-rank predictor + top-k: which neurons / heads to compute for the next token.

    predictor_topk(x[B,D], a[r,D], b[N,r], bias[N], k, *, shared=False, method=None, scoring=None, min_share=None,
                   scales=None) -> idx[B,k] | [k] int32; with min_share (a per-token K): (idx[B,k], n[B] int32)
    predictor_scores_triton(x[1,D], a, b, bias, config=None, scales=None) -> scores[1,N]

scores = (x @ a.T) @ b.T + bias (ARCHITECTURE.md, "Predictor"; h and the scores rounded to x's dtype by
cuBLAS or `predictor_scores_triton` alike). int8 predictors (scales = (a_scale[r], b_scale[N]) fp16, a and b
int8, symmetric per row): scores = ((x @ a.T) * a_scale) @ b.T * b_scale + bias, each scale applied once per
output row before the rounding (the Triton GEMVs read int8 weights; the torch path dequantizes). Then top-k
per row (`shared=False`) or of the batch's max score per column (`shared=True`, one set for the batch; B == 1: the row itself): docs/kernels.md, "API". Neither
top-k returns sorted indices; with a per-token K the n kept rows come first, so fc1 / fc2 stop at n. No
host sync, CUDA-graph capturable. `_topk_kernel`: an exact radix select, deterministic, one launch per
8-bit round plus one to compact, the per-token K's rule in the same launches (docs/kernels.md, "Top-k").
Limits: N <= 65536.
"""
from __future__ import annotations

import math

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import FLOAT_DTYPES, check_tensor, check_weight, helper, jit, next_pow2
from dejavu.plugins.settings import DEFAULT, table

tl = None  # triton.language, bound on first launch (see _common.jit)

TOPK_MAX_N = 65536

_SINGLE, _SPLIT = 0, 1  # _topk_kernel MODE


@helper
def _order_keys(x, KEY_BITS: tl.constexpr):
    # Unsigned keys in the scores' order from their own bits: flip negatives, set the sign
    # bit of positives; -0.0 gets +0.0's key (they tie), NaN (either sign) the largest, as in
    # torch.topk.
    if KEY_BITS == 16:
        u = x.to(tl.uint16, bitcast=True).to(tl.uint32)
        key = tl.where(u == 0x8000, 0x8000, tl.where(u > 0x8000, 0xFFFF - u, u | 0x8000))
        key = tl.where(x != x, 0xFFFF, key)
    else:
        u = x.to(tl.uint32, bitcast=True)
        key = tl.where(u == 0x80000000, 0x80000000, tl.where(u > 0x80000000, 0xFFFFFFFF - u, u | 0x80000000))
        key = tl.where(x != x, 0xFFFFFFFF, key)
    return key


@helper
def _count_digits(slot, digit, cand):
    # slot[0:256] = histogram of this program's candidate digits, by global atomics (tl.histogram into
    # the slot: 11.1 vs 10.6 us for the OPT-30B MLP row, benchmarks/results/kernels-2026-12-02.json)
    tl.store(slot + tl.arange(0, 256), tl.zeros([256], tl.int32))
    tl.debug_barrier()  # the zeros are in place before any thread's add
    tl.atomic_add(slot + digit, 1, mask=cand, sem="relaxed")


@helper
def _row_counts(round_ws, pid, NB, NB_P2: tl.constexpr):
    # (the row's histogram, the histogram of the programs before pid) from the NB slots.
    # L2, not L1: the slots were written by other programs. One reduction for both sums:
    # the programs before pid in the high half; both halves fit 16 bits (N <= 65536) except
    # the whole row in one bin, which only pid 0 can see in its low half (nothing before it).
    blk = tl.arange(0, NB_P2)
    tile = tl.load(round_ws + blk[:, None] * 256 + tl.arange(0, 256)[None, :], mask=(blk < NB)[:, None],
                   other=0, cache_modifier=".cg")
    packed = tl.sum(tile.to(tl.uint32) << (16 * (blk < pid))[:, None].to(tl.uint32), 0)
    hi = tl.where(pid > 0, packed >> 16, 0)
    return (packed - (hi << 16) + hi).to(tl.int32), hi.to(tl.int32)


@helper
def _next_digit(tot, bef, need):
    # The k-th largest candidate's digit d (fewer than `need` candidates above d), how many
    # are still needed among those with digit d, and the before-this-program counts of
    # candidates above d and at d.
    bins = tl.arange(0, 256)
    above_or_at = tl.cumsum(tot, 0, reverse=True)
    d = tl.max(tl.where(above_or_at >= need, bins, -1), 0)
    need -= tl.sum(tl.where(bins > d, tot, 0), 0)
    return d, need, tl.sum(tl.where(bins > d, bef, 0), 0), tl.sum(tl.where(bins == d, bef, 0), 0)


@helper
def _share_kept(sf, part, NB, log_share, NB_P2: tl.constexpr, MODE: tl.constexpr):
    # share_keep's rule; the row's (max, sum exp) from sf (MODE 0) or the NB programs' partials part[NB, 4] (L2)
    if MODE == 0:
        m = tl.max(sf, 0)
        z = tl.sum(tl.exp(sf - m), 0)
    else:
        blk = tl.arange(0, NB_P2)
        pm = tl.load(part + blk * 4, mask=blk < NB, other=float("-inf"), cache_modifier=".cg")
        m = tl.max(pm, 0)
        z = tl.sum(tl.load(part + blk * 4 + 1, mask=blk < NB, other=0.0, cache_modifier=".cg") * tl.exp(pm - m), 0)
    return (sf >= log_share + (m + tl.log(z))) | (sf == m)


def _topk_kernel(s_ptr, out_ptr, ws_ptr, N, K, NB, stride_s, stride_o, nkept_ptr, lse_ptr, log_share,
                 BLOCK: tl.constexpr, NB_P2: tl.constexpr, KEY_BITS: tl.constexpr, MODE: tl.constexpr,
                 FIRST: tl.constexpr, LAST: tl.constexpr, COMPACT: tl.constexpr, KEEP: tl.constexpr = 0):
    # out[row, :K] = indices of the K largest s[row, :N] (unordered); grid (NB, rows).
    # MODE 0: NB == 1, histograms in registers, one launch. MODE 1: rounds FIRST..LAST-1 are counted
    # here into ws[row, round, NB, 256]; earlier rounds were counted by earlier launches and are only
    # read back. KEEP (a per-token K, docs/kernels.md "Top-k"): the rows _share_kept keeps first, their count
    # at nkept[row]; MODE 1: (max, sum exp) at lse[row, pid, :2] in round 0, the kept count at [2] in round 1.
    ROUNDS: tl.constexpr = KEY_BITS // 8
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    sv = tl.load(s_ptr + row * stride_s + offs, mask=mask, other=0.0)
    key = _order_keys(sv, KEY_BITS)
    sf = tl.where(mask, sv.to(tl.float32), float("-inf"))
    if KEEP and MODE == 1 and FIRST == 0:
        m, two = tl.max(sf, 0), tl.arange(0, 2)
        tl.store(lse_ptr + (row * NB + pid) * 4 + two, tl.where(two == 0, m, tl.sum(tl.exp(sf - m), 0)))
    if KEEP and MODE == 1 and FIRST == 1:
        kept = _share_kept(sf, lse_ptr + row * NB * 4, NB, log_share, NB_P2, MODE).to(tl.float32)
        tl.store(lse_ptr + (row * NB + pid) * 4 + 2, tl.sum(kept, 0))
    prefix = tl.full([], 0, tl.uint32)  # the k-th largest key's digits found so far
    need = K  # how many of the candidates (keys matching prefix) are still to be taken
    gt_before = 0  # keys above the k-th largest in the programs before this one
    for r in tl.static_range(ROUNDS):
        if r < LAST:
            shift = KEY_BITS - 8 * (r + 1)
            if r == 0:
                cand = mask
            else:
                cand = mask & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
            digit = ((key >> shift) & 0xFF).to(tl.int32)
            round_ws = ws_ptr + (row * ROUNDS + r) * NB * 256
            if MODE == 0:
                tot = tl.histogram(digit, 256, mask=cand)
                bef = tot * 0
            else:
                if r >= FIRST:
                    _count_digits(round_ws + pid * 256, digit, cand)
                tot, bef = _row_counts(round_ws, pid, NB, NB_P2)
            if MODE == 0 or r < FIRST:
                d, need, gt_add, eq_before = _next_digit(tot, bef, need)
                gt_before += gt_add
                prefix = prefix | (d.to(tl.uint32) << shift)
    if COMPACT:
        # prefix is now the k-th largest key T: take the keys above it and `need` ties at T,
        # lowest index first; eq_before ties at T sit in the programs before this one.
        gt = mask & (key > prefix)
        eq = mask & (key == prefix)
        c = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), 0)  # both counts (BLOCK <= 16384)
        gt_x = (c & 0xFFFF) - gt.to(tl.int32)  # exclusive
        eq_x = (c >> 16) - eq.to(tl.int32)
        ties = tl.maximum(need - eq_before, 0)  # ties this program may still take
        sel = gt | (eq & (eq_x < ties))
        dst = gt_before + tl.minimum(eq_before, need) + gt_x + tl.minimum(eq_x, ties)
        if KEEP:  # n rows of the row kept (all selected when n >= K); kept ones before this one: k_bef + k_x
            kept = _share_kept(sf, lse_ptr + row * NB * 4, NB, log_share, NB_P2, MODE)
            n, k_bef = tl.sum(kept.to(tl.int32), 0), 0
            if MODE == 1:
                blk = tl.arange(0, NB_P2)
                cnt = tl.load(lse_ptr + (row * NB + blk) * 4 + 2, mask=blk < NB, other=0.0,
                              cache_modifier=".cg").to(tl.int32)  # L2: other programs wrote them
                n, k_bef = tl.sum(cnt, 0), tl.sum(tl.where(blk < pid, cnt, 0), 0)
            k_x = tl.cumsum((kept & sel).to(tl.int32), 0) - (kept & sel).to(tl.int32)
            dst = tl.where(n >= K, dst, tl.where(kept, k_bef + k_x, n + dst - k_bef - k_x))
            tl.store(nkept_ptr + row, tl.minimum(n, K), mask=pid == 0)
        tl.store(out_ptr + row * stride_o + dst, offs, mask=sel)


def _topk_plan(scores, config, settings=None):
    """(block, NB, warps, mode) for scores[R, N] under the top-k settings + config."""
    cfg = table((settings or DEFAULT).topk, config)
    block, warps = int(cfg["block"]), int(cfg["warps"])
    if block < 32 or block > 16384 or block & (block - 1) or warps not in (1, 2, 4, 8, 16, 32):
        raise DejavuError(f"topk_triton: block must be a power of 2 in [32, 16384] and warps one of "
                          f"1..32 (got block={block}, warps={warps})")
    N = scores.shape[1]
    if N <= block:
        # one program per row; small rows get fewer warps (a warp per 256 scores at most)
        b = max(32, next_pow2(N))
        return b, 1, max(1, min(warps, b // 256)), _SINGLE
    # each program reads the [NB, 256] histograms of its row: at most 64 ints per thread
    while next_pow2(-(-N // block)) > 8 * warps:
        block *= 2
    return block, -(-N // block), warps, _SPLIT


def topk_triton(scores, k, config=None, settings=None, min_share=None):
    """Indices of the k largest entries of each row of scores[R,N] (N <= 65536): [R,k] int32, exact, ties at
    the k-th value broken by lowest index; with min_share also n[R] int32: the first n[r] of out[r] are the rows
    share_keep keeps (the same launches). `config` overrides settings.topk's fields."""
    check_tensor("scores", scores, ndim=2, dtypes=FLOAT_DTYPES)
    R, N = scores.shape
    if N > TOPK_MAX_N:
        raise DejavuError(f"topk_triton: N={N} > {TOPK_MAX_N}")
    if not isinstance(k, int) or not 0 <= k <= N:
        raise DejavuError(f"topk_triton: k must be an int in [0, {N}], got {k!r}")
    block, nb, warps, mode = _topk_plan(scores, config, settings)
    out = torch.empty((R, k), dtype=torch.int32, device=scores.device)
    nkept = lse = out  # unused without min_share
    if min_share is not None:
        nkept = torch.zeros(R, dtype=torch.int32, device=scores.device)  # k == 0: none
        lse = torch.empty((R, nb, 4), dtype=torch.float32, device=scores.device) if mode == _SPLIT else out
    if k == 0 or R == 0:
        return out if min_share is None else (out, nkept)
    key_bits = 32 if scores.dtype == torch.float32 else 16
    rounds = key_bits // 8
    kernel = jit(_topk_kernel, scores.device)
    ws = out  # unused by a single program per row
    if mode == _SPLIT:
        ws = torch.empty((R, rounds, nb, 256), dtype=torch.int32, device=scores.device)
    log_share = float("-inf") if min_share is None or min_share <= 0 else math.log(min_share)
    args = (scores, out, ws, N, k, nb, scores.stride(0), out.stride(0), nkept, lse, log_share)
    consts = dict(BLOCK=block, NB_P2=next_pow2(nb), KEY_BITS=key_bits, MODE=mode, KEEP=int(min_share is not None),
                  num_warps=warps)
    if mode == _SPLIT:  # one launch per round, then one to compact
        for r in range(rounds):
            kernel[(nb, R)](*args, FIRST=r, LAST=r + 1, COMPACT=False, **consts)
        kernel[(nb, R)](*args, FIRST=rounds, LAST=rounds, COMPACT=True, **consts)
    else:
        kernel[(nb, R)](*args, FIRST=0, LAST=rounds, COMPACT=True, **consts)
    return out if min_share is None else (out, nkept)


def topk_triton_ref(scores, k):
    """Reference of topk_triton: the set it must return, [R,k] int32 (in score order): a stable
    descending sort keeps ties in index order (lowest first), -0.0 == +0.0, NaN ranks first
    (as torch.topk ranks it)."""
    return torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices[:, :k].to(torch.int32)


def _check(x, a, b, bias, k, shared, min_share, scales=None):
    if min_share is not None and shared:
        raise DejavuError("predictor_topk: a per-token K (min_share) needs one index set per sequence")
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    like = x if scales is None else torch.empty(0, dtype=torch.int8, device=x.device)  # int8 rows
    r = check_weight("a", a, x.shape[1], like)
    n = check_weight("b", b, r, like, "rank")
    if scales is not None:
        if not (isinstance(scales, tuple) and len(scales) == 2):
            raise DejavuError("scales: expected (a_scale [r], b_scale [N])")
        check_tensor("a_scale", scales[0], shape=(r,), dtype=torch.float16, device=x.device)
        check_tensor("b_scale", scales[1], shape=(n,), dtype=torch.float16, device=x.device)
    check_tensor("bias", bias, shape=(n,), dtype=x.dtype, device=x.device)
    if not isinstance(k, int) or not 0 <= k <= n:
        raise DejavuError(f"k: expected an int in [0, {n}], got {k!r}")


def predictor_scores(x, a, b, bias, scales=None):
    """scores[B,N] = (x @ a.T) @ b.T + bias; int8 a, b with scales (a_scale[r], b_scale[N]): dequantized first,
    (q * scale) rounded to x's dtype. On a GPU that reads the int8 rows, writes and reads them again in x's dtype
    (about 2.5x the bytes of the int8 rows; the batch-1 route reads int8 only, `predictor_scores_triton`)."""
    if scales is not None:
        a, b = dequantize_rows(a, scales[0], x.dtype), dequantize_rows(b, scales[1], x.dtype)
    return torch.nn.functional.linear(torch.nn.functional.linear(x, a), b, bias)


def dequantize_rows(q, scale, dtype):
    """q [R, C] int8, scale [R] -> q * scale[:, None] in dtype (the product in fp32: exact)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


_IDENT: dict = {}  # device -> (int32 arange, zeros of the input dtypes) grown on demand


def _identity(n, dtype, device):
    """(arange(n) int32, zeros(n) of dtype): the identity index and the zero bias of a dense
    product through gather_gemv. Cached per device; under CUDA-graph capture they must exist
    already (the runtime runs a step eagerly first)."""
    ar, zs = _IDENT.get(device, (None, {}))
    if ar is None or ar.numel() < n or dtype not in zs or zs[dtype].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise DejavuError("predictor_scores_triton: first call inside CUDA-graph capture "
                              "(run one step eagerly first)")
        m = max(n, 0 if ar is None else ar.numel())
        ar = torch.arange(m, dtype=torch.int32, device=device)
        zs = {dt: torch.zeros(m, dtype=dt, device=device) for dt in (*zs, dtype)}
        _IDENT[device] = (ar, zs)
    return ar[:n], zs[dtype][:n]


def predictor_scores_triton(x, a, b, bias, config=None, settings=None, scales=None):
    """scores[1,N] = (x @ a.T) @ b.T + bias by two gather_gemv launches over every row
    (identity index): h[1,r] then the scores, each rounded to x's dtype. Batch 1 (the GEMV
    route; checked inputs). config: {"a": {..}, "b": {..}} overrides settings.scoring's blocks.
    scales (a_scale[r], b_scale[N]): a, b int8, each GEMV's row sums times their row's scale."""
    from dejavu.plugins.fc1 import gather_gemv

    B, r, N = x.shape[0], a.shape[0], b.shape[0]
    if B != 1:
        raise DejavuError(f"predictor_scores_triton: batch 1 only (got {B})")
    ident, zero = _identity(max(r, N), x.dtype, x.device)
    h = torch.empty((B, r), dtype=x.dtype, device=x.device)
    scores = torch.empty((B, N), dtype=x.dtype, device=x.device)
    s = settings or DEFAULT
    cfg = {part: {**vars(getattr(s.scoring, part)), **((config or {}).get(part) or {})} for part in ("a", "b")}
    sa, sb = scales or (None, None)
    gather_gemv(x, a, zero[:r], ident[:r], h, relu=False, config=cfg["a"], kind="pred", settings=s, scale=sa)
    gather_gemv(h, b, bias, ident[:N], scores, relu=False, config=cfg["b"], kind="pred", settings=s, scale=sb)
    return scores


def predictor_topk(x, a, b, bias, k, *, shared=False, method=None, scoring=None, settings=None, min_share=None,
                   scales=None):
    """Indices of the k highest predictor scores: idx[B,k] int32 ([k] when shared). method / scoring
    None: settings.topk.method / settings.scoring.method. min_share (a per-token K, per sequence):
    (idx, n[B] int32): the first n[b] of idx[b] are the rows share_keep keeps (no host sync).
    scales (a_scale[r], b_scale[N]) fp16: a and b are int8 rows (module docstring)."""
    _check(x, a, b, bias, k, shared, min_share, scales)
    s = settings or DEFAULT
    method = method or s.topk.method
    scoring = scoring or s.scoring.method
    if scoring not in ("torch", "triton"):
        raise DejavuError(f"predictor_topk: unknown scoring {scoring!r} (torch, triton)")
    if scoring == "triton" and x.shape[0] == 1:  # batches: cuBLAS (gather_gemv's dot route has no split-K)
        scores = predictor_scores_triton(x, a, b, bias, settings=s, scales=scales)
    else:
        scores = predictor_scores(x, a, b, bias, scales)
    if shared and scores.shape[0] > 1:
        scores = scores.amax(dim=0, keepdim=True)  # [1, N]; with B == 1 the row itself
    if method == "triton":  # with min_share: (idx, n), the count from the same launches
        return topk_triton(scores.contiguous(), k, settings=s, min_share=min_share) if min_share is not None \
            else topk_triton(scores.contiguous(), k, settings=s)[0 if shared else slice(None)]
    if method != "torch":
        raise DejavuError(f"predictor_topk: unknown method {method!r} (torch, triton)")
    idx = torch.topk(scores, k, dim=-1, sorted=min_share is not None).indices.to(torch.int32)  # kept rows first
    n = None if min_share is None else share_keep(scores, idx, min_share).sum(-1, dtype=torch.int32)
    return (idx, n) if min_share is not None else (idx[0] if shared else idx)


def predictor_topk_ref(x, a, b, bias, k, *, shared=False, min_share=None, scales=None):
    """Reference: the same in the caller's dtype (upcast for float64); sorted by score. min_share (a per-token
    K, per sequence only): (idx[B,k], n[B] int32), the first n[b] kept (share_keep). scales: int8 a, b
    dequantized to the caller's dtype."""
    if min_share is not None and shared:
        raise DejavuError("predictor_topk: a per-token K (min_share) needs one index set per sequence")
    if scales is not None:
        a, b = dequantize_rows(a, scales[0], x.dtype), dequantize_rows(b, scales[1], x.dtype)
    scores = (x @ a.T) @ b.T + bias
    idx = torch.topk(scores.amax(dim=0) if shared else scores, k, dim=-1, sorted=True).indices
    idx = idx.to(torch.int32)
    return idx if min_share is None else (idx, share_keep(scores, idx, min_share).sum(-1, dtype=torch.int32))


def share_keep(scores, idx, min_share: float):
    """keep[..., k] bool: the selected rows idx[..., k] (any order) whose share softmax(scores[..., N]) >= min_share,
    in log form as topk_triton (fp32: s >= log min_share + logsumexp(s)), and always the token's best row."""
    s = scores if scores.dtype == torch.float64 else scores.float()
    sk = s.gather(-1, idx.long())  # [..., k]
    log_share = math.log(min_share) if min_share > 0 else -math.inf
    return (sk >= log_share + torch.logsumexp(s, -1, keepdim=True)) | (sk == s.amax(-1, keepdim=True))
