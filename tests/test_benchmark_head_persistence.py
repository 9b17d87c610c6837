"""benchmarks/head_persistence.py's gap accounting, on hand-made head sequences."""
import sys
from pathlib import Path

import torch

_BENCH = str(Path(__file__).resolve().parents[1] / "benchmarks")
sys.path.insert(0, _BENCH)  # for this import only (benchmarks/kernels.py must not shadow HF's `kernels`)
try:
    import head_persistence as hp  # noqa: E402
finally:
    sys.path.remove(_BENCH)


def test_gaps_turnover_and_slow_path_share():
    # one layer, 4 heads, 2 per step; prefill leaves every head up to date before step 0
    seq = [[0, 1], [0, 1], [2, 3], [0, 2]] + [[0, 1]] * 16 + [[3, 0]]
    stats = hp.gap_stats([[torch.tensor(s)] for s in seq], num_heads=4)
    # gaps (slots missed since the last selection): step0 0,0; step1 0,0; step2 2,2 (heads 2, 3
    # missed steps 0, 1); step3 head0 1 (last at 1), head2 0; step4 head0 0, head1 2 (last at 1);
    # steps 5..19: 0, 0; step20: head3 17 (last at 2), head0 0
    want = [0, 0, 0, 0, 2, 2, 1, 0] + [0, 2] + [0, 0] * 15 + [17, 0]
    assert stats["selections"] == len(want)
    assert abs(stats["mean_gap"] - sum(want) / len(want)) < 1e-6
    assert abs(stats["frac_gap"] - sum(g > 0 for g in want) / len(want)) < 1e-6
    assert abs(stats["frac_gap_over_15"] - 1 / len(want)) < 1e-6 and stats["frac_gap_over_31"] == 0
    # layer-steps with a head past 15 slots: step 20 only, of 21
    assert stats["layers_over_15_by_step"] == [0] * 20 + [1]
    assert abs(stats["frac_layer_steps_over_15"] - 1 / 21) < 1e-6 and stats["frac_layer_steps_over_31"] == 0
    # turnover: heads of a step not in the step before (20 transitions)
    new = [0, 1, 0.5, 0.5] + [0] * 15 + [0.5]
    assert abs(stats["turnover"] - sum(new) / len(new)) < 1e-6


def test_random_sets_turn_over_as_expected():
    sets = hp.random_sets(400, [3], 12, seed=1)
    stats = hp.gap_stats(sets, 12)
    # independent draws: a head of this step was in the last one with probability 3/12
    assert abs(stats["turnover"] - 0.75) < 0.05


def test_random_weight_census_on_a_tiny_shape(tmp_path):
    """--random-shape: e2e.py's random-weight engine (CPU, fp32), every step's sets recorded; the layer
    counts per step agree with the fractions, and the JSON is written."""
    out = tmp_path / "census.json"
    assert hp.main(["--random-shape", "tiny", "--densities", "0.25", "--prompt-len", "8", "--new-tokens", "30",
                    "--out", str(out)]) == 0
    import json
    r = json.loads(out.read_text())["results"][0]
    assert r["steps"] == 29 and r["heads_kept"] == [2] and r["sparse_attn_layers"] == 4  # 8 heads, d0.25
    s = r["random_weights"]
    assert s["selections"] == 29 * 4 * 2
    by_step = s["layers_over_15_by_step"]
    assert len(by_step) == 29 and by_step[:16] == [0] * 16  # nothing can be 16 behind before step 16
    assert abs(s["frac_layer_steps_over_15"] - sum(by_step) / (29 * 4)) < 1e-9
