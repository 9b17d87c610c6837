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

    python3 benchmarks/head_persistence.py --random-shape opt-30b [--densities 0.3,0.5] [--plot F.png]

The same for the speed benchmarks' engines (benchmarks/e2e.py's random weights and random predictors
of a released shape, a random prompt of --prompt-len tokens, on the GPU when there is one, eager so
that every step's sets are seen): how many of a step's layers have a selected head past 15 slots
(the finishing kernel's slow path in that layer) or past 31, step by step (--plot draws it).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SLOW_AFTER = 15  # settings.qkv_b1 SHARED_P - 1: missing slots the partial kernel holds (folded / refresh routes)
WIDE_AFTER = 31  # SHARED_P_UNFOLDED - 1: the same on batch 1's unfolded route


def gap_stats(sets: list[list[torch.Tensor]], num_heads: int) -> dict:
    """sets[step][layer]: selected heads (1-D) of each decode step (steps in order, one
    sequence). The prefill fills every head, so before step 0 each head is up to date."""
    n_layers = len(sets[0])
    gaps, turnover = [], []
    layer_max = torch.zeros(len(sets), n_layers, dtype=torch.long)  # [step, layer]: the largest gap
    for l in range(n_layers):
        last = torch.full((num_heads,), -1, dtype=torch.long)  # step of the last selection (-1: prefill)
        prev = None
        for t, step in enumerate(sets):
            h = step[l].long()
            gap = t - 1 - last[h]  # slots missed between the last selection and this one
            gaps.append(gap)
            if gap.numel():
                layer_max[t, l] = gap.max()
            last[h] = t
            if prev is not None:
                turnover.append(1.0 - torch.isin(h, prev).float().mean().item())
            prev = h
    g = torch.cat(gaps).float()
    return {"selections": int(g.numel()), "mean_gap": g.mean().item(), "frac_gap": (g > 0).float().mean().item(),
            f"frac_gap_over_{SLOW_AFTER}": (g > SLOW_AFTER).float().mean().item(),
            f"frac_gap_over_{WIDE_AFTER}": (g > WIDE_AFTER).float().mean().item(),
            # layer-steps with a head past the partials: the finishing kernel's slow path runs there
            f"frac_layer_steps_over_{SLOW_AFTER}": (layer_max > SLOW_AFTER).float().mean().item(),
            f"frac_layer_steps_over_{WIDE_AFTER}": (layer_max > WIDE_AFTER).float().mean().item(),
            f"layers_over_{SLOW_AFTER}_by_step": (layer_max > SLOW_AFTER).sum(1).tolist(),
            "turnover": sum(turnover) / max(1, len(turnover))}


def random_sets(steps: int, ks: list[int], num_heads: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randperm(num_heads, generator=g)[:k] for k in ks] for _ in range(steps)]


