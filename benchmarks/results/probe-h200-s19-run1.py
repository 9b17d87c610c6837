"""Session 19 probe (run 1; the script as it ran, from the repository root after `source
benchmarks/device_env.sh`): (1) the generate loop's per-step cost outside the CUDA graph (argmax,
copies, pos + 1) against bare graph replays; (2) a first census of the deferred K/V slow path
(since then `benchmarks/head_persistence.py --random-shape`). OPT-30B shape, random weights, d0.3."""
import json, os, sys
import torch
sys.path.insert(0, "benchmarks")
import e2e as E
from dejavu.runtime import Engine

OUT = os.environ.get("OUT", ".")
res = {}
c = E.SHAPES["opt-30b"]
ranks, _ = E.default_ranks(c)
t = E.random_tensors(c, torch.float16, "cuda", ranks)
res["copy"] = E.copy_bandwidth()
eng = Engine.from_tensors(E.header_for(c, 0.3, "float16", ranks), t, "cuda", overlap=True,
                          batch_policy="per_sequence", kv_policy="deferred")
P, N = 128, 128
g = torch.Generator().manual_seed(0)
prompts = torch.randint(4, c["vocab_size"], (1, P), generator=g).tolist()
row, _, _ = E.time_engine(eng, c, 1, P, N, 60)
res["generate_ms"] = [row["ms_per_step"]]
dec = eng.decoder


@torch.inference_mode()
def replays(form):
    step = eng.activate(1, P + N)
    ids = torch.tensor(prompts, device="cuda")
    pos = torch.tensor([P], device="cuda")
    logits = dec.prefill(ids, pos)
    gr = eng._graph
    gr.tokens.copy_(logits.argmax(-1))
    gr.pos.copy_(pos)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    p = pos
    for i in range(N - 1):
        if form == "replay":
            gr.graph.replay()
            gr.pos.add_(1)
        elif form == "replay_argmax":
            gr.graph.replay()
            torch.argmax(gr.logits, dim=-1, out=gr.tokens)
            gr.pos.add_(1)
        else:  # what generate does
            nxt = logits.argmax(-1)
            logits = step(nxt, p)
            p = p + 1
    e.record(); e.synchronize()
    return s.elapsed_time(e) / (N - 1)


for form in ("replay", "replay_argmax", "generate_like", "replay", "generate_like"):
    res.setdefault("loop_ms", []).append([form, replays(form)])
lg = torch.randn(1, c["vocab_size"], device="cuda", dtype=torch.float16)
out = torch.empty(1, dtype=torch.long, device="cuda")
gg = torch.cuda.CUDAGraph()
with torch.cuda.graph(gg):
    for _ in range(100):
        torch.argmax(lg, dim=-1, out=out)
gg.replay(); torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record(); gg.replay(); e.record(); e.synchronize()
res["argmax_us"] = s.elapsed_time(e) * 10
# census: eager steps with the predictor trace; each layer's selected heads' missing slots
eng.use_graphs = False
eng._graph = None
dec.pred.trace = []
with torch.inference_mode():
    eng.generate(prompts, N, stop_at_eos=False)
tr = [(l, k, i.reshape(-1).tolist()) for l, k, i in dec.pred.trace if k == "attn"]
dec.pred.trace = None
H = c["num_attention_heads"]
per_layer = {}
for l, k, idx in tr:
    per_layer.setdefault(l, []).append(idx)
res["trace_calls_per_layer"] = {l: len(v) for l, v in list(per_layer.items())[:3]}
census = []
for l, steps in per_layer.items():
    valid = [P] * H
    for i, idx in enumerate(steps):
        pos = P + i
        gaps = [pos - min(valid[h], pos) for h in idx]
        census.append((l, i, max(gaps), sum(g > 15 for g in gaps), sum(gaps)))
        for h in idx:
            valid[h] = pos + 1
res["census"] = {"layer_steps": len(census), "slow_layer_steps": sum(1 for x in census if x[3] > 0),
                 "slow_heads": sum(x[3] for x in census),
                 "by_step": [sum(1 for x in census if x[1] == i and x[3] > 0) for i in range(max(x[1] for x in census) + 1)],
                 "max_gap_hist": {}}
for x in census:
    b = min(x[2], 200) // 10 * 10
    res["census"]["max_gap_hist"][b] = res["census"]["max_gap_hist"].get(b, 0) + 1
json.dump(res, open(os.path.join(OUT, "probe1.json"), "w"), indent=1)
