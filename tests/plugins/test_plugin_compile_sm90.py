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
    import re
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
    import types
    import dejavu.plugins._common as C
    import dejavu.plugins.predictor as PR
    import dejavu.plugins.sparse_attention as SA

    def kernels_of(*names):  # the kernels of these plugin modules, by name
        mods = [importlib.import_module("dejavu.plugins." + n) for n in names]
        return types.SimpleNamespace(**{k: v for m in mods for k, v in vars(m).items() if k.endswith("_kernel")})

    SM = kernels_of("fc1", "fc2")
    DK = kernels_of("qkv_partial", "qkv_finish", "refresh_heads", "deferred_kv")

    INT_PTRS = {"idx_ptr", "head_ptr", "pos_ptr", "vl_ptr", "cnt_ptr", "ref_ptr"}
    F32_PTRS = {"part_ptr", "ml_ptr", "q_ptr", "o_ptr", "s_ptr", "pnew_ptr", "phist_ptr", "st_ptr"}

    def compile_sm90(mod, fn, constexprs, dtype="fp16", overrides=None, num_stages=None, div16=()):
        # tl and the @helper device functions, in mod and in the modules of helpers it imports
        # (layer_norm's merge of block stats), as _common.jit binds them: the kernel's own module
        C.tl = tl
        C.bind_helpers(fn.__globals__, triton)
        sig = {}
        params = inspect.signature(fn).parameters
        # constexprs with defaults (GDC: the PDL form) compile at their defaults unless given
        constexprs = {**{n: p.default for n, p in params.items()
                         if p.default is not p.empty and "constexpr" in str(p.annotation)}, **constexprs}
        constexprs = {n: v for n, v in constexprs.items() if n not in (overrides or {})}  # typed arguments
        for name in params:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = "*i32" if name in INT_PTRS else "*fp32" if name in F32_PTRS else "*" + dtype
            elif name == "eps":
                sig[name] = "fp32"
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
                                                          GROUP=group), dt)
        # fc1's (and the predictors') eviction hint: in the PTX only when asked
        for ev in ("evict_first", ""):
            k = compile_sm90(SM, SM._gather_gemv_kernel, dict(RELU=True, BLOCK_R=2, BLOCK_D=1024, EVEN_D=True,
                                                              GROUP=1, W_EV=ev), dt)
            assert ("L1::evict_first" in k.asm["ptx"]) == bool(ev), ev
        compile_sm90(SM, SM._gather_dot_kernel, dict(RELU=True, DOT_FP32=False, BLOCK_R=32, BLOCK_B=16,
                                                     BLOCK_D=128, EVEN_D=False, GROUP=1), dt)
        # a per-token K: fc1 reading only the first nkept[b] rows
        keep = {"nkept_ptr": "*i32"}
        compile_sm90(SM, SM._gather_gemv_kernel, dict(RELU=True, BLOCK_R=2, BLOCK_D=1024, EVEN_D=True, GROUP=1,
                                                      KEEP=1), dt, overrides=keep)
        # the int8 predictors: int8 rows, each row's sum times its fp16 scale (SCALE)
        for even in (True, False):
            compile_sm90(SM, SM._gather_gemv_kernel, dict(RELU=False, BLOCK_R=2, BLOCK_D=1024, EVEN_D=even, GROUP=1,
                                                          SCALE=1), dt, overrides={"w_ptr": "*i8"})
        # fc2 over h's nonzero rows (compact_rows, then fc2 stopping at their count): batch 1 through the dot
        # kernel, per-sequence sets through the GEMV kernel
        for final in (False, True):
            fin = dict(FINAL=final, HAS_RES=True, GROUP=1, KEEP=1)
            compile_sm90(SM, SM._gather_gemv_t_kernel, dict(BLOCK_K=16, BLOCK_D=256, EVEN_D=True, **fin), dt,
                         overrides=keep)
            compile_sm90(SM, SM._gather_dot_t_kernel, dict(DOT_FP32=False, BLOCK_K=64, BLOCK_B=16, BLOCK_D=128,
                                                           EVEN_D=True, **fin), dt, overrides=keep)
        # fc2 / out-proj: split-K partials, or one split
        for final, group in ((False, 1), (False, 128), (True, 128), (True, 1)):
            fin = dict(FINAL=final, HAS_RES=True, GROUP=group)
            compile_sm90(SM, SM._gather_gemv_t_kernel, dict(BLOCK_K=16, BLOCK_D=256, EVEN_D=True, **fin), dt)
            compile_sm90(SM, SM._gather_dot_t_kernel, dict(DOT_FP32=False, BLOCK_K=128, BLOCK_B=16, BLOCK_D=64,
                                                           EVEN_D=False, **fin), dt)
    for stats in (0, 1):  # 1: the block stats of a PendingLN
        compile_sm90(SM, SM._split_reduce_kernel, dict(HAS_RES=True, BLOCK=1024, BLOCK_S=4, STATS=stats))
    for commit in (0, 1, 2):  # 2: valid_len only (the Q/K/V kernel stored the history slot)
        compile_sm90(SA, SA._attn_decode_kernel, dict(PARTIAL=commit > 0, COMMIT=commit, BLOCK_S=64, BLOCK_HD=128,
                                                      BLOCK_X=1024))
    for even in (True, False):  # the shared-set Q/K/V kernel normalising its input (a PendingLN)
        for b in (16, 64):  # batch 1 (P 16), or batch 4 with P 16
            compile_sm90(DK, DK._qkv_partial_shared_kernel,
                         dict(DOT_FP32=False, P=16, BLOCK_M=b, BLOCK_P=16,
                              BLOCK_R=64, BLOCK_D=128, EVEN_D=even, LN_IN=1, BLOCK_N=8))
    for dt, f32 in (("fp16", False), ("bf16", False), ("fp32", True)):
        for even in (True, False):
            compile_sm90(DK, DK._qkv_partial_kernel, dict(DOT_FP32=f32, BLOCK_P=16, BLOCK_R=32, BLOCK_D=256,
                                                          EVEN_D=even), dt)
            compile_sm90(DK, DK._qkv_partial_shared_kernel, dict(DOT_FP32=f32, P=4, BLOCK_M=32, BLOCK_P=16, BLOCK_R=32,
                                                                 BLOCK_D=128, EVEN_D=even), dt)
        for z in (1, 4):  # SLOW_Z 4: the slow path shared out over 4 programs
            compile_sm90(DK, DK._qkv_finish_kernel, dict(DOT_FP32=f32, BLOCK_P=16, BLOCK_R=32, BLOCK_D=128, BLOCK_S=8,
                                                         SLOW_Z=z), dt)
    # refresh heads (batch 1): head slots past KH_Q read from ref_ptr, K/V only; their valid_len committed by
    # the attention kernel; the pick itself
    for gdc in (0, 1):
        compile_sm90(DK, DK._qkv_partial_shared_kernel, dict(DOT_FP32=False, P=16,
                                                             BLOCK_M=16, BLOCK_P=16, BLOCK_R=64, BLOCK_D=128,
                                                             EVEN_D=True, LN_IN=1, REFRESH=1, GDC=gdc))
        compile_sm90(DK, DK._qkv_finish_kernel, dict(DOT_FP32=False, BLOCK_P=16, BLOCK_R=16, BLOCK_D=128,
                                                     BLOCK_S=1, REFRESH=1, GDC=gdc))
    # batch 1's unfolded route by default (SHARED_P_UNFOLDED): every program's dot over 31 missing slots
    compile_sm90(DK, DK._qkv_partial_shared_kernel, dict(DOT_FP32=False,
                                                         P=32, BLOCK_M=32, BLOCK_P=32, BLOCK_R=64, BLOCK_D=128,
                                                         EVEN_D=True, LN_IN=1, GDC=1))
    compile_sm90(DK, DK._qkv_finish_kernel, dict(DOT_FP32=False, BLOCK_P=32, BLOCK_R=16, BLOCK_D=128,
                                                 BLOCK_S=1, GDC=1))
    compile_sm90(SA, SA._attn_decode_kernel, dict(PARTIAL=True, COMMIT=2, BLOCK_S=32, BLOCK_HD=128, BLOCK_X=16,
                                                  BLOCK_REF=16), overrides={"N_REF": "i32"})
    compile_sm90(DK, DK._refresh_kernel, dict(R=4, BLOCK_H=64, BLOCK_K=32))
    compile_sm90(DK, DK._commit_kernel, dict(BLOCK_K=16, BLOCK_D=1024))
    compile_sm90(SA, SA._attn_combine_kernel, dict(BLOCK_C=8, BLOCK_HD=128))
    IS = importlib.import_module("dejavu.plugins.input_sparse")  # TEAL (Llama engines)
    GA = importlib.import_module("dejavu.plugins.gqa_attention")  # the Llama decode step's attention
    compile_sm90(IS, IS._sum_splits_kernel, dict(BLOCK_M=128, SPLIT_K=11, HAS_RES=True), overrides={"part_ptr": "*fp32"})
    # each producer's select, from x and from fp32 partials (gate/up's, summed by down's SwiGLU select); the
    # pairs' GEMV at the default blocks (block_m 64, block_k 128: two loads of 64 pairs a step) and an odd M,
    # with no barrier in its loop
    for producer in (IS.NONE, IS.NORM, IS.SWIGLU):
        for src_split in (0, 2):
            compile_sm90(IS, IS._select_slices_kernel, dict(PRODUCER=producer, SRC_SPLIT=src_split, BLOCK=1024,
                                                            ROW=4096),
                         overrides={"count_ptr": "*i32", "t": "fp32", **({"x_ptr": "*fp32"} if src_split else {})})
    for even in (True, False):
        k = compile_sm90(IS, IS._sliced_gemv_kernel, dict(BLOCK_M=64, SUB=64, EVEN_M=even),
                         overrides={"count_ptr": "*i32", "part_ptr": "*fp32"}, div16={"N", "M"})
        ptx = k.asm["ptx"]
        loops = [ptx[m.end():ptx.rindex(f"$L__BB0_{m.group(1)};")] for m in re.finditer(r"\\$L__BB0_(\\d+):", ptx)
                 if f"$L__BB0_{m.group(1)};" in ptx[m.end():]]
        assert loops and not any("bar.sync" in body or "shared" in body for body in loops)
    # Qwen2's bias, Qwen3's norm; split 0: after a dense product (fp16, the dense decode step)
    for bias, norm, block, split in ((False, False, 64, 6), (True, False, 64, 6), (False, True, 128, 6),
                                     (True, True, 128, 0)):
        compile_sm90(IS, IS._sum_rope_kernel, dict(HEAD_D=128, BLOCK_M=block, SPLIT_K=split, HAS_BIAS=bias,
                                                   QK_NORM=norm),
                     overrides={"part_ptr": "*fp32" if split else "*fp16", "pos_ptr": "*i64", "q_ptr": "*fp16"})
    # the fp32 residual stream (input_sparse.fp32_residual): the RMSNorm select of an fp32 x writing fp16 pairs, and
    # the GEMV adding each split's sum into the stream with fp32 reductions at gpu scope, no partials stored
    compile_sm90(IS, IS._select_slices_kernel, dict(PRODUCER=IS.NORM, SRC_SPLIT=0, BLOCK=1024, ROW=4096),
                 overrides={"count_ptr": "*i32", "t": "fp32", "x_ptr": "*fp32"})
    ptx = compile_sm90(IS, IS._sliced_gemv_kernel, dict(BLOCK_M=64, SUB=64, EVEN_M=True, ATOMIC=1, GDC=1),
                       overrides={"count_ptr": "*i32", "part_ptr": "*fp32"}, div16={"N", "M"}).asm["ptx"]
    assert re.search(r"(red|atom)(\\.relaxed)?(\\.gpu)?\\.global(\\.\\w+)*\\.add\\.f32", ptx)
    assert not re.search(r"st\\.global(\\.\\w+)*\\.(f32|b32)", ptx)
    compile_sm90(PR, PR._topk_kernel, dict(BLOCK=1024, NB_P2=32, KEY_BITS=16, MODE=PR._SPLIT, FIRST=2, LAST=2,
                                           COMPACT=True),
                 overrides={"out_ptr": "*i32", "ws_ptr": "*i32", "s_ptr": "*fp16"})
    # a per-token K: the rule's partials (round 0), the kept counts (round 1), the kept rows first (compact)
    tk = {"out_ptr": "*i32", "ws_ptr": "*i32", "s_ptr": "*fp16", "nkept_ptr": "*i32", "lse_ptr": "*fp32",
          "log_share": "fp32"}
    for mode, first, last in ((PR._SPLIT, 0, 1), (PR._SPLIT, 1, 2), (PR._SPLIT, 2, 2), (PR._SINGLE, 0, 2)):
        compile_sm90(PR, PR._topk_kernel, dict(BLOCK=1024, NB_P2=32, KEY_BITS=16, MODE=mode, FIRST=first, LAST=last,
                                               COMPACT=first == last or mode == PR._SINGLE, KEEP=1), overrides=tk)
    CR = importlib.import_module("dejavu.plugins.compact_rows")  # the attribute is the function
    compacted = {"ic_ptr": "*i32", "n_ptr": "*i32"}
    for dt in ("fp16", "bf16", "fp32"):
        for prefix in (1024, 16384):
            compile_sm90(CR, CR._compact_rows_kernel, dict(BLOCK=1024, PREFIX=prefix), dt, overrides=compacted)
    LN = importlib.import_module("dejavu.plugins.layer_norm")  # the attribute is the function
    for dt in ("fp16", "bf16"):
        compile_sm90(LN, LN._layer_norm_kernel, dict(BLOCK=8192), dt)
    # PDL (_common.pdl_args): every kernel launched with launch_pdl waits (griddepcontrol.wait) before
    # any store (and before any load but the early reads) and lets the next one in only after it
    fin = dict(FINAL=False, HAS_RES=True, GROUP=128)
    cases = [
        (SM, SM._gather_gemv_kernel, dict(RELU=True, BLOCK_R=2, BLOCK_D=1024, EVEN_D=True, GROUP=1), True),
        (SM, SM._gather_dot_kernel, dict(RELU=True, DOT_FP32=False, BLOCK_R=64, BLOCK_B=16, BLOCK_D=128,
                                         EVEN_D=True, GROUP=1), True),
        (SM, SM._gather_gemv_t_kernel, dict(BLOCK_K=16, BLOCK_D=256, EVEN_D=True, **fin), True),
        (SM, SM._gather_dot_t_kernel, dict(DOT_FP32=False, BLOCK_K=64, BLOCK_B=16, BLOCK_D=128, EVEN_D=True,
                                           **fin), True),
        (SM, SM._split_reduce_kernel, dict(HAS_RES=True, BLOCK=1024, BLOCK_S=4), False),
        (SM, SM._split_reduce_kernel, dict(HAS_RES=True, BLOCK=1024, BLOCK_S=4, STATS=True), False),
        (DK, DK._qkv_partial_kernel, dict(DOT_FP32=False, BLOCK_P=16,
                                          BLOCK_R=32, BLOCK_D=128, EVEN_D=True), True),
        (DK, DK._qkv_partial_shared_kernel, dict(DOT_FP32=False, P=16,
                                                 BLOCK_M=16, BLOCK_P=16, BLOCK_R=64, BLOCK_D=128,
                                                 EVEN_D=True), True),
        (DK, DK._qkv_finish_kernel, dict(DOT_FP32=False, BLOCK_P=16, BLOCK_R=16, BLOCK_D=128,
                                         BLOCK_S=1), False),
        (DK, DK._commit_kernel, dict(BLOCK_K=16, BLOCK_D=1024), False),
        (SA, SA._attn_decode_kernel, dict(PARTIAL=True, COMMIT=True, BLOCK_S=32, BLOCK_HD=128, BLOCK_X=8192), False),
        (SA, SA._attn_combine_kernel, dict(BLOCK_C=8, BLOCK_HD=128), False),
        (SA, SA._attn_combine_kernel, dict(BLOCK_C=8, BLOCK_HD=128, COMMIT=True, BLOCK_REF=16), False),
        (LN, LN._layer_norm_kernel, dict(BLOCK=8192), False),
        (CR, CR._compact_rows_kernel, dict(BLOCK=1024, PREFIX=8192), True),  # its loop: the counts before it
        (IS, IS._select_slices_kernel, dict(PRODUCER=IS.NORM, SRC_SPLIT=0, BLOCK=1024, ROW=4096), False),
        (IS, IS._select_slices_kernel, dict(PRODUCER=IS.SWIGLU, SRC_SPLIT=2, BLOCK=1024, ROW=4096), False),
        (IS, IS._sliced_gemv_kernel, dict(BLOCK_M=64, SUB=64, EVEN_M=True), True),
        (IS, IS._sum_splits_kernel, dict(BLOCK_M=64, SPLIT_K=9, HAS_RES=True), False),
        (IS, IS._sum_rope_kernel, dict(HEAD_D=128, BLOCK_M=64, SPLIT_K=6, HAS_BIAS=False, QK_NORM=False), False),
        (IS, IS._select_slices_kernel, dict(PRODUCER=IS.ATTN, SRC_SPLIT=0, BLOCK=512, ROW=16), False),
        (GA, GA._gqa_split_kernel, dict(G=4, BLOCK_G=16, BLOCK_S=32, BLOCK_HD=128, PARTIAL=True, DOT_FP32=False), True),
        (GA, GA._gqa_split_kernel, dict(G=8, BLOCK_G=16, BLOCK_S=32, BLOCK_HD=128, PARTIAL=False, DOT_FP32=False),
         True),
        (GA, GA._gqa_combine_kernel, dict(BLOCK=1024), False),
    ]
    gqa = {"q_ptr": "*fp16", "o_ptr": "*fp16", "acc_ptr": "*fp32", "pos_ptr": "*i64", "scale": "fp32"}
    typed = {IS._select_slices_kernel: {"count_ptr": "*i32", "t": "fp32"}, IS._sliced_gemv_kernel:
             {"count_ptr": "*i32", "part_ptr": "*fp32"}, IS._sum_splits_kernel: {"part_ptr": "*fp32"},
             IS._sum_rope_kernel: {"part_ptr": "*fp32", "pos_ptr": "*i64"}, GA._gqa_split_kernel: gqa,
             GA._gqa_combine_kernel: {k: gqa[k] for k in ("o_ptr", "acc_ptr", "pos_ptr")}}
    for mod, fn, consts, looped in cases:  # looped: a main loop over weights (gdc_release after it)
        over = {"N_REF": "i32"} if fn is SA._attn_combine_kernel else compacted if fn is CR._compact_rows_kernel \
            else typed.get(fn)
        if consts.get("SRC_SPLIT"):
            over = {**over, "x_ptr": "*fp32"}
        if fn is IS._select_slices_kernel and consts["PRODUCER"] == IS.ATTN:  # the attention's partials
            over = {**over, "x_ptr": "*fp32", "nw_ptr": "*fp32", "pos_ptr": "*i64"}
        for gdc in (1, 2):  # late / early trigger
            ptx = compile_sm90(mod, fn, {**consts, "GDC": gdc}, "fp16", over).asm["ptx"]
            wait = ptx.index("griddepcontrol.wait")
            assert "st.global" not in ptx[:wait], fn.__name__
            if not looped:  # loads before the wait: LayerNorm's weights, attention's / the finish's reads
                early = fn in (LN._layer_norm_kernel, SA._attn_decode_kernel, DK._qkv_finish_kernel,
                               GA._gqa_combine_kernel) or consts.get("PRODUCER") in (IS.ATTN, IS.NORM)
                # (ATTN: pos, the step's input; NORM: the RMSNorm weights of the slice's first step)
                assert ("ld.global" in ptx[:wait]) == early, fn.__name__
            if gdc == 2 or looped:  # the next kernel is let in only after the wait
                assert ptx.index("griddepcontrol.launch_dependents") > wait, fn.__name__
            else:  # late trigger without a main loop: at exit
                assert "griddepcontrol.launch_dependents" not in ptx, fn.__name__
        plain = compile_sm90(mod, fn, consts, "fp16", over).asm["ptx"]
        assert "griddepcontrol" not in plain, fn.__name__
    # the Q/K/V finish folded into attention (batch 1, QKV_CONFIG_B1 FOLD_FINISH): the partial
    # kernel's slow-path z-slices, the attention kernel summing the partials, the combine kernel
    # committing valid_len; with PDL no store before a wait (the slow path waits on its own branch)
    for gdc in (0, 1):
        for slow_r in (16, 64):
            ptx = compile_sm90(DK, DK._qkv_partial_shared_kernel,
                               dict(DOT_FP32=False, P=16, BLOCK_M=16, BLOCK_P=16,
                                    BLOCK_R=64, BLOCK_D=128, EVEN_D=True, LN_IN=1, BLOCK_N=8,
                                    SLOW=2 * 64 // slow_r, SLOW_R=slow_r, GDC=gdc)).asm["ptx"]
            if gdc:
                assert "st.global" not in ptx[:ptx.index("griddepcontrol.wait")]
                assert ptx.count("griddepcontrol.wait") >= 2
            else:
                assert "griddepcontrol" not in ptx
    for dt in ("fp16", "bf16", "fp32"):
        for gdc in (0, 2):
            ptx = compile_sm90(SA, SA._attn_decode_kernel, dict(PARTIAL=True, COMMIT=2, BLOCK_S=32, BLOCK_HD=128,
                                                                BLOCK_X=16, FOLD=True, FOLD_SPLIT=5,
                                                                BLOCK_F=16, GDC=gdc), dt).asm["ptx"]
            if gdc:
                wait = ptx.index("griddepcontrol.wait")
                assert "st.global" not in ptx[:wait] and ptx.index("griddepcontrol.launch_dependents") > wait
    ptx = compile_sm90(SA, SA._attn_combine_kernel, dict(BLOCK_C=8, BLOCK_HD=128, COMMIT=True, GDC=2)).asm["ptx"]
    assert "st.global" not in ptx[:ptx.index("griddepcontrol.wait")]
    # the weight streams go through cp.async when the integer arguments are specialised as on the GPU: the
    # batch-1 Q/K/V partial kernel's 64 x 128 tiles multi-buffered; the fc2 / projection kernel's tile, whose
    # address hangs on an index load of the same iteration, gets one buffer (docs/kernels.md)
    tile = 64 * 128 * 2
    div = {"D", "K", "K_PER_SPLIT", "N_ROWS", "HD", "D_PER_SPLIT", "stride_hb", "stride_nb", "stride_xb", "stride_xs",
           "stride_cb", "stride_ch", "stride_cs"}
    k = compile_sm90(DK, DK._qkv_partial_shared_kernel,
                     dict(DOT_FP32=False, P=32, BLOCK_M=32, BLOCK_P=32, BLOCK_R=64,
                          BLOCK_D=128, EVEN_D=True, LN_IN=1, BLOCK_N=32, GDC=1), num_stages=3, div16=div)
    assert "cp.async" in k.asm["ptx"] and k.metadata.shared >= 2 * tile, k.metadata.shared
    for group in (1, 128):
        k = compile_sm90(SM, SM._gather_dot_t_kernel, dict(DOT_FP32=False, BLOCK_K=64, BLOCK_B=16, BLOCK_D=128,
                                                           EVEN_D=True, FINAL=False, HAS_RES=True, GROUP=group, GDC=1),
                         num_stages=3, div16=div)
        assert "cp.async" in k.asm["ptx"] and tile <= k.metadata.shared < 2 * tile, (group, k.metadata.shared)
    print("ALL OK")
''')


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
