"""One-launch sparse MLP for decode (Triton): fc1 + ReLU + fc2 + bias + residual.

    sparse_mlp_fused(x[B,D], w1[F,D], b1[F], w2_t[F,D], b2[D], idx[B,K]|[K], residual[B,D]|None)
        -> y[B,D] = relu(w1[idx] @ x + b1[idx]) @ w2_t[idx] + b2 (+ residual)

Built for batch 1, where sparse_fc1 + sparse_fc2 pay a fixed cost per kernel (launch, ramp,
tail, the h round trip, the split reduction). A persistent grid (PER_SM programs per SM)
splits the K selected neurons into contiguous ranges, one per program; a program walks its
range BLOCK_R neurons at a time: it loads the neurons' whole w1 rows and w2_t rows at once,
h = relu(w1 rows . x + b1) with x in registers, and acc[D] += h @ w2_t rows, acc in registers
over the whole row. With PREFETCH the next block's rows are loaded before the current block
is used (software pipelining); the row indices are always loaded one block ahead.
A row is held as two power-of-2 pieces (PIECE_A = the largest power of 2 <= D, PIECE_B
covers the rest, masked), so D = 7168 pads to 8192 and D = 9216 is exact (8192 + 1024).
At the end the programs' fp32 partials acc[D] are reduced (REDUCE):
  "atomic":  red.add into a zeroed fp32 [B, D] buffer; the last program to arrive
             (`_common.last_arrival`) adds b2 (+ residual), stores y and zeroes the buffer.
  "barrier": partials to a [P, B, D] workspace, a grid barrier, then every program sums a
             column slice of all partials. Needs every program resident: the grid is capped
             at the SM count times the occupancy of the compiled kernel (CUDA); under the
             interpreter (programs run one after another) it runs with one program.
  "kernel":  partials to [P, B, D], then sparse_mlp's `_split_reduce_kernel` (2 launches).

Limits: D <= 16384 (OPT up to 175B); dtypes fp16/bf16/fp32 (weights in the activation
dtype), fp32 accumulation, h kept in fp32 (not rounded to the activation dtype as
sparse_fc1's output is). idx int32/int64, [B, K] or [K]; B > 1 runs the batch rows one after
another in each program (the weights are read B times: use sparse_fc1/fc2 for batches).
Index values are trusted in the kernel; `validate` checks their range (default: CPU yes, GPU
no). The "atomic" buffer and the counters are per device and reused by every launch on a
stream: two launches must not run at once on two streams, and both must exist before
CUDA-graph capture (run once eagerly first, as the runtime does). "barrier" spins: do not
run it next to another grid-barrier kernel (the fused top-k) on a concurrent stream.
"""
from __future__ import annotations

import torch

from dejavu.errors import DejavuError
from dejavu.plugins._common import (FLOAT_DTYPES, check_index, check_out, check_tensor, counters,
                                    default_validate, helper, jit, last_arrival, next_pow2)
from dejavu.plugins.sparse_mlp import check_mlp_weights, sparse_mlp_layer_ref

tl = None  # triton.language, bound on first launch (see _common.jit)

# Measured on the H200 (2026-12-02, 2026-12-02; BENCHMARKS.md): no config beats sparse_fc1 +
# sparse_fc2 summed over OPT-30B/66B at densities 0.05-0.5 (best 0.692 ms vs the pair's
# 0.685), and REDUCE "atomic" gave wrong sums at the real shapes there (3 of the GPU checks;
# small shapes pass; not found), so CUDA launches refuse it. The runtime keeps the pair
# (SparseDecoder.fused_mlp off); this kernel stays for the benchmark.
FUSED_MLP_CONFIG = {"BLOCK_R": 1, "num_warps": 16, "PREFETCH": True, "PER_SM": 1, "REDUCE": "kernel"}
REDUCE_MODES = {"atomic": 0, "barrier": 1, "kernel": 2}
MAX_D = 16384
DEFAULT_SMS = 132  # H200; the CPU (interpreter) launches use it as the SM count
_SM_COUNT: dict = {}
_ZEROED: dict = {}
_OCCUPANCY: dict = {}


def kernel_settings() -> dict:
    """The config in force, for the engine header's target.kernel_settings."""
    return dict(FUSED_MLP_CONFIG)


# ---------------------------------------------------------------------------------------
# kernel