def passages(n: int, words: int) -> list[str]:
    text = (ROOT / "dejavu" / "data" / "wikitext-2" / "test.txt").read_text(encoding="utf-8")
    paras = [p.strip() for p in text.split("\n") if len(p.split()) >= words and not p.strip().startswith("=")]
    return [" ".join(p.split()[:words]) for p in paras[:: max(1, len(paras) // n)][:n]]


def recorded_sets(eng, prompt, new_tokens: int, layers: list[int]) -> list[list[torch.Tensor]]:
    """Every decode step's head sets of `layers` (CPU tensors) while eng generates greedily (eager)."""
    dec = eng.decoder
    sets: list[list[torch.Tensor]] = []
    step = dec.decode_step

    def recording(tokens, pos):
        out = step(tokens, pos)
        sets.append([dec.pred.idx[l]["attn"].reshape(-1).to("cpu", copy=True) for l in layers])
        return out

    dec.decode_step = recording
    try:
        with torch.inference_mode():
            eng.generate([prompt], new_tokens, stop_at_eos=False)
    finally:
        dec.decode_step = step
    return sets


def run_engine(path: str, prompts: list[str], new_tokens: int) -> dict:
    from dejavu.runtime import Engine

    eng = Engine.load(path, "cpu")
    spec = eng.spec
    layers = [l for l in range(spec.num_layers) if spec.sparse_attn(l)]
    if not layers:
        raise SystemExit(f"{path}: no sparse-attention layer (attention density 1.0)")
    trained, rand = [], []
    for i, prompt in enumerate(prompts):
        sets = recorded_sets(eng, prompt, new_tokens, layers)
        trained.append(gap_stats(sets, spec.num_heads))
        rand.append(gap_stats(random_sets(len(sets), [s.numel() for s in sets[0]], spec.num_heads, seed=i),
                              spec.num_heads))

    def mean(rows):
        return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    ks = sorted({int(spec.attn_k[l]) for l in layers})
    return {"engine": path, "num_heads": spec.num_heads, "sparse_attn_layers": len(layers), "heads_kept": ks,
            "trained": mean(trained), "random": mean(rand), "per_prompt": {"trained": trained, "random": rand}}


def run_random(shape: str, density: float, prompt_len: int, new_tokens: int, seed: int = 0) -> dict:
    """The speed benchmarks' regime: e2e.py's random-weight engine of `shape` ("tiny" for a small one),
    one random prompt; the GPU if there is one (fp16), else the CPU (fp32)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import e2e
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from dejavu.runtime import Engine

    c = e2e.TINY if shape == "tiny" else e2e.SHAPES[shape]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if dev == "cuda" else torch.float32
    ranks, _ = e2e.default_ranks(c)
    header = e2e.header_for(c, density, str(dtype)[6:], ranks)
    eng = Engine.from_tensors(header, e2e.random_tensors(c, dtype, dev, ranks), dev, use_graphs=False)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, c["vocab_size"], (prompt_len,), generator=g).tolist()
    layers = [l for l in range(eng.spec.num_layers) if eng.spec.sparse_attn(l)]
    sets = recorded_sets(eng, prompt, new_tokens, layers)
    del eng
    H = c["num_attention_heads"]
    return {"shape": shape, "density": density, "device": dev, "num_heads": H, "sparse_attn_layers": len(layers),
            "heads_kept": sorted({int(s.numel()) for s in sets[0]}), "steps": len(sets),
            "random_weights": gap_stats(sets, H),
            "random_sets": gap_stats(random_sets(len(sets), [s.numel() for s in sets[0]], H, seed=seed), H)}


def plot_by_step(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for r in rows:
        ys = r["random_weights"][f"layers_over_{SLOW_AFTER}_by_step"]
        ax.plot(range(len(ys)), ys, lw=1, label=f"{r['shape']} d{r['density']}")
    ax.set_xlabel("decode step (after the prompt)")
    ax.set_ylabel(f"layers with a head > {SLOW_AFTER} slots behind")
    ax.set_title(f"deferred K/V slow path per step (of {rows[0]['sparse_attn_layers']} layers), random weights",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = Path(path).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def main_random(a) -> int:
    rows = [run_random(a.random_shape, float(d), a.prompt_len, a.new_tokens) for d in a.densities.split(",")]
    print(f"| shape, density | steps | selections | gap > {SLOW_AFTER} | gap > {WIDE_AFTER} | layer-steps > "
          f"{SLOW_AFTER} | layer-steps > {WIDE_AFTER} | turnover |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        for kind in ("random_weights", "random_sets"):
            s = r[kind]
            print(f"| {r['shape']} d{r['density']} ({kind}) | {r['steps']} | {s['selections']} | "
                  f"{s[f'frac_gap_over_{SLOW_AFTER}']:.2%} | {s[f'frac_gap_over_{WIDE_AFTER}']:.2%} | "
                  f"{s[f'frac_layer_steps_over_{SLOW_AFTER}']:.1%} | {s[f'frac_layer_steps_over_{WIDE_AFTER}']:.1%} | "
                  f"{s['turnover']:.1%} |")
    if a.plot:
        plot_by_step(rows, a.plot)
    if a.out:
        from dejavu.fileio import write_json

        out = Path(a.out)
        write_json(out, {"prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "results": rows}, indent=1)
        print(f"JSON: {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engines", nargs="*")
    ap.add_argument("--random-shape", default=None, help="e2e.py's random-weight engine of this shape instead")
    ap.add_argument("--densities", default="0.3", help="with --random-shape (comma list)")
    ap.add_argument("--prompt-len", type=int, default=128, help="with --random-shape")
    ap.add_argument("--plot", default=None, help="with --random-shape: layers past the partials per step (PNG)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-words", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.random_shape:
        return main_random(a)
    if not a.engines:
        ap.error("give engine files or --random-shape")
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
        from dejavu.fileio import write_json

        out = Path(a.out)
        write_json(out, res, indent=1)
        print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
