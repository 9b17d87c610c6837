"""Upper bounds, not a form that computes the step: a Llama decode step (random weights, batch 1, the dense graph and
TEAL 50% at the defaults) timed as generate runs it, then again with one part of it left out: the q/k/v sum kernel
(`_sum_rope`: q from a buffer filled before capture, no cache write) or the step's rotary tables (`_rope`: fixed
tables). What a fusion of that part into its neighbours could save at most.
    python3 benchmarks/probe_step_parts.py --out F"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

here = Path(__file__).resolve().parent
sys.path[:] = [q for q in sys.path if Path(q or ".").resolve() != here]
sys.path.append(str(here))
import e2e_llama as E  # noqa: E402

from dejavu.plugins import input_sparse as IS  # noqa: E402
from dejavu.runtime.llama_decoder import LlamaDecoder  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="llama-3-8b,llama-3-70b-tp8")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    dev = torch.device("cuda")
    rows, bufs = [], {}
    real_sum, real_rope = IS._sum_rope, LlamaDecoder._rope

    def no_sum(part, dtype, cos, sin, pos, k_cache, v_cache, *args, **kw):
        B, Hkv, T, hd = k_cache.shape
        H = part.shape[-1] // hd - 2 * Hkv
        return bufs[(B, H, hd, dtype)]

    def fixed_rope(self, positions):  # inside the decode step's capture only (the prefill computes its own)
        if not torch.cuda.is_current_stream_capturing():
            return real_rope(self, positions)
        return bufs[("rope", positions.shape[0])]

    for name in a.models.split(","):
        c = E.SHAPES[name]
        engs, _ = E.engines(c, [0.5], torch.float16, dev, 512)
        for system, s, eng in engs:
            spec = eng.spec
            bufs[(1, spec.num_attention_heads, spec.head_dim, torch.float16)] = torch.randn(
                1, spec.num_attention_heads, spec.head_dim, device=dev, dtype=torch.float16)
            bufs[("rope", 1)] = real_rope(eng.decoder, torch.tensor([130], device=dev))
            for rep in range(a.repeats):
                for part in ("none", "sum_rope", "rope_tables"):
                    IS._sum_rope = no_sum if part == "sum_rope" else real_sum
                    LlamaDecoder._rope = fixed_rope if part == "rope_tables" else real_rope
                    eng.release()
                    t = E.time_engine(eng, c, 128, 128)
                    rows.append({"model": name, "system": system, "left_out": part, "repeat": rep,
                                 "ms_per_step": t["ms_per_step"]})
                    print(name, system, part, rep, f"{t['ms_per_step']:.4f}", flush=True)
            IS._sum_rope, LlamaDecoder._rope = real_sum, real_rope
            eng.release()
        del engs
        E.free(dev)
    meta = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "argv": sys.argv}
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
