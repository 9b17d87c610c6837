"""How often a trained model's head predictors change their choice from token to token.

    python3 benchmarks/head_persistence.py ENGINE [ENGINE ...] [--prompts 4] [--new-tokens 128]

The deferred K/V policy (plugins/deferred_kv.py) computes a head's K/V only when the head is
selected, for every slot it missed since it was last selected (its "gap"). Gaps up to 15 slots
ride along in the Q/K/V kernel's tl.dot; longer ones take the finishing kernel's slow path.
The speed benchmarks run random weights, whose predictors pick heads nearly independently
from step to step; this measures what trained predictors do. Each engine generates greedily
(CPU reference path) from WikiText-2 test passages (dejavu/data); every decode step's head set
of every sparse-attention layer is recorded. Reported per engine: mean gap of a selected head,
the fraction of selections with a gap (> 0) and with a gap over 15 slots, and the fraction of a
step's heads that were not selected the step before (turnover); and the same for independent
uniform random sets of the same sizes over the same steps (the benchmark's regime).
JSON to --out (default: stdout only). Quality-side, CPU: speed is not measured here.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SLOW_AFTER = 15  # QKV_CONFIG_B1 SHARED_P - 1: missing slots handled by the partial kernel


def gap_stats(sets: list[list[torch.Tensor]], num_heads: int) -> dict:
    """sets[step][layer]: selected heads (1-D) of each decode step (steps in order, one
    sequence). The prefill fills every head, so before step 0 each head is up to date."""
    n_layers = len(sets[0])
    gaps, turnover = [], []
    for l in range(n_layers):
        last = torch.full((num_heads,), -1, dtype=torch.long)  # step of the last selection (-1: prefill)
        prev = None
        for t, step in enumerate(sets):
            h = step[l].long()
            gaps.append(t - 1 - last[h])  # slots missed between the last selection and this one
            last[h] = t
            if prev is not None:
                turnover.append(1.0 - torch.isin(h, prev).float().mean().item())
            prev = h
    g = torch.cat(gaps).float()
    return {"selections": int(g.numel()), "mean_gap": g.mean().item(), "frac_gap": (g > 0).float().mean().item(),
            f"frac_gap_over_{SLOW_AFTER}": (g > SLOW_AFTER).float().mean().item(),
            "turnover": sum(turnover) / max(1, len(turnover))}


def random_sets(steps: int, ks: list[int], num_heads: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randperm(num_heads, generator=g)[:k] for k in ks] for _ in range(steps)]


def passages(n: int, words: int) -> list[str]:
    text = (ROOT / "dejavu" / "data" / "wikitext-2" / "test.txt").read_text(encoding="utf-8")
    paras = [p.strip() for p in text.split("\n") if len(p.split()) >= words and not p.strip().startswith("=")]
    return [" ".join(p.split()[:words]) for p in paras[:: max(1, len(paras) // n)][:n]]


def run_engine(path: str, prompts: list[str], new_tokens: int) -> dict:
    from dejavu.runtime import Engine

    eng = Engine.load(path, "cpu")
    spec, dec = eng.spec, eng.decoder
    layers = [l for l in range(spec.num_layers) if spec.sparse_attn(l)]
    if not layers:
        raise SystemExit(f"{path}: no sparse-attention layer (attention density 1.0)")
    trained, rand = [], []
    for i, prompt in enumerate(prompts):
        sets: list[list[torch.Tensor]] = []
        step = dec.decode_step

        def recording(tokens, pos, step=step, sets=sets):
            out = step(tokens, pos)
            sets.append([dec.pred.idx[l]["attn"].reshape(-1).clone() for l in layers])
            return out

        dec.decode_step = recording
        try:
            eng.generate([prompt], new_tokens, stop_at_eos=False)
        finally:
            dec.decode_step = step
        trained.append(gap_stats(sets, spec.num_heads))
        rand.append(gap_stats(random_sets(len(sets), [s.numel() for s in sets[0]], spec.num_heads, seed=i),
                              spec.num_heads))

    def mean(rows):
        return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    ks = sorted({int(spec.attn_k[l]) for l in layers})
    return {"engine": path, "num_heads": spec.num_heads, "sparse_attn_layers": len(layers), "heads_kept": ks,
            "trained": mean(trained), "random": mean(rand), "per_prompt": {"trained": trained, "random": rand}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engines", nargs="+")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-words", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    prompts = passages(a.prompts, a.prompt_words)
    res = {"prompts": prompts, "new_tokens": a.new_tokens, "slow_after": SLOW_AFTER,
           "results": [run_engine(p, prompts, a.new_tokens) for p in a.engines]}
    print("| engine | heads kept / H | selections | mean gap | with a gap | gap > 15 | turnover |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in res["results"]:
        for kind in ("trained", "random"):
            s = r[kind]
            print(f"| {Path(r['engine']).name} ({kind}) | {r['heads_kept']} / {r['num_heads']} | {s['selections']} | "
                  f"{s['mean_gap']:.2f} | {s['frac_gap']:.1%} | {s[f'frac_gap_over_{SLOW_AFTER}']:.1%} | "
                  f"{s['turnover']:.1%} |")
    if a.out:
        out = Path(a.out)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(out)
        print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
