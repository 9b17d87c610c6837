"""benchmarks/profile_decode.py's timeline accounting, on hand-made Chrome-trace kernel events."""
import sys
from pathlib import Path

_BENCH = str(Path(__file__).resolve().parents[1] / "benchmarks")
sys.path.insert(0, _BENCH)  # for this import only (benchmarks/kernels.py must not shadow HF's `kernels`)
try:
    import profile_decode as pd  # noqa: E402
finally:
    sys.path.remove(_BENCH)


def ev(name, ts, dur, grid=(1, 1), block=(128,)):
    return {"name": name, "ts": ts, "dur": dur, "args": {"grid": list(grid), "block": list(block)}}


def test_charges_idle_overlap_and_sections():
    # two steps of: LN, Q/K/V (weights), finish, attention, combine, fc1 (weights); a top-k and a
    # scoring GEMV on the side stream. Times in us.
    events = []
    for t in (0, 100):
        events += [ev("_layer_norm_kernel", t + 0, 2), ev("_qkv_partial_shared_kernel", t + 2, 30),
                   ev("_qkv_finish_kernel", t + 32, 3), ev("_attn_decode_kernel", t + 35, 5),
                   ev("_attn_combine_kernel", t + 41, 2),  # 1 us idle before it
                   ev("_gather_gemv_kernel", t + 43, 40, grid=(1, 4301), block=(128,)),  # fc1: main
                   ev("_topk_kernel", t + 30, 10),  # side, beside finish/attention
                   ev("_gather_gemv_kernel", t + 85, 20, grid=(1, 3584), block=(128,))]  # scoring b: side
    side = pd.side_kernel({3584})
    tl = pd.timeline(events, 2, side)
    ch = {c["name"]: c["us_per_step"] for c in tl["charges"]}
    # start-to-next-start charges; the step's last kernel (fc1 at 43) runs to the next LN at 100
    assert ch == {"_layer_norm_kernel": 2, "_qkv_partial_shared_kernel": 30, "_qkv_finish_kernel": 3,
                  "_attn_decode_kernel": 6, "_attn_combine_kernel": 2, "_gather_gemv_kernel": (57 + 40) / 2}
    # idle: 40..41 and 83..100 in the first step, 140..141 in the second
    assert abs(tl["main_idle_ms_per_step"] - (1 + 17 + 1) / 2 / 1e3) < 1e-9
    assert abs(tl["side_kernel_ms_per_step"] - 30 / 1e3) < 1e-9
    # side time beside a running main kernel: top-k 30..40 all; scoring 85..105 only 100..105 (LN 100..102,
    # Q/K/V from 102) in the first step, none after the last kernel
    assert abs(tl["side_overlapping_main_ms_per_step"] - (10 + 10 + 5) / 2 / 1e3) < 1e-9
    sec = tl["sections"]
    assert sec["weights"] == 30 + (57 + 40) / 2 and sec["attention"] == 3 + 6 + 2 and sec["norms"] == 2
    assert sec["other"] == 0
    # start-to-next-start charges (the last kernel to its own end) add up to the span: 183 us over both steps
    assert abs(sum(sec.values()) * 2 - 183) < 1e-6


def test_sections_fall_back_to_other():
    sec = pd.sections([{"name": "vectorized_elementwise_kernel", "us_per_step": 3.0},
                       {"name": "_split_reduce_kernel", "us_per_step": 1.5},
                       {"name": "nvjet_sm90_hsh_512x8", "us_per_step": 170.0}])
    assert sec == {"weights": 170.0, "attention": 0.0, "norms": 1.5, "other": 3.0}


def test_layer_timeline_medians_labels_and_side_stream():
    # three layers of: Q/K/V partial (anchor), finish, fc1 (gather_gemv, main), fc2 (dot_t) + a second dot_t
    # (labelled #2); one side-stream scoring GEMV beside each layer's finish; an LM-head kernel after the last
    # layer only (left out: in one layer of three). Layer k is shifted by 100 us and its fc1 lasts 20 + k us.
    events = []
    for k in range(3):
        t = 100 * k
        events += [ev("_qkv_partial_shared_kernel", t, 30), ev("_qkv_finish_kernel", t + 30, 4),
                   ev("_gather_gemv_kernel", t + 34, 20 + k, grid=(1, 4301)),
                   ev("_gather_dot_t_kernel", t + 60, 10), ev("_gather_dot_t_kernel", t + 72, 8),
                   ev("_gather_gemv_kernel", t + 28, 8, grid=(1, 3584))]  # side: 28..36
    events.append(ev("nvjet_sm90_lm_head", 290, 50))
    lay = pd.layer_timeline(events, pd.side_kernel({3584}))
    assert lay["layers"] == 3 and lay["period_us"] == 100
    rows = {r["kernel"]: r for r in lay["kernels"]}
    assert [r["kernel"] for r in lay["kernels"]] == ["_qkv_partial_shared_kernel", "_qkv_finish_kernel",
                                                    "_gather_gemv_kernel", "_gather_dot_t_kernel",
                                                    "_gather_dot_t_kernel#2"]
    assert rows["_gather_gemv_kernel"]["end_us"] == 34 + 21  # the median of 20, 21, 22 us
    assert rows["_qkv_finish_kernel"]["adds_us"] == 4 and rows["_gather_dot_t_kernel#2"]["adds_us"] == 10
    # the side GEMV (28..36) covers 2 of the anchor's 30 us, all of the finish's window (30..34), and 2 of
    # fc1's (34..55)
    assert rows["_qkv_partial_shared_kernel"]["side_busy"] == round(2 / 30, 3)
    assert rows["_qkv_finish_kernel"]["side_busy"] == 1.0
    assert rows["_gather_gemv_kernel"]["side_busy"] == round(2 / 21, 3)
    # the side stream's kernels by layer window: the GEMV at 28..36 from each layer's anchor
    assert lay["side"] == [{"kernel": "_gather_gemv_kernel", "layers": 3, "start_us": 28, "end_us": 36, "dur_us": 8}]
    assert pd.layer_timeline(events, pd.side_kernel({3584}), anchor="_no_such_kernel") == {}
