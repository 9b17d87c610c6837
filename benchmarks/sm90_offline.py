"""The batch-1 weight kernels compiled for sm_90 (H200) on this machine's CPU: no GPU needed.

    python3 benchmarks/sm90_offline.py [--base REV] [--out FILE]

Compiles the weight-streaming kernels of a batch-1 decode step (fc1's GEMV, the tl.dot fc2 and
output projection, the deferred Q/K/V partial and finishing kernels; their default blocks and
constexprs) with the installed Triton for GPUTarget("cuda", 90, 32). Pointers and the dimension /
stride arguments are marked divisible by 16, as the launcher's specialisation marks them on the GPU
(without that Triton emits neither vectorised loads nor cp.async, and the shared memory and
registers differ from the GPU's). For each kernel it prints the shared memory, ptxas's registers and
spills (Triton's bundled ptxas) and whether its loads go through cp.async; with --base REV it also
compiles the tree at git revision REV (a `git archive` in a temporary folder) and says whether each
kernel's PTX instructions are the same (comments, .loc / .file lines and debug labels dropped), the
same but for the parameter list (arguments of deleted modes removed), the same multiset of
instructions with register numbers numbered away (only LLVM's order moved), and whether shared
memory, registers and spills match: a refactoring that should not change the generated code can be
checked without a GPU. A constexpr the work tree's kernel no longer has is left out of its compile
(the base revision still gets it). --dump DIR writes each compared PTX body. Triton's
version matters (the device runs 3.6; pip's 3.6.0 wheel installs here in a virtual environment).
JSON to --out (default: none).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (module, kernel, constexprs, num_stages, typed arguments beyond the defaults)
QKV = dict(HAS_NEW=True, FIRST_SEG=0, DOT_FP32=False, FINISH=0, BLOCK_R=64, BLOCK_D=128, BLOCK_S=1, EVEN_D=True,
           BLOCK_N=32, GDC=1)
FC2 = dict(DOT_FP32=False, BLOCK_K=64, BLOCK_B=16, BLOCK_D=128, EVEN_D=True, BLOCK_S=4, FINAL=False, HAS_RES=True,
           FUSED=False, LN=False, BLOCK_N=64, LN_BLOCK=2048, BLOCK_C=8, GDC=1)
ATTN = dict(PARTIAL=True, COMMIT=2, BLOCK_S=32, BLOCK_HD=128, BLOCK_X=16, BLOCK_C=8, EARLY_READS=True, FOLD=False,
            FOLD_SPLIT=1, BLOCK_F=16, GDC=2)
TOPK = {"s_ptr": "*fp16", "out_ptr": "*i32", "ws_ptr": "*i32", "nkept_ptr": "*i32", "lse_ptr": "*fp32",
        "log_share": "fp32"}
GQA = {"q_ptr": "*fp16", "acc_ptr": "*fp32", "pos_ptr": "*i64", "scale": "fp32"}
F32 = {"pnew_ptr": "*fp32", "phist_ptr": "*fp32", "q_ptr": "*fp32", "st_ptr": "*fp32", "part_ptr": "*fp32",
       "ml_ptr": "*fp32", "apart_ptr": "*fp32", "wg_ptr": "*fp32", "eps": "fp32", "t": "fp32"}
KERNELS = {
    "fc1": ("fc1", "_gather_gemv_kernel",
            dict(RELU=True, BLOCK_R=2, BLOCK_D=1024, EVEN_D=True, GROUP=1, W_EV="evict_first", GDC=1), 2),
    "fc2": ("fc2", "_gather_dot_t_kernel", dict(FC2, GROUP=1), 3),
    "projection": ("fc2", "_gather_dot_t_kernel", dict(FC2, GROUP=128, COMBINE=0), 4),
    "qkv_partial_p32": ("qkv_partial", "_qkv_partial_shared_kernel", dict(QKV, P=32, BLOCK_M=32, BLOCK_P=32, LN_IN=1), 3),
    "qkv_partial_p16": ("qkv_partial", "_qkv_partial_shared_kernel", dict(QKV, P=16, BLOCK_M=16, BLOCK_P=16, LN_IN=1), 3),
    # folded into attention (few heads: OPT-30B d0.1), the slow path in its last 4 x 4 z-slices
    "qkv_partial_fold": ("qkv_partial", "_qkv_partial_shared_kernel",
                         dict(QKV, P=16, BLOCK_M=16, BLOCK_P=16, LN_IN=1, SLOW=16, SLOW_R=16, SLOW_LAST=1), 3),
    "qkv_finish": ("qkv_finish", "_qkv_finish_kernel",
                   dict(FIRST_SEG=0, DOT_FP32=False, BLOCK_P=32, BLOCK_R=16, BLOCK_D=128, BLOCK_S=1, EARLY_READS=True,
                        GDC=2), 3),
    # the latency-bound kernels between the weight streams (their shipped batch-1 launches)
    "attention": ("sparse_attention", "_attn_decode_kernel", ATTN, 3),
    "attention_refresh": ("sparse_attention", "_attn_decode_kernel", dict(ATTN, BLOCK_REF=16), 3),
    "attention_fold": ("sparse_attention", "_attn_decode_kernel", dict(ATTN, COMMIT=2, FOLD=True, FOLD_SPLIT=8), 3),
    "attn_combine": ("sparse_attention", "_attn_combine_kernel", dict(BLOCK_C=8, BLOCK_HD=128, GDC=2), 3),
    "attn_combine_commit": ("sparse_attention", "_attn_combine_kernel",
                            dict(BLOCK_C=8, BLOCK_HD=128, COMMIT=True, GDC=2), 3),
    "split_reduce_stats": ("fc2", "_split_reduce_kernel", dict(HAS_RES=True, BLOCK=1024, BLOCK_S=8, STATS=1,
                                                                      GDC=2), 3),
    "split_reduce": ("fc2", "_split_reduce_kernel", dict(HAS_RES=True, BLOCK=1024, BLOCK_S=8, GDC=2), 3),
    "layer_norm": ("layer_norm", "_layer_norm_kernel", dict(CHUNKED=False, BLOCK=8192, EARLY_W=True, GDC=2), 3),
    # Llama TEAL engines (input_sparse.py): the select fused with RMSNorm (q/k/v's 6 splits), the SwiGLU select
    # summing gate/up's 2 partials, the pairs' GEMV at the default blocks, the sums with the residual (o / down's
    # 9 splits) / RoPE; PDL as launched on sm_90; gate/up's GEMV at its block_k 64 (input_sparse.projections)
    "select_slices_norm": ("input_sparse", "_select_slices_kernel",
                           dict(PRODUCER=1, SRC_SPLIT=0, BLOCK=1024, ROW=4096, GDC=2, num_warps=8), 3),
    "select_slices_swiglu_parts": ("input_sparse", "_select_slices_kernel",
                                   dict(PRODUCER=2, SRC_SPLIT=2, BLOCK=2048, ROW=4096, GDC=2, num_warps=8), 3,
                                   {"x_ptr": "*fp32"}),
    "sliced_gemv": ("input_sparse", "_sliced_gemv_kernel", dict(BLOCK_M=64, SUB=64, EVEN_M=True, GDC=1), 3),
    "sliced_gemv_k64": ("input_sparse", "_sliced_gemv_kernel", dict(BLOCK_M=64, SUB=32, EVEN_M=True, GDC=1), 3),
    "input_sparse_sum_res": ("input_sparse", "_sum_splits_kernel",
                             dict(BLOCK_M=64, SPLIT_K=9, HAS_RES=True, GDC=2), 3),
    "input_sparse_sum_rope": ("input_sparse", "_sum_rope_kernel",
                              dict(HEAD_D=128, BLOCK_M=64, SPLIT_K=6, HAS_BIAS=False, QK_NORM=False, GDC=2), 3,
                              {"pos_ptr": "*i64", "q_ptr": "*fp16"}),
    # the Llama decode step's attention (gqa_attention.py): Llama-3-8B's G 4 (a 70B TP-8 rank: G 8), padded to 16
    # rows for tl.dot, at the default block_s, its partials; the combine kernel, or the o projection's select
    # combining them (ATTN)
    "gqa_split": ("gqa_attention", "_gqa_split_kernel",
                  dict(G=4, BLOCK_G=16, BLOCK_S=32, BLOCK_HD=128, PARTIAL=True, DOT_FP32=False, GDC=1), 2, GQA),
    "gqa_split_g8": ("gqa_attention", "_gqa_split_kernel",
                     dict(G=8, BLOCK_G=16, BLOCK_S=32, BLOCK_HD=128, PARTIAL=True, DOT_FP32=False, GDC=1), 2, GQA),
    "gqa_combine": ("gqa_attention", "_gqa_combine_kernel", dict(BLOCK=1024, GDC=2), 2, GQA),
    "select_slices_attn": ("input_sparse", "_select_slices_kernel",
                           dict(PRODUCER=3, SRC_SPLIT=0, BLOCK=512, ROW=16, GDC=2, num_warps=8), 3,
                           {"x_ptr": "*fp32", "nw_ptr": "*fp32", "pos_ptr": "*i64"}),
    # a per-token MLP K (engines' default): fc1 stopping at the kept count (fc2: fc2_compacted below), the
    # top-k's launches that compute it (OPT-30B's MLP row: 28 programs of 1024 fp16 scores; its 4 warps, the
    # settings' default).
    # A fifth field types arguments; a tree whose kernel lacks them (the base) compiles its own form
    "fc1_keep": ("fc1", "_gather_gemv_kernel", dict(RELU=True, BLOCK_R=2, BLOCK_D=1024, EVEN_D=True, GROUP=1,
                                                    W_EV="evict_first", GDC=1, KEEP=1), 2, {"nkept_ptr": "*i32"}),
    **{f"topk_{n}": ("predictor", "_topk_kernel", dict(BLOCK=1024, NB_P2=32, KEY_BITS=16, MODE=1, FIRST=f, LAST=l,
                                                       COMPACT=f == l, KEEP=1, num_warps=4), 3, TOPK)
       for n, f, l in (("round0_keep", 0, 1), ("round1_keep", 1, 2), ("compact_keep", 2, 2))},
    "topk_compact": ("predictor", "_topk_kernel", dict(BLOCK=1024, NB_P2=32, KEY_BITS=16, MODE=1, FIRST=2, LAST=2,
                                                       COMPACT=True, num_warps=4), 3, TOPK),
    # fc2 over h's nonzero rows (the decode step where runtime.ops.skips_zero): compact_rows' launch (its default
    # blocks; OPT-30B's top-2K at MLP 0.1, 5734 rows: a prefix load of 8192), then fc2 stopping at its count
    # (batch 1: the dot kernel; per-sequence sets: the GEMV kernel with its default blocks)
    "compact_rows": ("compact_rows", "_compact_rows_kernel", dict(BLOCK=1024, PREFIX=8192, GDC=2, num_warps=8), 3,
                     {"ic_ptr": "*i32", "n_ptr": "*i32"}),
    "fc2_compacted": ("fc2", "_gather_dot_t_kernel", dict(FC2, GROUP=1, KEEP=1), 3, {"nkept_ptr": "*i32"}),
    "fc2_gemv_keep": ("fc2", "_gather_gemv_t_kernel", dict(FINAL=False, HAS_RES=True, BLOCK_K=16, BLOCK_D=256,
                                                           EVEN_D=True, GROUP=1, GDC=1, KEEP=1), 2,
                      {"nkept_ptr": "*i32"}),
}
INT_PTRS = {"idx_ptr", "head_ptr", "pos_ptr", "vl_ptr", "cnt_ptr", "ref_ptr", "count_ptr"}
# pointers the launchers pass as None where their mode is off (fc1's keep: engines without a per-token K);
# Triton's JIT specializes a None argument as a constexpr, so it leaves the compiled parameter list
NONE_PTRS = {"keep_ptr", "nkept_ptr"}
DIV16 = {"D", "K", "K_PER_SPLIT", "N_ROWS", "HD", "D_PER_SPLIT", "stride_hb", "stride_nb", "stride_xb", "stride_xs",
         "stride_cb", "stride_ch", "stride_cs", "stride_ob", "stride_ib", "N", "M"}

# Run in a fresh interpreter per tree (its own `dejavu` import): prints one JSON line.
CHILD = r'''
import hashlib, importlib, importlib.util, inspect, json, re, subprocess, sys, os
root = sys.argv[1]
sys.path.insert(0, root)  # `dejavu` from this tree (the path finder runs before an editable install's)
import dejavu
assert dejavu.__file__.startswith(root), dejavu.__file__
# dejavu.plugins is the tree's plugins/ folder (what the install maps; no dejavu/plugins link needed)
_spec = importlib.util.spec_from_file_location("dejavu.plugins", os.path.join(root, "plugins", "__init__.py"),
                                               submodule_search_locations=[os.path.join(root, "plugins")])
_mod = importlib.util.module_from_spec(_spec)
sys.modules["dejavu.plugins"] = _mod
_spec.loader.exec_module(_mod)
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
import dejavu.plugins._common as C
spec = json.loads(sys.argv[2])
try:  # the ptxas Triton itself would run for sm_90 (its version matches the PTX Triton emits)
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path
except Exception:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
out = {}
# a kernel's module at an older revision (before plugins/ had one file per op)
OLD_HOME = {"fc1": "sparse_mlp", "fc2": "sparse_mlp", "qkv_partial": "deferred_kv", "qkv_finish": "deferred_kv"}
for name, (modname, kname, consts, stages, *types) in spec["kernels"].items():
    types = types[0] if types else {}
    warps = consts.pop("num_warps", 4)
    if not os.path.exists(os.path.join(root, "plugins", modname + ".py")):
        modname = OLD_HOME.get(modname, modname)
    if not os.path.exists(os.path.join(root, "plugins", modname + ".py")):
        continue  # a kernel file the base revision does not have
    mod = importlib.import_module("dejavu.plugins." + modname)
    if not hasattr(mod, kname):
        continue  # a kernel added since the base revision
    assert mod.__file__.startswith(root), mod.__file__
    C.tl = tl
    bind = getattr(C, "bind_helpers", None) or C._bind_helpers  # the name at older revisions
    bind(vars(mod), triton)
    bind(getattr(mod, kname).__globals__, triton)
    fn = getattr(mod, kname)
    params = inspect.signature(fn).parameters
    # a constexpr the kernel no longer has (a mode deleted since the base revision) is left out
    consts = {**{n: p.default for n, p in params.items()
                 if p.default is not p.empty and "constexpr" in str(p.annotation)},
              **{n: v for n, v in consts.items() if n in params}}
    consts = {n: v for n, v in consts.items() if n not in spec["f32"]}
    consts.update({n: None for n in params if n in spec["none_ptrs"] and n not in consts and n not in types})
    sig, attrs = {}, {}
    for i, n in enumerate(params):
        if n in consts:
            sig[n] = "constexpr"
        elif n in types:
            sig[n] = types[n]
        elif n in spec["f32"]:
            sig[n] = spec["f32"][n]
        elif n.endswith("_ptr"):
            sig[n] = "*i32" if n in spec["int_ptrs"] else "*fp16"
        else:
            sig[n] = "i32"
        if sig[n].startswith("*") or n in spec["div16"]:
            attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        k = triton.compile(ASTSource(JITFunction(fn), signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_stages": stages, "num_warps": warps})
    except Exception as e:  # a form this tree's kernel does not have (the base's fc1 with a count)
        out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        continue
    ptx = k.asm["ptx"]
    body = "\n".join(l.split("//")[0] for l in ptx.split(".section")[0].splitlines()
                     if not re.match(r"\s*(\.(loc|file)\b|\$L__tmp)", l))
    # the same with the parameter list dropped and parameter names numbered away: equal when only
    # unused arguments were removed (the instructions, their order and operands otherwise the same)
    body_np = "\n".join(re.sub(r"_param_\d+", "_param_N", l) for l in body.splitlines()
                        if not re.match(r"\s*\.param\b", l))
    # the multiset of instructions, register numbers and labels numbered away: equal when the code differs
    # only in the order LLVM scheduled it (removing arguments moves the parameter loads, and with them
    # the instructions around them)
    instr = sorted(l.strip() for l in re.sub(r"\$L__BB\d+_\d+", "$L",
                                              re.sub(r"%(r|rd|f|fd|p|rs|h|hh|b|rb)\d+", r"%\1", body_np)).splitlines()
                   if l.strip())
    row = {"shared": k.metadata.shared, "cp_async": "cp.async" in ptx, "ptx_md5": hashlib.md5(body.encode()).hexdigest(),
           "ptx_md5_no_params": hashlib.md5(body_np.encode()).hexdigest(),
           "instr_md5": hashlib.md5("\n".join(instr).encode()).hexdigest()}
    if os.path.exists(ptxas):
        with open(spec["tmp"], "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", spec["tmp"], "-o", os.devnull], capture_output=True, text=True)
        regs = re.findall(r"Used (\d+) registers", r.stderr)
        spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
        row.update(regs=int(regs[0]) if regs else None, spill_bytes=int(spills[0]) if spills else None)
    if spec.get("dump"):
        with open(os.path.join(spec["dump"], name + ".ptx"), "w") as f:
            f.write(body)
    out[name] = row
print(json.dumps(out))
'''


def compile_tree(root: Path, dump: str | None = None) -> dict:
    if dump:
        os.makedirs(dump, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"kernels": KERNELS, "f32": F32, "int_ptrs": sorted(INT_PTRS), "div16": sorted(DIV16),
                "none_ptrs": sorted(NONE_PTRS),
                "tmp": os.path.join(tmp, "k.ptx"), "dump": dump}
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        proc = subprocess.run([sys.executable, "-c", CHILD, str(root), json.dumps(spec)], capture_output=True,
                              text=True, env=env, timeout=900)
    if proc.returncode:
        raise SystemExit(f"sm90_offline: compiling {root} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tree_at(rev: str, dest: Path) -> Path:
    """`git archive REV` unpacked in dest."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=data, check=True)
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=None, help="git revision to compare the work tree's PTX with")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dump", default=None, help="write each kernel's compared PTX under DUMP/work and DUMP/base")
    a = ap.parse_args(argv)
    import triton

    res = {"triton": triton.__version__, "work_tree": compile_tree(ROOT, a.dump and os.path.join(a.dump, "work"))}
    if a.base:
        with tempfile.TemporaryDirectory() as tmp:
            res["base"] = {"rev": a.base, "kernels": compile_tree(tree_at(a.base, Path(tmp)),
                                                                  a.dump and os.path.join(a.dump, "base"))}
    print(f"Triton {res['triton']}, sm_90")
    print("| kernel | shared B | regs | spill B | cp.async |"
          + (" same PTX as base | same PTX but the parameter list | same instructions, order aside |"
             " same shared / regs / spills |" if a.base else ""))
    print("|---|---:|---:|---:|---|" + ("---|---|---|---|" if a.base else ""))
    for name, r in res["work_tree"].items():
        line = f"| {name} | {r.get('shared')} | {r.get('regs')} | {r.get('spill_bytes')} | {r.get('cp_async', r.get('error'))} |"
        if a.base:
            b = res["base"]["kernels"].get(name)
            line += f" {b is not None and b.get('ptx_md5') == r.get('ptx_md5')} |"
            line += f" {b is not None and b.get('ptx_md5_no_params') == r.get('ptx_md5_no_params')} |"
            line += f" {b is not None and b.get('instr_md5') == r.get('instr_md5')} |"
            same = b is not None and all(b.get(f) == r.get(f) for f in ("shared", "regs", "spill_bytes"))
            line += f" {same} |"
        print(line)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
