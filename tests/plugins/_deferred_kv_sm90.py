"""Compile the deferred-K/V kernels for sm_90 with Triton's real compiler (run by test_deferred_kv.py)."""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import dejavu.plugins.deferred_kv as M
M.tl = tl
fn = triton.jit(M._recompute_kv_kernel)
cm = triton.jit(M._commit_kernel)
for dt, f32 in (("fp16", False), ("fp32", True), ("bf16", False)):
    for new in (True, False):
        sig = {"x_ptr": f"*{dt}", "xnew_ptr": f"*{dt}", "w_ptr": f"*{dt}", "b_ptr": f"*{dt}", "head_ptr": "*i32", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}",
               "vl_ptr": "*i32", "pos_ptr": "*i64", "KH": "i32", "H": "i32", "D": "i32", "HD": "i32", "stride_xb": "i32",
               "stride_xs": "i32", "stride_nb": "i32", "stride_hb": "i32", "stride_pb": "i32", "stride_cb": "i32", "stride_ch": "i32", "stride_cs": "i32",
               "HAS_NEW": "constexpr", "DOT_FP32": "constexpr", "BLOCK_P": "constexpr", "BLOCK_R": "constexpr", "BLOCK_D": "constexpr"}
        k = triton.compile(ASTSource(fn, sig, {"HAS_NEW": new, "DOT_FP32": f32, "BLOCK_P": 16, "BLOCK_R": 16, "BLOCK_D": 128}), target=GPUTarget("cuda", 90, 32))
        sig2 = {"xnew_ptr": f"*{dt}", "x_ptr": f"*{dt}", "head_ptr": "*i64", "vl_ptr": "*i32", "pos_ptr": "*i64", "KH": "i32", "H": "i32", "D": "i32",
                "stride_nb": "i32", "stride_xb": "i32", "stride_xs": "i32", "stride_hb": "i32", "stride_pb": "i32",
                "HAS_NEW": "constexpr", "BLOCK_K": "constexpr", "BLOCK_D": "constexpr"}
        k2 = triton.compile(ASTSource(cm, sig2, {"HAS_NEW": new, "BLOCK_K": 16, "BLOCK_D": 1024}), target=GPUTarget("cuda", 90, 32))
        print(dt, new, "ok", k.metadata.shared, k2.metadata.shared)
