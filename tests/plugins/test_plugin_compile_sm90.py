"""Every Triton kernel compiles for sm_90 (H200) with Triton's real compiler, on the CPU.

The interpreter tests run kernels as Python, which accepts things the compiler rejects
(e.g. calling a plain Python helper from a kernel). This compiles each kernel, in a
subprocess without TRITON_INTERPRET, for GPUTarget("cuda", 90, 32): no GPU is needed.
"""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import importlib
    import inspect
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
    import dejavu.plugins._common as C
    import dejavu.plugins.deferred_kv as DK
    import dejavu.plugins.fused_mlp as FM
    import dejavu.plugins.predictor as PR
    import dejavu.plugins.sparse_attention as SA
    import dejavu.plugins.sparse_mlp as SM

    INT_PTRS = {"idx_ptr", "head_ptr", "pos_ptr", "vl_ptr"}
    LN_IN = {"st_ptr": "*fp32", "eps": "fp32", "wg_ptr": "*fp32"}
    F32_PTRS = {"part_ptr", "ml_ptr", "q_ptr", "o_ptr", "s_ptr"}

    def compile_sm90(mod, fn, constexprs, dtype="fp16", overrides=None, num_stages=None, div16=()):
        # tl and the @helper device functions, in mod and in the modules of helpers it imports
        # (_common's last_arrival, sparse_mlp's LayerNorm merge), as _common.jit binds them
        C.tl = tl
        C._bind_helpers(vars(mod), triton)
        sig = {}
        params = inspect.signature(fn).parameters
        # constexprs with defaults (GDC, PF: the PDL form) compile at their defaults unless given
        constexprs = {**{n: p.default for n, p in params.items() if p.default is not p.empty}, **constexprs}
        constexprs = {n: v for n, v in constexprs.items() if n not in (overrides or {})}  # typed arguments
        for name in params:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = "*i32" if name in INT_PTRS else "*fp32" if name in F32_PTRS else "*" + dtype
            else:
                sig[name] = "i32"
        sig.update(overrides or {})
        # div16: pointers and these integer arguments marked divisible by 16, as the launcher's
        # specialisation marks them on the GPU (vectorised loads, cp.async; without it neither)
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(params)
                 if div16 and (sig[name].startswith("*") or name in div16)}
        src = ASTSource(JITFunction(fn), signature=sig, constexprs=constexprs, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_stages": num_stages} if num_stages else {})
        assert "cubin" in k.asm
        print("compiled", fn.__name__, constexprs)
        return k

    for dt in ("fp16",):  # bf16 differs only in the element type
        for group in (1, 128):
            compile_sm90(SM, SM._gather_gemv_kernel, dict(RELU=True, BLOCK_R=4, BLOCK_D=1024, EVEN_D=True,
                                                          GROUP=group), dt, overrides=LN_IN)
        # the weight streams' eviction hint (fc1 / predictors, fc2 / projection, Q/K/V): in the PTX only when asked
        for ev in ("evict_first", ""):
            k = compile_sm90(SM, SM._gather_gemv_kernel, dict(RELU=True, BLOCK_R=2, BLOCK_D=1024, EVEN_D=True,
                                                              GROUP=1, W_EV=ev), dt, overrides=LN_IN)
            assert ("L1::evict_first" in k.asm["ptx"]) == bool(ev), ev
            k = compile_sm90(SM, SM._gather_dot_t_kernel, dict(DOT_FP32=False, BLOCK_K=64, BLOCK_B=16, BLOCK_D=128,
                                                               EVEN_D=True, BLOCK_S=4, FINAL=False, HAS_RES=True,
                                                               FUSED=False, LN=False, BLOCK_N=128, LN_BLOCK=2048,
                                                               GROUP=1, W_EV=ev),
                             dt, overrides={"cnt_ptr": "*i32", "st_ptr": "*fp32", "eps": "fp32"})
            assert ("L1::evict_first" in k.asm["ptx"]) == bool(ev), ev
            k = compile_sm90(DK, DK._qkv_partial_shared_kernel, dict(HAS_NEW=True, FIRST_SEG=0, DOT_FP32=False,
                                                                     FINISH=0, P=16, BLOCK_M=16, BLOCK_P=16, BLOCK_R=64,
                                                                     BLOCK_D=128, BLOCK_S=1, EVEN_D=True, W_EV=ev),
                             dt, overrides={"pnew_ptr": "*fp32", "phist_ptr": "*fp32", "cnt_ptr": "*i32"})
            assert ("L1::evict_first" in k.asm["ptx"]) == bool(ev), ev
        for even in (True, False):  # fc1 normalising its input (a PendingLN), or with the LayerNorm folded in
            for mode in (1, 2, 3):
                compile_sm90(SM, SM._gather_gemv_kernel, dict(RELU=True, BLOCK_R=2, BLOCK_D=1024, EVEN_D=even,
                                                              GROUP=1, LN_IN=mode, BLOCK_N=32), dt, overrides=LN_IN)
        compile_sm90(SM, SM._gather_dot_kernel, dict(RELU=True, DOT_FP32=False, BLOCK_R=32, BLOCK_B=16,
                                                     BLOCK_D=128, EVEN_D=False, GROUP=1), dt)
        # fc2 / out-proj: split-K with the separate reduction, fused finish (+ LayerNorm), one split + LayerNorm
        for final, fused, ln, group in ((False, False, False, 1), (False, True, False, 128), (False, True, True, 1),
                                        (True, True, True, 128), (True, False, False, 1)):
            fin = dict(FINAL=final, HAS_RES=True, FUSED=fused, LN=ln, BLOCK_N=128, LN_BLOCK=2048, GROUP=group)
            compile_sm90(SM, SM._gather_gemv_t_kernel, dict(BLOCK_K=16, BLOCK_D=256, EVEN_D=True, BLOCK_S=16, **fin),
                         dt, overrides={"cnt_ptr": "*i32", "st_ptr": "*fp32", "eps": "fp32"})
            compile_sm90(SM, SM._gather_dot_t_kernel, dict(DOT_FP32=False, BLOCK_K=128, BLOCK_B=16, BLOCK_D=64,
                                                           EVEN_D=False, BLOCK_S=4, **fin),
                         dt, overrides={"cnt_ptr": "*i32", "st_ptr": "*fp32", "eps": "fp32"})
        # the attention output projection combining the chunks' partials (ATTN FOLD_COMBINE)
        compile_sm90(SM, SM._gather_dot_t_kernel, dict(DOT_FP32=False, BLOCK_K=64, BLOCK_B=16, BLOCK_D=128,
                                                       EVEN_D=True, BLOCK_S=4, FINAL=False, HAS_RES=True, FUSED=False,
                                                       LN=False, BLOCK_N=128, LN_BLOCK=2048, GROUP=128, COMBINE=True,
                                                       BLOCK_C=16),
                     dt, overrides={"cnt_ptr": "*i32", "st_ptr": "*fp32", "eps": "fp32", "apart_ptr": "*fp32",
                                    "h_ptr": "*fp32"})
    for stats in (0, 1, 2):  # 2: and the centred product z (PendingLN.z)
        compile_sm90(SM, SM._split_reduce_kernel, dict(HAS_RES=True, BLOCK=1024, BLOCK_S=4, STATS=stats),
                     overrides={"part_ptr": "*fp32", "st_ptr": "*fp32"})
    compile_sm90(SM, SM._split_reduce_ln_kernel, dict(HAS_RES=True, BLOCK_D=256, BLOCK_S=16, BLOCK_N=32,
                                                      LN_BLOCK=8192),
                 overrides={"part_ptr": "*fp32", "cnt_ptr": "*i32", "st_ptr": "*fp32", "eps": "fp32"})
    for dt, red, pre in (("fp16", 0, True), ("fp16", 0, False), ("fp16", 1, True), ("fp16", 1, False),
                         ("fp16", 2, True), ("bf16", 0, False), ("fp32", 1, True)):  # every fused MLP variant
        compile_sm90(FM, FM._fused_mlp_kernel, dict(HAS_RES=red != 1, REDUCE=red, PREFETCH=pre, BLOCK_R=2,
                                                    PIECE_A=8192, PIECE_B=1024, RED_P=256 if red else 1,
                                                    RED_N=32 if red else 8192),
                     dt, overrides={"cnt_ptr": "*i32"})
    for commit in (0, 1, 2):  # 2: valid_len only (the Q/K/V kernel stored the history slot)
        compile_sm90(SA, SA._attn_decode_kernel, dict(PARTIAL=commit > 0, COMMIT=commit, BLOCK_S=64, BLOCK_HD=128,
                                                      BLOCK_X=1024), overrides={"cnt_ptr": "*i32"})
    for even in (True, False):  # the shared-set Q/K/V kernel normalising its input (a PendingLN)
        for b in (16, 64):  # batch 1 (P 16), or batch 4 with P 16
            compile_sm90(DK, DK._qkv_partial_shared_kernel,
                         dict(HAS_NEW=True, FIRST_SEG=0, DOT_FP32=False, FINISH=0, P=16, BLOCK_M=b, BLOCK_P=16,
                              BLOCK_R=64, BLOCK_D=128, BLOCK_S=1, EVEN_D=even, LN_IN=1, BLOCK_N=8),
                         overrides={"pnew_ptr": "*fp32", "phist_ptr": "*fp32", "cnt_ptr": "*i32",
                                    "st_ptr": "*fp32", "eps": "fp32"})
    # LAST_COMBINE: the last chunk program of each head combines (no combine launch)
    compile_sm90(SA, SA._attn_decode_kernel, dict(PARTIAL=True, COMMIT=True, BLOCK_S=32, BLOCK_HD=128,
                                                  BLOCK_X=8192, LAST_COMBINE=True, BLOCK_C=8),
                 overrides={"cnt_ptr": "*i32"})
    for dt, f32 in (("fp16", False), ("bf16", False), ("fp32", True)):
        for new, first in ((True, 0), (False, 1)):
            # FINISH 0: partials only (two launches); 1: last_arrival finish; 2: SPLIT 1 (fp16 only)
            for fin in (0, 1, 2) if dt == "fp16" else (1,):
                qkv_ptrs = {"pnew_ptr": "*fp32", "phist_ptr": "*fp32", "cnt_ptr": "*i32"}
                compile_sm90(DK, DK._qkv_partial_kernel, dict(HAS_NEW=new, FIRST_SEG=first, DOT_FP32=f32, FINISH=fin,
                                                              BLOCK_P=16, BLOCK_R=32, BLOCK_D=256, BLOCK_S=8,
                                                              EVEN_D=new), dt, overrides=qkv_ptrs)
                compile_sm90(DK, DK._qkv_partial_shared_kernel, dict(HAS_NEW=new, FIRST_SEG=first, DOT_FP32=f32,
                                                                     FINISH=fin, P=4, BLOCK_M=32, BLOCK_P=16,
                                                                     BLOCK_R=32, BLOCK_D=128, BLOCK_S=8, EVEN_D=new),
                             dt, overrides=qkv_ptrs)
            for z in (1, 4):  # SLOW_Z 4: the slow path shared out over 4 programs
                compile_sm90(DK, DK._qkv_finish_kernel, dict(FIRST_SEG=first, DOT_FP32=f32, BLOCK_P=16, BLOCK_R=32,
                                                             BLOCK_D=128, BLOCK_S=8, SLOW_Z=z), dt,
                             overrides={"pnew_ptr": "*fp32", "phist_ptr": "*fp32"})
    # the slots past the partials caught up ahead (catch_up_kv): the kernel, and the Q/K/V kernels
    # that then skip their slow path
    for dt, f32 in (("fp16", False), ("fp32", True)):
        compile_sm90(DK, DK._catch_up_kernel, dict(DOT_FP32=f32, BLOCK_P=16, BLOCK_R=16, BLOCK_D=128), dt)
    qkv_ptrs = {"pnew_ptr": "*fp32", "phist_ptr": "*fp32", "cnt_ptr": "*i32"}
    for caught in (False, True):  # caught up: no slow path, so no tensor-core dot left in the finishing kernel
        k = compile_sm90(DK, DK._qkv_finish_kernel, dict(FIRST_SEG=0, DOT_FP32=False, BLOCK_P=16, BLOCK_R=16,
                                                         BLOCK_D=128, BLOCK_S=1, CAUGHT_UP=caught),
                         overrides={"pnew_ptr": "*fp32", "phist_ptr": "*fp32"})
        assert ("mma" in k.asm["ptx"]) != caught
    for fin in (1, 2):
        compile_sm90(DK, DK._qkv_partial_kernel, dict(HAS_NEW=True, FIRST_SEG=0, DOT_FP32=False, FINISH=fin,
                                                      BLOCK_P=16, BLOCK_R=32, BLOCK_D=256, BLOCK_S=8, EVEN_D=True,
                                                      CAUGHT_UP=True), overrides=qkv_ptrs)
        compile_sm90(DK, DK._qkv_partial_shared_kernel, dict(HAS_NEW=True, FIRST_SEG=0, DOT_FP32=False, FINISH=fin,
                                                             P=4, BLOCK_M=32, BLOCK_P=16, BLOCK_R=32, BLOCK_D=128,
                                                             BLOCK_S=8, EVEN_D=True, CAUGHT_UP=True),
                     overrides=qkv_ptrs)
    # the input's LayerNorm chunks loaded a D chunk ahead (LN_AHEAD 1: x_new; 2: with the weight and bias)
    for ahead in (1, 2):
        compile_sm90(DK, DK._qkv_partial_shared_kernel, dict(HAS_NEW=True, FIRST_SEG=0, DOT_FP32=False, FINISH=0, P=32,
                                                             BLOCK_M=32, BLOCK_P=32, BLOCK_R=64, BLOCK_D=128,
                                                             BLOCK_S=1, EVEN_D=True, LN_IN=1, LN_AHEAD=ahead, GDC=1),
                     overrides={**qkv_ptrs, "st_ptr": "*fp32", "eps": "fp32"})
    # refresh heads (batch 1): head slots past KH_Q read from ref_ptr, K/V only; their valid_len committed by
    # the attention kernel; the pick itself
    ref = {"ref_ptr": "*i32", "KH_Q": "i32"}
    for gdc in (0, 1):
        compile_sm90(DK, DK._qkv_partial_shared_kernel, dict(HAS_NEW=True, FIRST_SEG=0, DOT_FP32=False, FINISH=0, P=16,
                                                             BLOCK_M=16, BLOCK_P=16, BLOCK_R=64, BLOCK_D=128,
                                                             BLOCK_S=1, EVEN_D=True, LN_IN=1, REFRESH=1, GDC=gdc),
                     overrides={**qkv_ptrs, "st_ptr": "*fp32", "eps": "fp32", **ref})
        compile_sm90(DK, DK._qkv_finish_kernel, dict(FIRST_SEG=0, DOT_FP32=False, BLOCK_P=16, BLOCK_R=16, BLOCK_D=128,
                                                     BLOCK_S=1, EARLY_READS=True, REFRESH=1, GDC=gdc),
                     overrides={"pnew_ptr": "*fp32", "phist_ptr": "*fp32", **ref})
    # the wide tile (batch 1's default: a branch per program between M = 16 and M = P_WIDE), with and
    # without refresh heads; the finishing kernel then reads P_WIDE - 1 slots of phist (BLOCK_P 32)
    # (WIDE_ALL: one branch for the launch, on the most missing slots of its selected heads; EARLY_READS: the
    # rows and lags read before the PDL wait)
    for refresh, wide_all, early in ((0, 0, 0), (1, 0, 1), (0, 1, 1), (1, 1, 0)):
        compile_sm90(DK, DK._qkv_partial_shared_kernel, dict(HAS_NEW=True, FIRST_SEG=0, DOT_FP32=False, FINISH=0,
                                                             P=16, BLOCK_M=16, BLOCK_P=32, BLOCK_R=64, BLOCK_D=128,
                                                             BLOCK_S=1, EVEN_D=True, LN_IN=1, REFRESH=refresh,
                                                             P_WIDE=32, WIDE_ALL=wide_all, BLOCK_KH=32,
                                                             EARLY_READS=early, GDC=1),
                     overrides={**qkv_ptrs, "st_ptr": "*fp32", "eps": "fp32", **(ref if refresh else {})})
    compile_sm90(DK, DK._qkv_finish_kernel, dict(FIRST_SEG=0, DOT_FP32=False, BLOCK_P=32, BLOCK_R=16, BLOCK_D=128,
                                                 BLOCK_S=1, EARLY_READS=True, GDC=1),
                 overrides={"pnew_ptr": "*fp32", "phist_ptr": "*fp32"})
    # batch 1's unfolded route by default (SHARED_P_UNFOLDED): every program's dot over 31 missing slots (and with
    # its rows read before the PDL wait: PARTIAL_EARLY_READS)
    for early in (0, 1):
        compile_sm90(DK, DK._qkv_partial_shared_kernel, dict(HAS_NEW=True, FIRST_SEG=0, DOT_FP32=False, FINISH=0,
                                                             P=32, BLOCK_M=32, BLOCK_P=32, BLOCK_R=64, BLOCK_D=128,
                                                             BLOCK_S=1, EVEN_D=True, LN_IN=1, EARLY_READS=early, GDC=1),
                     overrides={**qkv_ptrs, "st_ptr": "*fp32", "eps": "fp32"})
    compile_sm90(SA, SA._attn_decode_kernel, dict(PARTIAL=True, COMMIT=2, BLOCK_S=32, BLOCK_HD=128, BLOCK_X=16,
                                                  BLOCK_REF=16), overrides={"ref_ptr": "*i32", "N_REF": "i32"})
    compile_sm90(DK, DK._refresh_kernel, dict(R=4, BLOCK_H=64, BLOCK_K=32), overrides={"out_ptr": "*i32"})
    compile_sm90(DK, DK._commit_kernel, dict(HAS_NEW=True, BLOCK_K=16, BLOCK_D=1024))
    compile_sm90(SA, SA._attn_combine_kernel, dict(BLOCK_C=8, BLOCK_HD=128))
    compile_sm90(PR, PR._topk_kernel, dict(BLOCK=1024, NB_P2=32, KEY_BITS=16, MODE=PR._FUSED, FIRST=0, LAST=2,
                                           COMPACT=True, ATOMIC_HIST=True),
                 overrides={"out_ptr": "*i32", "ws_ptr": "*i32", "bar_ptr": "*i32", "s_ptr": "*fp16"})
    LN = importlib.import_module("dejavu.plugins.layer_norm")  # the attribute is the function
    for dt in ("fp16", "bf16"):
        compile_sm90(LN, LN._layer_norm_kernel, dict(CHUNKED=False, BLOCK=8192), dt, {"eps": "fp32"})
        compile_sm90(LN, LN._layer_norm_kernel, dict(CHUNKED=True, BLOCK=4096), dt, {"eps": "fp32"})
    PF = importlib.import_module("dejavu.plugins.prefetch")
    for ev in ("evict_last", ""):  # the L2 hint is in the PTX only when asked for
        k = compile_sm90(PF, PF._prefetch_rows_kernel, dict(GROUP=128, BLOCK_R=4, BLOCK_D=1024, EVICT=ev),
                         "fp16", {"out_ptr": "*fp32"})
        assert ("L2::evict_last" in k.asm["ptx"]) == (ev == "evict_last"), ev
    # PDL (_common.pdl_args): every kernel launched with launch_pdl waits (griddepcontrol.wait)
    # and releases the next one; the weight kernels prefetch their first tile into L2 before it
    f2 = {"cnt_ptr": "*i32", "st_ptr": "*fp32", "eps": "fp32"}
    qkv_ptrs = {"pnew_ptr": "*fp32", "phist_ptr": "*fp32", "cnt_ptr": "*i32"}
    fin = dict(FINAL=False, HAS_RES=True, FUSED=False, LN=False, BLOCK_N=128, LN_BLOCK=2048, GROUP=128)
    cases = [
        (SM, SM._gather_gemv_kernel, dict(RELU=True, BLOCK_R=2, BLOCK_D=1024, EVEN_D=True, GROUP=1), LN_IN, True),
        (SM, SM._gather_gemv_kernel, dict(RELU=True, BLOCK_R=2, BLOCK_D=1024, EVEN_D=True, GROUP=1, LN_IN=1,
                                          BLOCK_N=32), LN_IN, True),
        (SM, SM._gather_gemv_kernel, dict(RELU=True, BLOCK_R=2, BLOCK_D=1024, EVEN_D=True, GROUP=1, LN_IN=2,
                                          BLOCK_N=32), LN_IN, True),
        (SM, SM._gather_dot_kernel, dict(RELU=True, DOT_FP32=False, BLOCK_R=64, BLOCK_B=16, BLOCK_D=128,
                                         EVEN_D=True, GROUP=1), {}, True),
        (SM, SM._gather_gemv_t_kernel, dict(BLOCK_K=16, BLOCK_D=256, EVEN_D=True, BLOCK_S=16, **fin), f2, True),
        (SM, SM._gather_dot_t_kernel, dict(DOT_FP32=False, BLOCK_K=64, BLOCK_B=16, BLOCK_D=128, EVEN_D=True,
                                           BLOCK_S=4, **fin), f2, True),
        (SM, SM._split_reduce_kernel, dict(HAS_RES=True, BLOCK=1024, BLOCK_S=4), {"st_ptr": "*fp32"}, False),
        (SM, SM._split_reduce_kernel, dict(HAS_RES=True, BLOCK=1024, BLOCK_S=4, STATS=True),
         {"part_ptr": "*fp32", "st_ptr": "*fp32"}, False),
        (SM, SM._split_reduce_ln_kernel, dict(HAS_RES=True, BLOCK_D=256, BLOCK_S=16, BLOCK_N=32, LN_BLOCK=8192),
         {"part_ptr": "*fp32", "cnt_ptr": "*i32", "st_ptr": "*fp32", "eps": "fp32"}, False),
        (DK, DK._qkv_partial_kernel, dict(HAS_NEW=True, FIRST_SEG=0, DOT_FP32=False, FINISH=0, BLOCK_P=16,
                                          BLOCK_R=32, BLOCK_D=128, BLOCK_S=8, EVEN_D=True), qkv_ptrs, True),
        (DK, DK._qkv_partial_shared_kernel, dict(HAS_NEW=True, FIRST_SEG=0, DOT_FP32=False, FINISH=0, P=16,
                                                 BLOCK_M=16, BLOCK_P=16, BLOCK_R=64, BLOCK_D=128, BLOCK_S=1,
                                                 EVEN_D=True), qkv_ptrs, True),
        (DK, DK._qkv_finish_kernel, dict(FIRST_SEG=0, DOT_FP32=False, BLOCK_P=16, BLOCK_R=16, BLOCK_D=128,
                                         BLOCK_S=1), {"pnew_ptr": "*fp32", "phist_ptr": "*fp32"}, False),
        (DK, DK._qkv_finish_kernel, dict(FIRST_SEG=0, DOT_FP32=False, BLOCK_P=16, BLOCK_R=16, BLOCK_D=128,
                                         BLOCK_S=1, EARLY_READS=True), {"pnew_ptr": "*fp32", "phist_ptr": "*fp32"},
         False),
        (DK, DK._commit_kernel, dict(HAS_NEW=True, BLOCK_K=16, BLOCK_D=1024), {}, False),
        (SA, SA._attn_decode_kernel, dict(PARTIAL=True, COMMIT=True, BLOCK_S=32, BLOCK_HD=128, BLOCK_X=8192),
         {"cnt_ptr": "*i32"}, False),
        (SA, SA._attn_decode_kernel, dict(PARTIAL=True, COMMIT=True, BLOCK_S=32, BLOCK_HD=128, BLOCK_X=8192,
                                          LAST_COMBINE=True, BLOCK_C=8), {"cnt_ptr": "*i32"}, False),
        (SA, SA._attn_decode_kernel, dict(PARTIAL=True, COMMIT=True, BLOCK_S=32, BLOCK_HD=128, BLOCK_X=8192,
                                          EARLY_READS=True), {"cnt_ptr": "*i32"}, False),
        # the cache tiles' stable slots loaded before the wait (EARLY_KV), deferred (COMMIT 2) and full (0)
        (SA, SA._attn_decode_kernel, dict(PARTIAL=True, COMMIT=2, BLOCK_S=32, BLOCK_HD=128, BLOCK_X=16,
                                          EARLY_READS=True, EARLY_KV=True), {"cnt_ptr": "*i32"}, False),
        (SA, SA._attn_decode_kernel, dict(PARTIAL=True, COMMIT=0, BLOCK_S=32, BLOCK_HD=128, BLOCK_X=16,
                                          EARLY_READS=True, EARLY_KV=True), {"cnt_ptr": "*i32"}, False),
        (SA, SA._attn_combine_kernel, dict(BLOCK_C=8, BLOCK_HD=128), {}, False),
        (SA, SA._attn_combine_kernel, dict(BLOCK_C=8, BLOCK_HD=128, COMMIT=True, BLOCK_REF=16),
         {"ref_ptr": "*i32", "N_REF": "i32"},
         False),
        (LN, LN._layer_norm_kernel, dict(CHUNKED=False, BLOCK=8192), {"eps": "fp32"}, False),
        (LN, LN._layer_norm_kernel, dict(CHUNKED=False, BLOCK=8192, EARLY_W=True), {"eps": "fp32"}, False),
    ]
    # a Q/K/V block narrower than a cache line (one prefetch per row)
    cases.append((DK, DK._qkv_partial_kernel, dict(HAS_NEW=True, FIRST_SEG=0, DOT_FP32=False, FINISH=0, BLOCK_P=16,
                                                   BLOCK_R=16, BLOCK_D=16, BLOCK_S=8, EVEN_D=False), qkv_ptrs, True))
    for mod, fn, consts, over, looped in cases:  # looped: a main loop over weights (prefetch, gdc_release)
        for gdc in (1, 2):  # late / early trigger
            ptx = compile_sm90(mod, fn, {**consts, "GDC": gdc, "PF": 1}, "fp16", over).asm["ptx"]
            wait = ptx.index("griddepcontrol.wait")
            # before the wait: no store, and no load but the index reads of the prefetch
            assert "st.global" not in ptx[:wait], fn.__name__
            assert ("prefetch.global.L2" in ptx[:wait]) == looped, fn.__name__
            if not looped:  # loads before the wait only with EARLY_W (LayerNorm) / EARLY_READS
                early = bool(consts.get("EARLY_W") or consts.get("EARLY_READS"))
                assert ("ld.global" in ptx[:wait]) == early, fn.__name__
            if gdc == 2 or looped:  # the next kernel is let in only after the wait
                assert ptx.index("griddepcontrol.launch_dependents") > wait, fn.__name__
            else:  # late trigger without a main loop: at exit
                assert "griddepcontrol.launch_dependents" not in ptx, fn.__name__
        plain = compile_sm90(mod, fn, consts, "fp16", over).asm["ptx"]
        assert "griddepcontrol" not in plain and "prefetch.global.L2 " not in plain, fn.__name__
    # batch 1: attention and output projection in one launch (COMMIT 0/1/2, tl.dot or a sum, fp16 /
    # fp32); with PDL the weight rows' L2 prefetch (and the head / pos reads) before the wait, no
    # store before it, the next kernel let in after it
    for commit in (0, 1, 2):
        for dot in (True, False):
            for dt, f32 in (("fp16", False), ("fp32", True)):
                consts = dict(COMMIT=commit, BLOCK_S=32, BLOCK_HD=128, BLOCK_D=64, DOT=dot, DOT_FP32=f32,
                              BLOCK_X=8192 if commit == 1 else 16, PF_L2=True)
                compile_sm90(SA, SA._attn_proj_kernel, consts, dt)
    for gdc in (1, 2):
        ptx = compile_sm90(SA, SA._attn_proj_kernel, {**consts, "DOT_FP32": False, "GDC": gdc}).asm["ptx"]
        wait = ptx.index("griddepcontrol.wait")
        assert "st.global" not in ptx[:wait] and "prefetch.global.L2" in ptx[:wait]
        assert ptx.index("griddepcontrol.launch_dependents") > wait
    # the Q/K/V finish folded into attention (batch 1, QKV_CONFIG_B1 FOLD_FINISH): the partial
    # kernel's slow-path z-slices, the attention kernel summing the partials, the combine kernel
    # committing valid_len; with PDL no store before a wait (the slow path waits on its own branch)
    fold_ptrs = {**qkv_ptrs, "st_ptr": "*fp32", "eps": "fp32"}
    for gdc in (0, 1):
        for slow_r, last in ((16, False), (64, False), (16, True)):
            ptx = compile_sm90(DK, DK._qkv_partial_shared_kernel,
                               dict(HAS_NEW=True, FIRST_SEG=0, DOT_FP32=False, FINISH=0, P=16, BLOCK_M=16, BLOCK_P=16,
                                    BLOCK_R=64, BLOCK_D=128, BLOCK_S=1, EVEN_D=True, LN_IN=1, BLOCK_N=8,
                                    SLOW=2 * 64 // slow_r, SLOW_R=slow_r, SLOW_LAST=last, GDC=gdc),
                               overrides=fold_ptrs).asm["ptx"]
            if gdc:
                assert "st.global" not in ptx[:ptx.index("griddepcontrol.wait")]
                assert ptx.count("griddepcontrol.wait") >= 2
            else:
                assert "griddepcontrol" not in ptx
    for dt in ("fp16", "bf16", "fp32"):
        for gdc in (0, 2):
            ptx = compile_sm90(SA, SA._attn_decode_kernel, dict(PARTIAL=True, COMMIT=2, BLOCK_S=32, BLOCK_HD=128,
                                                                BLOCK_X=16, EARLY_READS=True, FOLD=True, FOLD_SPLIT=5,
                                                                BLOCK_F=16, GDC=gdc),
                               dt, {"cnt_ptr": "*i32", "pnew_ptr": "*fp32", "phist_ptr": "*fp32"}).asm["ptx"]
            if gdc:
                wait = ptx.index("griddepcontrol.wait")
                assert "st.global" not in ptx[:wait] and ptx.index("griddepcontrol.launch_dependents") > wait
    ptx = compile_sm90(SA, SA._attn_combine_kernel, dict(BLOCK_C=8, BLOCK_HD=128, COMMIT=True, GDC=2)).asm["ptx"]
    assert "st.global" not in ptx[:ptx.index("griddepcontrol.wait")]
    # fc1 and fc2 in one launch (sparse_mlp_chain): fp16 / bf16 / fp32, even and odd D; the tiles'
    # wait on their split's counter is an acquire, the fc1 programs' count a release
    chain = dict(BLOCK_R=2, BLOCK_D1=1024, STAGES1=2, W_EV="evict_first", BLOCK_K=64, BLOCK_B=16, BLOCK_D=128,
                 STAGES2=3)
    for dt, f32 in (("fp16", False), ("bf16", False), ("fp32", True)):
        for even in (True, False):
            for gdc in (0, 1):
                ptx = compile_sm90(SM, SM._mlp_chain_kernel, {**chain, "EVEN_D1": even, "EVEN_D": even,
                                                               "DOT_FP32": f32, "GDC": gdc,
                                                               "ROW_ACC": 1 if gdc else 1024,
                                                               "FC2_DOT": not (even and gdc)},
                                   dt, {"cnt_ptr": "*i32"}).asm["ptx"]
                assert "ld.global.gpu.acquire" in ptx and "red.global.gpu.release" in ptx, dt
                if gdc:
                    wait = ptx.index("griddepcontrol.wait")
                    assert "st.global" not in ptx[:wait] and "ld.global" not in ptx[:wait]
                    assert ptx.index("griddepcontrol.launch_dependents") > wait
                else:
                    assert "griddepcontrol" not in ptx
    # fc1 -> fc2 hand-over per K split (fc2_overlap): fc1 counts its programs (release) and lets the
    # next launch start right after its PDL wait; fc2's tiles wait on the count (acquire), read h
    # from L2 (.cg), and pass the PDL wait (fc1 completed) only after their loop, before any store
    for dt in ("fp16", "bf16"):
        ptx = compile_sm90(SM, SM._gather_gemv_kernel, dict(RELU=True, BLOCK_R=2, BLOCK_D=1024, EVEN_D=True, GROUP=1,
                                                            LN_IN=3, W_EV="evict_first", SIGNAL=1, GDC=2),
                           dt, {"cnt_ptr": "*i32", **LN_IN}).asm["ptx"]
        wait = ptx.index("griddepcontrol.wait")
        assert wait < ptx.index("griddepcontrol.launch_dependents") < ptx.index("ld.global")
        assert "red.global.gpu.release" in ptx or "atom.global.gpu.release" in ptx
        ptx = compile_sm90(SM, SM._gather_dot_t_kernel, dict(DOT_FP32=False, BLOCK_K=64, BLOCK_B=16, BLOCK_D=128,
                                                             EVEN_D=True, FINAL=False, HAS_RES=False, FUSED=False,
                                                             LN=False, GROUP=1, BLOCK_S=8, BLOCK_N=64, LN_BLOCK=2048,
                                                             WAIT=1, H_CM=".cg", GDC=1),
                           dt, {"cnt_ptr": "*i32", "eps": "fp32"}).asm["ptx"]
        acquire = ptx.index("ld.global.gpu.acquire") if "ld.global.gpu.acquire" in ptx else \
            ptx.index("atom.global.gpu.acquire")
        wait = ptx.index("griddepcontrol.wait")
        assert acquire < ptx.index("ld.global.cg") < wait < ptx.index("griddepcontrol.launch_dependents")
        assert "st.global" not in ptx[:wait], dt
    # the weight streams are multi-buffered (cp.async, num_stages - 1 tiles in shared memory) when the
    # integer arguments are specialised as on the GPU: the batch-1 Q/K/V partial kernel's 64 x 128 tiles,
    # and the fc2 / projection kernel's 64 x 128 tiles with ROWS_AHEAD (its row indices a K block ahead;
    # without it the tile hangs on an index load of the same iteration and gets one buffer: docs/kernels.md)
    tile = 64 * 128 * 2
    div = {"D", "K", "K_PER_SPLIT", "N_ROWS", "HD", "D_PER_SPLIT", "stride_hb", "stride_nb", "stride_xb", "stride_xs",
           "stride_cb", "stride_ch", "stride_cs"}
    k = compile_sm90(DK, DK._qkv_partial_shared_kernel,
                     dict(HAS_NEW=True, FIRST_SEG=0, DOT_FP32=False, FINISH=0, P=32, BLOCK_M=32, BLOCK_P=32, BLOCK_R=64,
                          BLOCK_D=128, BLOCK_S=1, EVEN_D=True, LN_IN=1, BLOCK_N=32, GDC=1),
                     overrides={**qkv_ptrs, "st_ptr": "*fp32", "eps": "fp32"}, num_stages=3, div16=div)
    assert "cp.async" in k.asm["ptx"] and k.metadata.shared >= 2 * tile, k.metadata.shared
    fc2 = dict(DOT_FP32=False, BLOCK_K=64, BLOCK_B=16, BLOCK_D=128, EVEN_D=True, FINAL=False, HAS_RES=True,
               FUSED=False, LN=False, BLOCK_S=4, BLOCK_N=64, LN_BLOCK=2048, W_EV="evict_first", GDC=1)
    for group, combine in ((1, 0), (128, 1)):
        for stages in (3, 4):
            k = compile_sm90(SM, SM._gather_dot_t_kernel, {**fc2, "GROUP": group, "COMBINE": combine, "BLOCK_C": 8,
                                                           "ROWS_AHEAD": 1},
                             overrides={"cnt_ptr": "*i32", "eps": "fp32"}, num_stages=stages, div16=div)
            assert k.metadata.shared >= (stages - 1) * tile, (group, stages, k.metadata.shared)
    print("ALL OK")
''')


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
