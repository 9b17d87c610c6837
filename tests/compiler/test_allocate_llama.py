"""Llama byte budgets (compiler/allocate_llama.py): the per-kind knapsack, the held-out measurement,
and the builds that use them (--density with --allocation, --max-ppl-increase)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dejavu.compiler.allocate_llama import (KEYS, Sensitivity, allocate_skips, block_skip, heldout_nll,
                                            kind_thresholds, measure_sensitivity, refine_skips)
from dejavu.compiler.build import build_engine
from dejavu.compiler.config import BuildConfig
from dejavu.engine_file import read_engine
from dejavu.errors import DejavuError
from llama_helpers import tiny_llama, write_tiny_llama

CALIB = dict(calib_tokens=512, calib_window=128, heldout_tokens=256, dtype="float32")
WEIGHTS = {"attn_in": 7, "o_in": 3, "mlp_in": 20, "down_in": 10}
LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def _random_sensitivity(seed: int) -> Sensitivity:
    """Convex, increasing random curves (the measured SmolLM2 curves have this shape)."""
    rng = np.random.default_rng(seed)
    delta = {k: list(np.cumsum(np.cumsum(rng.uniform(0, 1, len(LEVELS)))) * rng.uniform(0.01, 1)) for k in KEYS}
    return Sensitivity(LEVELS, delta, 3.0)


def _loss(sens: Sensitivity, skips: dict) -> float:
    return sum(float(np.interp(skips[k], (0.0, *sens.levels), (0.0, *sens.delta[k]))) for k in KEYS)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("skip", [0.05, 0.25, 0.4, 0.63])
def test_allocate_skips_meets_the_budget_at_the_least_modelled_loss(seed, skip):
    """The budget is spent exactly (never exceeded), and no combination of levels on a 0.05 grid that
    skips at least as many bytes has a lower modelled loss (brute force over all of them)."""
    sens = _random_sensitivity(seed)
    got = allocate_skips(sens, WEIGHTS, skip)
    assert block_skip(got, WEIGHTS) == pytest.approx(skip, abs=1e-12)
    assert all(0.0 <= v <= max(LEVELS) for v in got.values())
    grid = np.round(np.arange(0.0, 0.901, 0.05), 6)
    best = min(_loss(sens, dict(zip(KEYS, c))) for c in itertools.product(grid, repeat=4)
               if block_skip(dict(zip(KEYS, c)), WEIGHTS) >= skip - 1e-12)
    assert _loss(sens, got) <= best + 1e-9


def test_allocate_skips_prices_noise_and_goes_uniform_past_the_levels():
    """Negative or decreasing measured increases (noise) cost nothing but buy nothing either; a free
    kind is skipped first; a budget beyond the measured levels is the uniform level."""
    d = {"attn_in": [-0.01] * 9, "o_in": [0.5] * 9, "mlp_in": [1.0] * 9, "down_in": [2.0, 1.0] + [3.0] * 7}
    sens = Sensitivity(LEVELS, d, 3.0)
    got = allocate_skips(sens, WEIGHTS, 0.1)
    assert got["attn_in"] == pytest.approx(0.1 * 40 / 7) and got["mlp_in"] == got["down_in"] == got["o_in"] == 0.0
    assert allocate_skips(sens, WEIGHTS, 0.95) == {k: 0.95 for k in KEYS}
    with pytest.raises(DejavuError, match="skip must be in"):
        allocate_skips(sens, WEIGHTS, 1.0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("skip", [0.25, 0.4, 0.5])
def test_refine_skips_never_worse_than_its_start_and_keeps_the_bytes(seed, skip):
    """On a loss where the kinds interact (the separate curves plus cross terms and noise), the
    refinement returns skips no worse than its start on that same loss, at the start's bytes, within
    its evaluation cap; and where the start is off the joint optimum it moves toward it."""
    sens = _random_sensitivity(seed)
    rng = np.random.default_rng(100 + seed)
    cross = rng.uniform(0, 2, (len(KEYS), len(KEYS)))
    calls = []

    def nll(s):
        x = np.array([s[k] for k in KEYS])
        tilt = 100.0 * (s[KEYS[0]] - s[KEYS[1]])  # an interaction: attn_in's skip costs more, o_in's less
        calls.append((dict(s), 3.0 + _loss(sens, s) + float(x @ cross @ x) + tilt + float(rng.normal(0, 1e-3))))
        return calls[-1][1]

    start = allocate_skips(sens, WEIGHTS, skip)
    refined, first, last, used, measured = refine_skips(nll, start, WEIGHTS, evals=24)
    assert measured == len(calls) <= used <= 24 and calls[0] == (start, first)
    assert len({tuple(round(c[k], 9) for k in KEYS) for c, _ in calls}) == len(calls)  # none measured twice
    assert last <= first and (refined, last) in calls and last == min(v for _, v in calls)
    assert block_skip(refined, WEIGHTS) == pytest.approx(skip, abs=1e-12)
    assert all(0.0 <= refined[k] <= 0.95 for k in KEYS) and all(0.0 <= c[k] <= 0.95 for c, _ in calls for k in KEYS)
    if start[KEYS[0]] > 0:  # the tilt moves the optimum off the separate curves' allocation
        assert last < first and refined[KEYS[0]] < start[KEYS[0]]


def _refine_every_candidate(nll, skips, weights, evals, step=0.05):
    """refine_skips as it was before it remembered its candidates (every candidate measured, a
    revisited one again): the reference its memoized search must reproduce."""
    best = dict(skips)
    start = best_nll = nll(best)
    used = 1
    while used < evals and step > 1e-3:
        kept = False
        for a in KEYS:
            for b in KEYS:
                while a != b and used < evals:
                    cand = dict(best)
                    moved = step * min(weights[a], weights[b])
                    cand[a] += moved / weights[a]
                    cand[b] -= moved / weights[b]
                    if cand[a] > 0.95 or cand[b] < 0.0:
                        break
                    got = nll(cand)
                    used += 1
                    if got >= best_nll:
                        break
                    best, best_nll, kept = cand, got, True
        if not kept:
            step /= 2
    return best, start, best_nll, used


def test_refine_skips_returns_what_measuring_every_candidate_did_with_fewer_calls():
    """On deterministic losses with interactions and a rough, noise-like term (a fixed function of
    the skips, as a held-out NLL is), the memoized search returns the skips, start and end losses and
    candidate count of the search that measured every candidate, and calls the loss exactly once per
    distinct candidate of that search: fewer calls wherever that search met a candidate twice."""
    saved = 0
    for seed, (skip, evals) in itertools.product(range(6), [(0.25, 24), (0.4, 24), (0.5, 40)]):
        sens = _random_sensitivity(seed)
        rng = np.random.default_rng(200 + seed)
        cross, freq = rng.uniform(0, 2, (len(KEYS), len(KEYS))), rng.uniform(50, 200, len(KEYS))

        def loss(s):
            x = np.array([s[k] for k in KEYS])
            return 3.0 + _loss(sens, s) + float(x @ cross @ x) + 0.01 * float(np.sin(freq @ x)) + 5.0 * (x[0] - x[1])

        old_calls, new_calls = [], []
        start = allocate_skips(sens, WEIGHTS, skip)
        old = _refine_every_candidate(lambda s: old_calls.append(dict(s)) or loss(s), start, WEIGHTS, evals)
        refined, first, last, used, measured = refine_skips(lambda s: new_calls.append(dict(s)) or loss(s), start,
                                                            WEIGHTS, evals)
        assert (refined, first, last, used) == old and len(old_calls) == used
        distinct = {tuple(round(c[k], 9) for k in KEYS) for c in old_calls}
        assert measured == len(new_calls) == len(distinct) <= len(old_calls)
        saved += len(old_calls) - len(new_calls)
    assert saved >= 10, saved


def test_measured_sensitivity_is_the_held_out_loss_increase_of_one_kind():
    """Each entry equals the mean NLL of the masked model (inputs zeroed by hand, float64) minus
    the dense one, over the same windows."""
    from dejavu.compiler.gated_sparsity import calibrate

    model = tiny_llama(seed=2).double()
    ids = torch.randint(0, 320, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        calib = calibrate(model, torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(2)))
    sens = measure_sensitivity(model, calib, ids, levels=(0.3, 0.7))

    def nll(mask_key=None, s=0.0):
        handles = []
        if mask_key is not None:
            th = kind_thresholds(calib, {k: (s if k == mask_key else 0.0) for k in KEYS})
            for l, layer in enumerate(model.layers):
                at, mlp = layer.self_attn, layer.mlp
                mods = {"attn_in": [at.q_proj, at.k_proj, at.v_proj], "o_in": [at.o_proj],
                        "mlp_in": [mlp.gate_proj, mlp.up_proj], "down_in": [mlp.down_proj]}[mask_key]
                t = th[mask_key][l]
                handles += [m.register_forward_pre_hook(lambda m, a, t=t: (a[0] * (a[0].abs() > t),)) for m in mods]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids)[:, :-1], -1)
        for h in handles:
            h.remove()
        return float(-logp.gather(-1, ids[:, 1:, None]).mean())

    dense = nll()
    assert sens.dense_nll == pytest.approx(dense, abs=1e-10) and heldout_nll(model, ids) == pytest.approx(dense)
    for k in KEYS:
        for i, s in enumerate((0.3, 0.7)):
            assert sens.delta[k][i] == pytest.approx(nll(k, s) - dense, abs=1e-10)
    assert sens.delta["mlp_in"][1] != pytest.approx(0.0, abs=1e-6)  # the masks change the loss


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny", seed=3)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Each test's own sensitivity cache."""
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_second_build_reads_the_sensitivity_and_builds_the_same_engine(folder, tmp_path, monkeypatch, cache):
    """The sensitivity table is cached by model, calibration and held-out tokens: a build at another
    budget measures none of it again, and a build from the cache equals the one that measured it
    (same header figures, thresholds and tensors); another held-out set measures anew."""
    import dejavu.compiler.allocate_llama as al

    calls = []
    measure = al.measure_sensitivity
    monkeypatch.setattr(al, "measure_sensitivity", lambda *a, **k: calls.append(1) or measure(*a, **k))
    heads, tensors = [], []
    for i, density in enumerate((0.6, 0.7, 0.6)):
        build_engine(folder, BuildConfig(density=density, **CALIB), tmp_path / f"{i}.engine", progress=False)
        h, t = read_engine(tmp_path / f"{i}.engine")
        heads.append(h)
        tensors.append(t)
    assert len(calls) == 1 and len(list((cache / "sensitivity").glob("llama-*.json"))) == 1
    a, b = heads[0], heads[2]
    assert a["sparsity"] == b["sparsity"] and all(torch.equal(tensors[0][k], tensors[2][k]) for k in tensors[0])
    ra, rb = dict(a["build_config"]["heldout"]), dict(b["build_config"]["heldout"])
    assert ra.pop("refinement", {}).get("evals") == rb.pop("refinement", {}).get("evals") and ra == rb
    assert heads[1]["build_config"]["heldout"]["sensitivity"] == ra["sensitivity"]
    build_engine(folder, BuildConfig(density=0.6, **{**CALIB, "heldout_tokens": 128}), tmp_path / "x.engine",
                 progress=False)
    assert len(calls) == 2