@helper
def _load_rows(w1_ptr, w2_ptr, b1_ptr, rows, rmask, D, offs_a, offs_b, mask_b):
    # the block's w1 rows, w2_t rows (two pieces each) and b1; masked rows load nothing (0)
    base = rows[:, None] * D
    m_a = rmask[:, None]
    m_b = rmask[:, None] & mask_b[None, :]
    w1a = tl.load(w1_ptr + base + offs_a[None, :], mask=m_a, other=0.0)
    w1b = tl.load(w1_ptr + base + offs_b[None, :], mask=m_b, other=0.0)
    w2a = tl.load(w2_ptr + base + offs_a[None, :], mask=m_a, other=0.0)
    w2b = tl.load(w2_ptr + base + offs_b[None, :], mask=m_b, other=0.0)
    bias = tl.load(b1_ptr + rows, mask=rmask, other=0.0)
    return w1a, w1b, w2a, w2b, bias


@helper
def _grid_barrier(cnt_ptr, n):
    # all n programs (resident) wait here; thread 0's release after bar.sync covers the
    # block's earlier writes. The count is reset after the reduction (see the kernel).
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release")
    seen = tl.atomic_add(cnt_ptr, 0, sem="acquire")
    while seen < n:
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire")
    tl.debug_barrier()


def _fused_mlp_kernel(x_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, idx_ptr, res_ptr, out_ptr,
                      part_ptr, cnt_ptr, B, D, K, stride_ib,
                      HAS_RES: tl.constexpr, REDUCE: tl.constexpr, PREFETCH: tl.constexpr,
                      BLOCK_R: tl.constexpr, PIECE_A: tl.constexpr, PIECE_B: tl.constexpr,
                      RED_P: tl.constexpr, RED_N: tl.constexpr):
    # grid (P,): program pid owns neurons [pid*K//P, (pid+1)*K//P) of every batch row.
    # part: REDUCE 0: the zeroed fp32 [B, D] buffer; else fp32 partials [P, B, D].
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    k_lo = pid * K // n_prog
    k_hi = (pid + 1) * K // n_prog
    offs_a = tl.arange(0, PIECE_A)  # PIECE_A <= D: no mask
    offs_b = PIECE_A + tl.arange(0, PIECE_B)
    mask_b = offs_b < D
    offs_r = tl.arange(0, BLOCK_R)
    for b in range(B):
        x_row = x_ptr + b * D
        xa = tl.load(x_row + offs_a).to(tl.float32)
        xb = tl.load(x_row + offs_b, mask=mask_b, other=0.0).to(tl.float32)
        idx_row = idx_ptr + b * stride_ib
        acc_a = tl.zeros([PIECE_A], dtype=tl.float32)
        acc_b = tl.zeros([PIECE_B], dtype=tl.float32)
        # rows of the block after the current one: the weight loads never wait on an index load
        rmask = k_lo + offs_r < k_hi
        rows = tl.load(idx_row + k_lo + offs_r, mask=rmask, other=0).to(tl.int64)
        rmask_n = k_lo + BLOCK_R + offs_r < k_hi
        rows_n = tl.load(idx_row + k_lo + BLOCK_R + offs_r, mask=rmask_n, other=0).to(tl.int64)
        if PREFETCH:
            w1a, w1b, w2a, w2b, bias = _load_rows(w1_ptr, w2_ptr, b1_ptr, rows, rmask, D,
                                                  offs_a, offs_b, mask_b)
        for k in range(k_lo, k_hi, BLOCK_R):
            if PREFETCH:  # issue the next block's loads before using this block's
                n1a, n1b, n2a, n2b, nbias = _load_rows(w1_ptr, w2_ptr, b1_ptr, rows_n, rmask_n, D,
                                                       offs_a, offs_b, mask_b)
            else:
                w1a, w1b, w2a, w2b, bias = _load_rows(w1_ptr, w2_ptr, b1_ptr, rows, rmask, D,
                                                      offs_a, offs_b, mask_b)
            rmask2 = k + 2 * BLOCK_R + offs_r < k_hi
            rows2 = tl.load(idx_row + k + 2 * BLOCK_R + offs_r, mask=rmask2, other=0).to(tl.int64)
            h = (tl.sum(w1a.to(tl.float32) * xa[None, :], axis=1)
                 + tl.sum(w1b.to(tl.float32) * xb[None, :], axis=1) + bias.to(tl.float32))
            h = tl.maximum(h, 0.0)  # masked rows: w1, b1 and w2 are 0, so they add 0
            acc_a += tl.sum(h[:, None] * w2a.to(tl.float32), axis=0)
            acc_b += tl.sum(h[:, None] * w2b.to(tl.float32), axis=0)
            if PREFETCH:
                w1a, w1b, w2a, w2b, bias = n1a, n1b, n2a, n2b, nbias
            rows, rmask, rows_n, rmask_n = rows_n, rmask_n, rows2, rmask2
        if REDUCE == 0:
            dst = part_ptr + b * D
            tl.atomic_add(dst + offs_a, acc_a, sem="relaxed")
            tl.atomic_add(dst + offs_b, acc_b, mask=mask_b, sem="relaxed")
        else:
            dst = part_ptr + (pid * B + b).to(tl.int64) * D
            tl.store(dst + offs_a, acc_a)
            tl.store(dst + offs_b, acc_b, mask=mask_b)
    N = B * D
    if REDUCE == 0:
        if last_arrival(cnt_ptr, n_prog):  # every program's adds are in the buffer
            for n0 in range(0, N, RED_N):
                offs = n0 + tl.arange(0, RED_N)
                m = offs < N
                y = tl.load(part_ptr + offs, mask=m, other=0.0, cache_modifier=".cg")
                tl.store(part_ptr + offs, tl.zeros([RED_N], dtype=tl.float32), mask=m)
                _store_y(y, offs, m, D, b2_ptr, res_ptr, out_ptr, HAS_RES)
    elif REDUCE == 1:
        _grid_barrier(cnt_ptr, n_prog)
        offs_p = tl.arange(0, RED_P)
        for n0 in range(pid * RED_N, N, n_prog * RED_N):  # a column slice of all partials
            offs = n0 + tl.arange(0, RED_N)
            m = offs < N
            parts = tl.load(part_ptr + offs_p[:, None].to(tl.int64) * N + offs[None, :],
                            mask=(offs_p < n_prog)[:, None] & m[None, :], other=0.0,
                            cache_modifier=".cg")
            _store_y(tl.sum(parts, axis=0), offs, m, D, b2_ptr, res_ptr, out_ptr, HAS_RES)
        if last_arrival(cnt_ptr + 1, n_prog):  # every program has left the barrier's spin
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed")


