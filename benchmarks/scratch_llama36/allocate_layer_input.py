"""Knapsack (LP on convexified curves) of per-(layer, input) skips under a byte budget."""
import json, sys
import numpy as np
KEYS = ("attn_in", "o_in", "mlp_in", "down_in")
W = {"attn_in": 576 * (576 + 2 * 192), "o_in": 576 * 576, "mlp_in": 2 * 576 * 1536, "down_in": 1536 * 576}

def hull(xs, ys):
    pts = []
    for p in zip(xs, ys):
        while len(pts) >= 2 and (pts[-1][1] - pts[-2][1]) * (p[0] - pts[-2][0]) >= (p[1] - pts[-2][1]) * (pts[-1][0] - pts[-2][0]):
            pts.pop()
        pts.append(p)
    return pts

def allocate(curves, levels, skip):
    """curves: {key: [L][len(levels)]} NLL increase; levels ascending, first 0. -> {key: [L skips]}."""
    L = len(curves[KEYS[0]])
    segs = []
    for k in KEYS:
        for l in range(L):
            ys = np.maximum.accumulate(np.maximum(np.asarray(curves[k][l], float), 0.0))
            h = hull(levels, ys)
            for (x0, y0), (x1, y1) in zip(h, h[1:]):
                segs.append(((y1 - y0) / ((x1 - x0) * W[k]), k, l, x0, x1))
    segs.sort()
    total = skip * L * sum(W.values())
    s = {k: [0.0] * L for k in KEYS}
    got = 0.0
    for slope, k, l, x0, x1 in segs:
        if got >= total: break
        step = min(x1 - x0, (total - got) / W[k])
        s[k][l] = x0 + step
        got += step * W[k]
    return s

if __name__ == "__main__":
    src, kind, out = sys.argv[1], sys.argv[2], sys.argv[3]  # kind: direct | fisher | diag
    r = json.load(open(src))
    if kind == "direct":
        lv = sorted(r["levels"]); table = {str(s): r["direct"][str(s)] for s in lv}
    else:
        lv = sorted(float(s) for s in r["proxy"]); table = {str(s): r["proxy"][str(s)][kind] for s in lv}
    L = 30
    curves = {k: [[0.0] + [table[str(s)][k][l] for s in lv] for l in range(L)] for k in KEYS}
    levels = [0.0] + lv
    res = {}
    for skip in (0.25, 0.4, 0.5):
        a = allocate(curves, levels, skip)
        res[str(skip)] = a
        print(skip, {k: round(float(np.mean(v)), 3) for k, v in a.items()})
    json.dump(res, open(out, "w"))