@pytest.mark.parametrize("allocation", ["sensitivity", "uniform"])
def test_density_build_records_its_allocation_within_the_budget(folder, tmp_path, allocation):
    path = tmp_path / "x.engine"
    build_engine(folder, BuildConfig(density=0.6, allocation=allocation, **CALIB), path, progress=False)
    h, _ = read_engine(path)
    bc, sp = h["build_config"], h["sparsity"]
    assert bc["bytes_per_token"]["fraction"] <= 0.6 + 1e-6 and bc["density"] == 0.6
    assert bc["bytes_per_token"]["fraction"] == pytest.approx(0.6, abs=1e-5)
    held = bc["heldout"]
    assert held["skips"] == pytest.approx(sp["skips"]) and held["tokens"] > 0
    assert held["increase_pct"] == pytest.approx(100 * (held["engine_ppl"] / held["dense_ppl"] - 1), abs=0.01)
    if allocation == "uniform":
        assert len(set(sp["skips"].values())) == 1 and "sensitivity" not in held and bc["allocation"] == "uniform"
    else:  # measured on the first held-out set, checked against the uniform level on the second
        assert len(held["sensitivity"]["delta"]["mlp_in"]) == 9
        check = held["allocation_check"]
        assert bc["allocation"] == check["kept"]
        kept = check["sensitivity_pct" if check["kept"] == "sensitivity" else "uniform_pct"]
        assert kept == min(check["sensitivity_pct"], check["uniform_pct"]) == held["increase_pct"]
        ref = held["refinement"]  # the joint refinement on the first set: never worse than its start there
        assert ref["refined_pct"] <= ref["start_pct"] and 1 < ref["evals"] <= bc["settings"]["refine_evals"]