@helper
def _store_y(y, offs, m, D, b2_ptr, res_ptr, out_ptr, HAS_RES: tl.constexpr):
    # out[n] = y[n] + b2[n % D] (+ residual[n]) over flattened [B, D] positions n
    y += tl.load(b2_ptr + offs % D, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(res_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------------------------
# launcher

def _sm_count(device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def _zeroed_f32(device, n) -> torch.Tensor:
    """n fp32 zeros, per device, for REDUCE "atomic" (the last program zeroes them again)."""
    buf = _ZEROED.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise DejavuError("sparse_mlp_fused: its buffers must be allocated before CUDA-graph "
                              "capture (run one step eagerly first)")
        buf = _ZEROED[device] = torch.zeros(max(1 << 15, next_pow2(n)), dtype=torch.float32,
                                            device=device)
    return buf[:n]


def _resident_per_sm(kernel, args, consts, device) -> int:
    """How many programs of the compiled kernel fit on one SM at once (registers, shared
    memory, warps), from its compiled metadata; cached per (device, constexprs)."""
    key = (device, tuple(sorted(consts.items())))
    if key not in _OCCUPANCY:
        ck = kernel.warmup(*args, grid=(1,), **consts)
        ck._init_handles()
        props = torch.cuda.get_device_properties(device)
        warps = consts["num_warps"]
        regs_warp = -(-max(ck.n_regs, 1) * 32 // 256) * 256
        by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_warp * warps)
        by_warps = props.max_threads_per_multi_processor // (32 * warps)
        smem = ck.metadata.shared
        by_smem = (props.shared_memory_per_multiprocessor // (smem + 1024)) if smem else 32
        _OCCUPANCY[key] = max(0, min(by_regs, by_warps, by_smem, 32))
    return _OCCUPANCY[key]


def fused_mlp(x, w1, b1, w2_t, b2, idx, residual, out, *, config=None):
    """The launch (checked inputs): y = relu(w1[idx] @ x + b1[idx]) @ w2_t[idx] + b2 (+ res)."""
    from dejavu.plugins.sparse_mlp import _split_reduce_kernel

    cfg = {**FUSED_MLP_CONFIG, **(config or {})}
    unknown = set(cfg) - set(FUSED_MLP_CONFIG) - {"PROGRAMS"}
    if unknown or cfg["REDUCE"] not in REDUCE_MODES:
        raise DejavuError(f"sparse_mlp_fused: bad config {config!r} (keys {sorted(FUSED_MLP_CONFIG)}, "
                          f"PROGRAMS; REDUCE one of {sorted(REDUCE_MODES)})")
    B, D = x.shape
    K = idx.shape[-1]
    dev = x.device
    if B == 0:
        return out
    mode = REDUCE_MODES[cfg["REDUCE"]]
    block_r = int(cfg["BLOCK_R"])
    piece_a = 1 << (D.bit_length() - 1)
    piece_b = max(16, next_pow2(D - piece_a))
    n_prog = cfg.get("PROGRAMS") or _sm_count(dev) * int(cfg["PER_SM"])
    n_prog = max(1, min(n_prog, -(-K // block_r)))
    kernel = jit(_fused_mlp_kernel, dev)
    consts = dict(HAS_RES=residual is not None, REDUCE=mode, PREFETCH=bool(cfg["PREFETCH"]),
                  BLOCK_R=block_r, PIECE_A=piece_a, PIECE_B=piece_b, num_warps=int(cfg["num_warps"]))
    res = residual if residual is not None else out  # never read without HAS_RES
    cnt = counters(dev, 2)
    stride_ib = 0 if idx.dim() == 1 else idx.stride(0)
    if mode == 0:
        part = _zeroed_f32(dev, B * D)
        consts.update(RED_P=1, RED_N=min(8192, next_pow2(B * D)))
    else:
        if mode == 1 and dev.type == "cpu":
            n_prog = 1  # the barrier spins, and the interpreter runs programs one after another
        part = torch.empty((n_prog, B, D), dtype=torch.float32, device=dev)
        consts.update(RED_P=next_pow2(n_prog), RED_N=max(16, 8192 // next_pow2(n_prog)))
    if mode == 1 and dev.type == "cuda":  # every program must be resident: cap the grid
        args = (x, w1, b1, w2_t, b2, idx, res, out, part, cnt, B, D, K, stride_ib)
        fit = _resident_per_sm(kernel, args, consts, dev) * _sm_count(dev)
        if fit < 1:
            raise DejavuError("sparse_mlp_fused: REDUCE barrier: the kernel does not fit on an SM")
        if n_prog > fit:  # RED_P stays (>= n_prog): the compiled kernel stays the one measured
            n_prog = fit
            part = part[:n_prog]
    kernel[(n_prog,)](x, w1, b1, w2_t, b2, idx, res, out, part, cnt, B, D, K, stride_ib, **consts)
    if mode == 2:
        block_s = next_pow2(n_prog)
        block = max(16, 8192 // block_s)
        reduce = jit(_split_reduce_kernel, dev)
        reduce[(B, -(-D // block))](part, b2, res, out, out, out, out, B, D, n_prog, 1, HAS_RES=residual is not None,
                                    BLOCK=block, BLOCK_S=block_s, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------
# public API

def sparse_mlp_fused(x, w1, b1, w2_t, b2, idx, residual=None, *, out=None, validate=None, config=None):
    """y[B,D] = relu(w1[idx] @ x + b1[idx]) @ w2_t[idx] + b2 (+ residual) in one launch (two
    with REDUCE "kernel"); x [B,D], w1 and w2_t [F,D], b1 [F], b2 [D], idx [B,K] or [K]."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    B, D = x.shape
    if x.device.type == "cuda" and {**FUSED_MLP_CONFIG, **(config or {})}.get("REDUCE") == "atomic":
        raise DejavuError("sparse_mlp_fused: REDUCE 'atomic' failed its H200 checks at real shapes "
                          "(BENCHMARKS.md); use 'kernel' or 'barrier'")
    if D > MAX_D:
        raise DejavuError(f"sparse_mlp_fused: D={D} > {MAX_D} (use sparse_fc1 + sparse_fc2)")
    F = check_mlp_weights(x, w1, b1, w2_t, b2)
    check_index("idx", idx, batch=B, upper=F, device=x.device,
                validate=default_validate(validate, x.device))
    if residual is not None:
        check_tensor("residual", residual, shape=(B, D), dtype=x.dtype, device=x.device)
    out = check_out(out, (B, D), x.dtype, x.device)
    return fused_mlp(x, w1, b1, w2_t, b2, idx, residual, out, config=config)


# the reference: fc2(relu(fc1(x))) in PyTorch (the same computation as the two-kernel path)
sparse_mlp_fused_ref = sparse_mlp_layer_ref
