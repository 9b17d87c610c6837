#!/usr/bin/env bash
# The GQA combine's partials in chunks (GQAAttnSettings.combine_splits 8: the combine launch and the o projection's
# select load 8 splits' m / l / acc at once) against one split after another (combine_splits 0). First a check of
# both on the GPU against float64 at real shapes (Llama-3-8B and the 70B TP-8 rank's heads, 4096 slots, several
# positions: 1 to 32 splits); then both Llama shapes at 50% skipped, the dense graph, the defaults and the variant,
# each profiled, after the smoke check; then Llama-3-8B at a 3968-token prompt (32 splits) both ways; then
# launch_chain.py on an H200 (the ten-launch layer's bound there). Before the A/B, a tiny Llama engine built on the GPU
# with its layers offloaded (forced) against one built on the device. Under 9 minutes.
#   bash benchmarks/gpu/llama_combine.sh
set -euo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/dejavu-out}; mkdir -p "$OUT"
D=$(date -u +%F)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
if [ "${1:-}" != long ]; then
TRITON_INTERPRET=0 timeout 100 python3 - <<'PY' || echo "llama_combine: the combine check failed"
import dataclasses, torch
from dejavu.plugins import DEFAULT
from dejavu.plugins.gqa_attention import gqa_decode
from dejavu.plugins.input_sparse import select_slices
torch.manual_seed(0)
worst = 0.0
for H, Hkv in ((32, 8), (8, 1)):
    for pos in ([4095], [3967], [100], [31], [0]):
        B, hd, T = len(pos), 128, 4096
        q = torch.randn(B, H, hd, device="cuda").half()
        k = (1.5 * torch.randn(B, Hkv, T, hd, device="cuda")).half()
        v = torch.randn(B, Hkv, T, hd, device="cuda").half()
        p = torch.tensor(pos, device="cuda")
        s = (q.double().view(B, Hkv, H // Hkv, hd) @ k.double().transpose(-1, -2)) / hd ** 0.5
        s[..., pos[0] + 1:] = float("-inf")
        ref = (s.softmax(-1) @ v.double()).reshape(B, H * hd)
        torch_err = (torch.nn.functional.scaled_dot_product_attention(q.view(B, Hkv, H // Hkv, hd), k, v, attn_mask=(
            torch.arange(T, device="cuda") <= pos[0]).view(1, 1, 1, T), enable_gqa=False).reshape(B, H * hd).double() - ref).abs().max().item()
        outs = {}
        for c in (8, 0):
            ks = dataclasses.replace(DEFAULT, gqa_attn=dataclasses.replace(DEFAULT.gqa_attn, combine_splits=c))
            o = gqa_decode(q, k, v, p, settings=ks)
            err = (o.double() - ref).abs().max().item()
            parts = gqa_decode(q, k, v, p, combine=False, settings=ks)
            outs[c] = (o, select_slices(parts, 0.0, 4, settings=ks) if hasattr(parts, "acc") else None)
            assert err <= 2 * torch_err + 1e-3, (H, Hkv, pos, c, err, torch_err)
            worst = max(worst, err)
        o8, sel8 = outs[8]
        if sel8 is not None:  # the select's values (t 0: every input kept) are the combine launch's o, bit for bit
            idx, val, cnt = sel8
            per = -(-H * hd // 4)
            got = torch.zeros_like(o8)
            for j in range(4):
                n = int(cnt[0, j])
                got[0, idx[0, j * per:j * per + n].long()] = val[0, j * per:j * per + n]
            assert torch.equal(got, o8), (H, Hkv, pos, (got.float() - o8.float()).abs().max().item())
print(f"combine chunks on the GPU: every case within bounds, worst |o - float64| {worst:.2e}")
PY
TRITON_INTERPRET=0 timeout 100 python3 - <<'PY' || echo "llama_combine: the fused select check failed"
# input_sparse.fused_parts (each GEMV program selecting its split's pairs) against the select + GEMV, bit for bit,
# on every projection shape of Llama-3-8B and the 70B TP-8 rank, 20 times over (the barrier between its select
# and its loop on real hardware)
import torch
from dejavu.plugins import DEFAULT
from dejavu.plugins.input_sparse import fused_parts, select_slices, sliced_parts, split_k_for
torch.manual_seed(0)
for N, M, kind in ((4096, 6144, "norm"), (4096, 28672, "norm"), (14336, 4096, "swiglu"), (8192, 1280, "norm"),
                   (8192, 7168, "norm"), (3584, 8192, "swiglu"), (4096, 4096, "none")):
    w_t = (torch.randn(N, M, device="cuda") / N ** 0.5).half()
    nw = (1 + 0.1 * torch.randn(N, device="cuda")).half() if kind == "norm" else None
    x = torch.randn(2, 1, 2 * N, device="cuda") if kind == "swiglu" else torch.randn(1, N, device="cuda")
    if kind == "none":
        x = x.half()
    split = split_k_for(1, N, M, DEFAULT.input_sparse)
    kw = dict(norm_w=nw, eps=1e-5, swiglu=kind == "swiglu")
    t = 0.67 if kind == "norm" else 0.4
    want = sliced_parts(*select_slices(x, t, split, dtype=torch.float16, **kw), w_t)
    for _ in range(20):
        got = fused_parts(x, t, split, w_t, **kw)
        assert torch.equal(got, want), (N, M, kind, (got - want).abs().max().item())
    print(f"fused select {N} x {M} ({kind}, {split} splits): equal to select + GEMV over 20 runs")
PY
timeout 120 python3 - <<'PY' || echo "llama_combine: the offloaded build check failed"
# a Llama build whose layers are offloaded (compiler.build_llama.offload_layers, forced) against one on the device
import sys, torch
sys.path.insert(0, "tests")
from llama_helpers import write_tiny_llama
import dejavu.compiler.build_llama as BL
from dejavu.compiler.build import build_engine
from dejavu.compiler.config import BuildConfig
from dejavu.engine_file import read_engine
f = write_tiny_llama("/tmp/tiny-llama", seed=4)
cfg = dict(density=0.6, calib_tokens=512, calib_window=128, dtype="float16", device="cuda")
build_engine(f, BuildConfig(**cfg), "/tmp/on-device.engine", progress=False)
BL.offload_needed = lambda n, d: True
build_engine(f, BuildConfig(**cfg), "/tmp/offloaded.engine", progress=True)
(ha, ta), (hb, tb) = read_engine("/tmp/on-device.engine"), read_engine("/tmp/offloaded.engine")
same = ha["sparsity"] == hb["sparsity"] and all(torch.equal(ta[k], tb[k]) for k in ta)
print("offloaded build equals the on-device build:", same, ha["sparsity"]["skips"], hb["sparsity"]["skips"])
PY
timeout 330 python3 benchmarks/e2e_llama.py --models llama-3-8b,llama-3-70b-tp8 \
    --variant-models llama-3-8b,llama-3-70b-tp8 --skips 0.5 --no-hf --profile-steps 20 --profile-variants \
    --budget-s 280 --kernel-variants '[{"gqa_attn": {"combine_splits": 0}}, {"fuse_select": true}]' \
    --out "$OUT/e2e-llama-combine-$D.json" | tail -10 || echo "llama_combine: e2e_llama ended early"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then  # measured three times on H100s
    timeout 60 python3 benchmarks/launch_chain.py --out "$OUT/launch-chain-$D.json" | tail -4
fi
exit 0
fi
timeout 150 python3 benchmarks/e2e_llama.py --models llama-3-8b --skips 0.5 --no-hf --prompt-len 3968 \
    --new-tokens 128 --profile-steps 20 --profile-variants --no-smoke \
    --kernel-variants '[{"gqa_attn": {"combine_splits": 0}}]' --out "$OUT/e2e-llama-combine-long-$D.json" | tail -4