def test_max_ppl_increase_build_is_within_p_on_the_held_out_windows(folder, tmp_path, capsys):
    from dejavu.compiler.cli import main

    path = tmp_path / "x.engine"
    assert main([str(folder), "--max-ppl-increase", "2", "-o", str(path), "-q", "--calib-tokens", "512",
                 "--calib-window", "128", "--heldout-tokens", "256", "--dtype", "float32"]) == 0
    h, _ = read_engine(path)
    out = capsys.readouterr().out
    assert f"({h['build_config']['heldout']['increase_pct']:+.2f}%)" in out and "TEAL, " in out
    bc = h["build_config"]
    assert bc["heldout"]["increase_pct"] <= 2.0 and bc["settings"]["max_ppl_increase"] == 2.0
    assert 0 < h["sparsity"]["skip"] < 0.9  # a budget was found, not dense and not the least
    assert bc["density"] == pytest.approx(bc["bytes_per_token"]["fraction"], abs=1e-5)


@pytest.mark.parametrize("argv,match", [
    (["--max-ppl-increase", "-1"], "max-ppl-increase"),
    (["--max-ppl-increase", "abc"], "max-ppl-increase"),
    (["--density", "0.6", "--max-ppl-increase", "1"], "not both"),
    (["--density", "0.6", "--allocation", "greedy"], "allocation"),
    (["--density", "0.6", "--refine-evals", "-1"], "refine-evals"),
])
def test_bad_budget_options_are_one_line_and_no_file(folder, tmp_path, capsys, argv, match):
    from dejavu.compiler.cli import main

    out = tmp_path / "x.engine"
    with pytest.raises(SystemExit) as e:
        main([str(folder), *argv, "-o", str(out), "-q", "--calib-tokens", "256"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("dejavu: error:") and match in err[0]
    assert not out.exists()
