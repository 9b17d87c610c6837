"""Scratch: the gradient channel scale with o_in unscaled, or o_in's scale shared by the query heads of a KV group (foldable into v)."""
import math, sys, torch
from dejavu.compiler.allocate_llama import heldout_nll, kind_thresholds
from dejavu.compiler.gated_sparsity import KEYS, calibrate
from dejavu.datafiles import CALIB_TEXT
from dejavu.runtime.evaluation.evaluate import load_scoring_model, read_text, text_ids
torch.set_num_threads(1)
sm = load_scoring_model("smollm2-135m"); model = sm.info["model"]; cfg = model.config
ids = text_ids(sm, read_text(CALIB_TEXT), 14336)
cal_ids, ho = ids[:8192].view(-1, 512), ids[12288:14336].view(-1, 512)
g = torch.load("/tmp/36w/gradscales_16.pt")["mabs"]
H, Hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
def group(c):  # [H*hd] -> geometric mean over the H/Hkv query heads of each KV head, repeated
    c = c.view(Hkv, H // Hkv, hd).log().mean(1, keepdim=True).exp()
    return c.expand(Hkv, H // Hkv, hd).reshape(-1)
variants = {"o_abs": {**g, "o_in": [torch.ones_like(c) for c in g["o_in"]]},
            "o_group": {**g, "o_in": [group(c) for c in g["o_in"]]}}
dense = heldout_nll(model, ho)
for v in sys.argv[1].split(","):
    cal = calibrate(model, cal_ids, variants[v])
    for s in [float(x) for x in sys.argv[2:]]:
        nll = heldout_nll(model, ho, kind_thresholds(cal, {k: s for k in KEYS}), cal.scales)
        print(f"grad-{v} uniform {s}: ppl {math.exp(nll):.3f} {100*(math.exp(nll-dense)-1):+.2f}%", flush=True)
