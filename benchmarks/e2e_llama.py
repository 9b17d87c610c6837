"""Llama decode speed on one GPU: TEAL engines against our dense CUDA graph and Hugging Face eager.

    source benchmarks/device_env.sh && python benchmarks/e2e_llama.py --out $OUT/e2e_llama.json

Shapes (fp16, RANDOM weights: latency does not depend on the values; no such weights can be
downloaded here):
  llama-3-8b      meta-llama/Meta-Llama-3-8B's config.json: 32 layers, hidden 4096, 32 / 8 KV
                  heads, SwiGLU 14336, vocabulary 128256, untied head
  llama-3-70b-tp8 one GPU's shard of Llama-3-70B under 8-way tensor parallelism (80 layers,
                  hidden 8192; per rank 8 query heads / 1 KV head of 128, SwiGLU 28672 / 8 = 3584,
                  a vocabulary-parallel head of 128256 / 8 rows): every weight one rank reads per
                  token. The all-reduces (2 per layer) are not run: this is the per-GPU weight
                  stream, a lower bound of a TP decode step.
  qwen2-7b        Qwen/Qwen2-7B's config.json: 28 layers, hidden 3584, 28 / 4 KV heads of 128, SwiGLU
                  18944, vocabulary 152064, untied head, q/k/v biases (added in the q/k/v sum kernel)
  qwen3-8b        Qwen/Qwen3-8B's config.json: 36 layers, hidden 4096, 32 / 8 KV heads of 128, SwiGLU 12288,
                  vocabulary 151936, untied head, each q and k head's RMSNorm (in the q/k/v sum kernel)
  phi-4-mini      microsoft/Phi-4-mini-instruct's config.json: 32 layers, hidden 3072, 24 / 8 KV heads of 128 with
                  RoPE over 96 of them (partial rotary), SwiGLU 8192, vocabulary 200064, tied head, LongRoPE past
                  4096 positions (its factors set to 1 here: the timing is the same)
Systems, batch 1, --prompt-len 128 prompt tokens, --new-tokens 128 new (greedy, no EOS stop):
  hf_eager       transformers LlamaForCausalLM fp16, eager, model.generate (dynamic cache)
  hf_static_compile (--hf-compile) the same model with a StaticCache, the one-token forward under torch.compile
                 (inductor, mode reduce-overhead: CUDA graphs), the decode loop of transformers' "LLM inference
                 optimization" guide; its greedy tokens compared with model.generate's (tokens_agree)
  dense_graph    our Llama decode step, dense (thresholds 0), one CUDA graph per step: PyTorch's RMSNorm, products
                 and SwiGLU, the GQA attention kernel, q/k/v's bias, heads' norms, RoPE and cache writes in the sum
                 kernel the sparse step uses (since 21ab4d1; before it, separate PyTorch ops)
  teal_s{S}      TEAL at S of every projection input skipped (--skips, default 0.25,0.4,0.5):
                 plugins/input_sparse kernels (per-split selects fused with RMSNorm / SwiGLU, the pairs'
                 GEMV, fused split-K sums), CUDA graph
  teal_s0.5+K=V  the same at --variant-skip with other kernel blocks (--kernel-variants: a sweep of
                 InputSparseSettings fields over the defaults, or of another KernelSettings part's fields as
                 {"pdl": {...}}; {"gqa_attn": {"kernel": false}}: the step's attention by PyTorch's masked SDPA
                 over the whole cache instead of plugins/gqa_attention; {"projections": []}: one table for
                 every projection kind), recorded in the engine header as a build would (an entry that is not
                 settings is one argparse line before anything runs);
                 on the --variant-models only, and only while the run is inside --budget-s (later ones are
                 recorded as skipped)
Tune (--tune, GPU): on the --variant-models, runtime/tune.py's search from the defaults at --variant-skip (its
trials recorded), then teal_s{S}+tuned timed as the others, then teal_s{S} (again): the two timings of the
defaults' engine bound the drift.
Profile (--profile-steps N, GPU): the dense graph and teal_s{--variant-skip} at the default blocks (with
--profile-variants the variants too), N
graph replays under torch.profiler (benchmarks/profile_decode.profile_steps: per-kernel GPU time and
launches per step, the main-stream timeline) and one decoder layer's kernels in order (its anchor: a
kernel launched once per layer, the attention where it is one), beside the layer's weight floor.
Thresholds are quantiles of each projection input on random calibration tokens through the same
model (compiler/gated_sparsity.calibrate, the compiler's own path); the skip realized on the
decode steps is counted in an untimed pass (reference ops) and reported. Floor: bytes a step must
read (weights at the realized skip + the KV cache) / the copy bandwidth measured in this run, and
/ the nominal HBM bandwidth (--peak-GBps, H200: 4800).

A smoke check runs first (tiny random model, fp32): the kernels vs the reference ops, graph vs
eager. Raw JSON to --out, rewritten after every measurement; a table on stdout. --device cpu
runs the whole driver on tiny shapes with reference ops (what tests/test_benchmark_e2e_llama.py
does). Benchmarks assert nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

SHAPES = {
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, intermediate_size=14336, rope_theta=500000.0),
    "llama-3-70b-tp8": dict(vocab_size=128256 // 8, hidden_size=8192, num_hidden_layers=80, num_attention_heads=8,
                            num_key_value_heads=1, head_dim=128, intermediate_size=28672 // 8, rope_theta=500000.0),
    "qwen2-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, head_dim=128, intermediate_size=18944,
                     rope_theta=1000000.0),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                     rope_theta=1000000.0),
    "phi-4-mini": dict(model_type="phi3", vocab_size=200064, hidden_size=3072, num_hidden_layers=32,
                       num_attention_heads=24, num_key_value_heads=8, head_dim=128, intermediate_size=8192,
                       rope_theta=10000.0, partial_rotary_factor=0.75, tie_word_embeddings=True,
                       max_position_embeddings=131072, original_max_position_embeddings=4096,
                       rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 48, long_factor=[1.0] * 48)),
    # HuggingFaceTB/SmolLM3-3B's config (every 4th layer without RoPE) and ibm-granite/granite-3.1-8b-instruct's (its
    # multipliers are folded into the weights on load: the shape alone, random weights)
    "smollm3-3b": dict(model_type="smollm3", vocab_size=128256, hidden_size=2048, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=128, intermediate_size=11008,
                       rope_theta=5000000.0, tie_word_embeddings=True, no_rope_layer_interval=4),
    "granite-3-8b": dict(model_type="granite", vocab_size=49155, hidden_size=4096, num_hidden_layers=40,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12800,
                         rope_theta=10000000.0, tie_word_embeddings=True, attention_multiplier=128 ** -0.5),
    "tiny": dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=320, rope_theta=10000.0),
}
# the A/B around the defaults at --variant-skip (KernelSettings parts' fields over them): the attention by PyTorch's
# masked SDPA (gqa_attn.kernel off); the kernel's tiles of 64 slots, at most 4 splits a row, twice the programs
# (at max_seq 256 its default is 8 tiles of 32, one split each: the 70B TP-8 rank, G = 8 heads of one KV head, runs
# 8 programs a layer); gate/up at the table's block_k 128 (no per-projection settings), narrower blocks, more
# programs; the fp16 residual stream, o's and down's splits summed by their launches (bit-reproducible)
VARIANTS = [{"gqa_attn": {"kernel": False}}, {"gqa_attn": {"block_s": 64}}, {"gqa_attn": {"max_splits": 4}},
            {"gqa_attn": {"target_programs": 264, "max_splits": 64}}, {"projections": []}, {"block_m": 32},
            {"target_programs": 1056}, {"fp32_residual": False}]
COMMON = dict(model_type="llama", hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-5,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


class Run:
    """Results; the JSON is rewritten after every record."""

    def __init__(self, out: Path, meta: dict):
        self.out, self.data = out, {"meta": meta, "smoke": None, "bandwidth": None, "results": [], "errors": [],
                                    "skipped": []}

    def save(self):
        from dejavu.fileio import write_json

        self.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.out, self.data, indent=1, default=str)

    def add(self, key, value):
        self.data[key].append(value) if isinstance(self.data[key], list) else self.data.__setitem__(key, value)
        self.save()


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(dev, nbytes: int = 2 << 30, reps: int = 20) -> dict:
    """Device-to-device copy: (bytes read + bytes written) / median time."""
    if dev.type != "cuda":
        nbytes, reps = 16 << 20, 3
    x = torch.empty(nbytes // 2, dtype=torch.float16, device=dev).normal_()
    y = torch.empty_like(x)
    times = []
    for _ in range(reps + 3):
        sync(dev)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(dev)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times[3:])
    return {"copy_GBps": 2 * nbytes / t / 1e9, "bytes": nbytes, "median_s": t}


def random_model(c: dict, dtype, dev, seed: int = 0):
    """dejavu.models.llama.LlamaForCausalLM of shape c, seeded random weights (norms 1), on dev."""
    from dejavu.models.llama import LlamaConfig, LlamaForCausalLM, rope_inv_freq

    cfg = LlamaConfig.from_hf_dict({**COMMON, **c})
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters made in dtype: no fp32 copy of an 8B model on the device
    try:
        with torch.device("meta"):
            m = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    m = m.to_empty(device=dev)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    m.inv_freq = rope_inv_freq(cfg).to(dev)
    return m.eval()


def engines(c: dict, skips: list[float], dtype, dev, calib_tokens: int, backend=None, variants=(),
            variant_skip: float = 0.5) -> tuple[list, dict]:
    """[(system, skip, LlamaEngine)] sharing one weight set (skip 0: the dense graph), then one engine
    per kernel-settings variant (InputSparseSettings fields over the defaults, recorded in the header
    as a build would) at variant_skip (the DejavuError in its place where its load-time kernel check refuses it);
    and the calibration record."""

    from dejavu.compiler.config import BuildConfig
    from dejavu.compiler.build import target_info
    from dejavu.plugins import InputSparseSettings
    from dejavu.compiler.build_llama import (INPUTS, _Blocks, density_for_skip, llama_header, llama_tensors)
    from dejavu.compiler.gated_sparsity import calibrate
    from dejavu.errors import DejavuError
    from dejavu.runtime import Engine

    model = random_model(c, dtype, dev)
    cfg = model.config
    ids = torch.randint(4, cfg.vocab_size, (1, calib_tokens), generator=torch.Generator().manual_seed(1)).to(dev)
    with torch.no_grad():
        cal = calibrate(_Blocks(model), ids)
    tensors = llama_tensors(model, dtype, dev)
    del model
    free(dev)
    dname = str(dtype).replace("torch.", "")
    out = []
    runs = [(("dense_graph" if s == 0 else f"teal_s{s:g}"), s, {}) for s in [0.0] + skips]
    runs += [(f"teal_s{variant_skip:g}+" + ",".join(f"{k}={v}" for k, v in sorted(v.items())), variant_skip, v)
             for v in variants]
    for system, s, variant in runs:
        th = {k: [cal.threshold(k, l, s) if s > 0 else 0.0 for l in range(cfg.num_hidden_layers)] for k in INPUTS}
        bc = BuildConfig(density=min(1.0, round(density_for_skip(cfg, s), 6)), dtype=dname)
        target = target_info(str(dev))  # the settings a build records, the variant's input_sparse fields over them
        ks = target["kernel_settings"] or {"input_sparse": dataclasses.asdict(InputSparseSettings())}
        target["kernel_settings"] = with_variant(ks, variant)
        header = llama_header(f"random-{c['hidden_size']}", cfg, bc, target, {k: s for k in INPUTS}, th,
                              {"corpus": "random tokens", "n_tokens": calib_tokens}, "")
        try:
            out.append((system, s, Engine.from_tensors(header, tensors, device=dev, backend=backend)))
        except DejavuError as e:  # a variant its load-time kernel check refuses: recorded, the others run
            if not variant:
                raise
            out.append((system, s, e))
    return out, {"tokens": calib_tokens, "source": "uniform random token ids"}


def with_variant(ks: dict, variant: dict) -> dict:
    """Kernel settings as a header holds them (ks) with a variant's fields over them: {"pdl": {...}} over that
    part's fields, the others over input_sparse's."""
    parts = {k: v for k, v in variant.items() if isinstance(v, dict)}
    ks = {**ks, **{k: {**ks.get(k, {}), **v} for k, v in parts.items()}}
    return {**ks, "input_sparse": {**ks["input_sparse"], **{k: v for k, v in variant.items() if k not in parts}}}


def check_variants(variants) -> str | None:
    """Why a --kernel-variants entry is not settings an engine would run (None: all are): an unknown part, field
    or projection would leave that engine on the defaults (the runtime falls back, logging a line), and a field
    that older headers held would be dropped as they load."""
    from dejavu.errors import DejavuError
    from dejavu.plugins import DEFAULT, KernelSettings, resolve_projection_settings

    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
        return "expected a JSON list of objects"
    for v in variants:
        try:
            got = KernelSettings.from_dict(with_variant(DEFAULT.to_dict(), v))
            resolve_projection_settings(got)
        except DejavuError as e:
            return f"{json.dumps(v)}: {e}"
        kept = json.loads(json.dumps(got.to_dict()))  # tuples as the variant's JSON lists
        fields = [(k, f, x) for k, p in v.items() if isinstance(p, dict) for f, x in p.items()]
        fields += [("input_sparse", k, x) for k, x in v.items() if not isinstance(x, dict)]
        lost = [f"{k}.{f}" for k, f, x in fields if kept.get(k, {}).get(f, object()) != x]
        if lost:
            return f"{json.dumps(v)}: {', '.join(lost)} not kept (a field of older headers, dropped as they load)"
    return None


class _CountingOps:
    """LlamaOps' reference `linear` that also counts the weight elements it would read."""

    def __init__(self):
        from dejavu.runtime.llama_decoder import LlamaOps

        self.ref = LlamaOps("ref")
        self.kernels, self.read, self.dense = self.ref.kernels, 0.0, 0.0
        self.attn_kernel = False  # the step's attention as the reference ops run it (masked SDPA)
        self.fp32_residual = False

    def linear(self, x, w_t, t, norm=None, swiglu=False, residual=None, kind="o"):
        from dejavu.plugins.input_sparse import produce_ref

        h = produce_ref(x, *(norm or (None, 0.0)), swiglu=swiglu)
        kept = float((h.float().abs() > t).float().mean()) if t > 0 else 1.0
        self.read += kept * w_t.numel()
        self.dense += w_t.numel()
        return self.ref.linear(x, w_t, t, norm, swiglu, residual, kind=kind)

    def attend_project(self, q, k_cache, v_cache, pos, mask, wo_t, t, residual):
        from dejavu.plugins.gqa_attention import gqa_decode_ref

        return self.linear(gqa_decode_ref(q, k_cache, v_cache, pos, mask), wo_t, t, residual=residual)

    def mlp(self, x, wgu_t, wd_t, t_in, t_down, norm, bgu=None):
        gu = self.linear(x, wgu_t, t_in, norm=norm)
        return self.linear(gu if bgu is None else gu + bgu, wd_t, t_down, swiglu=True, residual=x)

    def qkv_rope(self, x, w_t, t, norm, cos, sin, pos, k_cache, v_cache, rows, bias=None, qk_norm=None, rot=None):
        from dejavu.plugins.input_sparse import sliced_qkv_rope_ref

        qkv = self.linear(x, w_t, t, norm)
        return sliced_qkv_rope_ref(qkv if bias is None else qkv + bias, cos, sin, pos, k_cache, v_cache, rows, qk_norm,
                                   rot)


def realized_skip(eng, c: dict, P: int, steps: int) -> float:
    """Fraction of block projection bytes skipped on `steps` decode steps after a P-token prompt
    (a second decoder on the engine's weights with counting reference ops; untimed)."""
    from dejavu.runtime.llama_decoder import LlamaDecoder

    ops = _CountingOps()
    dec = LlamaDecoder(eng.spec, eng.tensors, eng.device, ops)
    ids = torch.randint(4, c["vocab_size"], (1, P + steps), generator=torch.Generator().manual_seed(7)).to(eng.device)
    with torch.inference_mode():
        dec.setup(1, P + steps)
        dec.prefill(ids[:, :P], torch.tensor([P], device=eng.device))
        for i in range(steps):
            dec.decode_step(ids[:, P + i], torch.tensor([P + i], device=eng.device))
    dec.release()
    return 1.0 - ops.read / ops.dense


def time_engine(eng, c: dict, P: int, N: int) -> dict:
    """Decode latency per step of Engine.generate (one CUDA-graph replay per step on the GPU)."""
    prompts = torch.randint(4, c["vocab_size"], (1, P), generator=torch.Generator().manual_seed(0)).tolist()
    eng.activate(1, P + N)
    eng.generate(prompts, 8, stop_at_eos=False)  # warm-up: capture, compile
    eng.generate(prompts, N, stop_at_eos=False)
    st = eng.stats
    return {"ms_per_step": st.ms_per_token, "tokens_per_s": st.tokens_per_s, "prefill_ms": 1e3 * st.prefill_s,
            "steps": st.decode_steps, "cuda_graph": eng.use_graphs, "kernels": dict(eng.ops.kernels)}


def _layer_anchor(layers: int):
    """profile_steps' anchor picker: a kernel launched once per layer per step, the attention if it is one."""
    def pick(rows) -> str:
        once = [k for k, _, n in rows if abs(n - layers) < 1e-6]
        att = [k for k in once if any(w in k.lower() for w in ("fmha", "attention", "flash", "sdpa", "softmax",
                                                             "_gqa_split"))]
        return (att or once or [""])[0]
    return pick


def profile_engine(eng, c: dict, P: int, steps: int, bw_GBps: float, skip: float) -> dict:
    """Per-kernel GPU time of `steps` graph replays and one layer's timeline (GPU only); the weight bytes
    of one layer at `skip` over the copy bandwidth as `layer_floor_us`."""
    import importlib.util

    from dejavu.compiler.build_llama import step_bytes
    from dejavu.models.llama import LlamaConfig

    here = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location("profile_decode", here / "profile_decode.py")
    pd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pd)
    step = eng.activate(1, P + 2 * steps + 8)
    tokens = torch.full((1,), 5, dtype=torch.long, device=eng.device)
    pos = torch.full((1,), P, dtype=torch.long, device=eng.device)
    prof = pd.profile_steps(step, tokens, pos, steps, lambda e: False, anchor=_layer_anchor(c["num_hidden_layers"]))
    cfg = LlamaConfig.from_hf_dict({**COMMON, **c})
    layer_bytes = (1 - skip) * step_bytes(cfg, 2)["block"] / cfg.num_hidden_layers
    prof["layer_floor_us"] = 1e6 * layer_bytes / (bw_GBps * 1e9)
    return prof


def profile_summary(prof: dict, top: int = 8) -> str:
    """One profiled system in a few lines: GPU time and launches per step, its heaviest kernels."""
    lines = [f"    profile: {prof['wall_ms_per_step']:.3f} ms/step wall, {prof['kernel_ms_per_step']:.3f} ms GPU, "
             f"{prof['launches_per_step']:.0f} launches/step"]
    lines += [f"      {k['us_per_step']:9.1f} us {k['launches_per_step']:6.0f}x  {k['name'][:90]}"
              for k in prof["kernels"][:top]]
    return "\n".join(lines)


def hf_model(c: dict, dtype, dev):
    """transformers' model of shape c (LlamaForCausalLM, Qwen2ForCausalLM: c's model_type), its own random init,
    built on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = {**COMMON, **c}
    cfg = AutoConfig.for_model(d.pop("model_type"), **d, attn_implementation="eager")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            m = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(prev)
    return m.eval()


def _hf_prompt(c: dict, P: int, dev) -> torch.Tensor:
    return torch.randint(4, c["vocab_size"], (1, P), generator=torch.Generator().manual_seed(0)).to(dev)


def hf_greedy(m, c: dict, P: int, N: int, dev) -> list[int]:
    """model.generate's N greedy tokens after the timed prompt."""
    ids = _hf_prompt(c, P, dev)
    with torch.inference_mode():
        out = m.generate(input_ids=ids, max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0,
                         attention_mask=torch.ones_like(ids))
    return out[0, P:].tolist()


def time_hf(m, c: dict, P: int, N: int, dev) -> dict:
    """Per-step decode latency of model.generate: (T(N) - T(1)) / (N - 1)."""
    ids = _hf_prompt(c, P, dev)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))

    def gen(n):
        sync(dev)
        t = time.perf_counter()
        with torch.inference_mode():
            m.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(dev)
        return time.perf_counter() - t

    gen(2)
    tn, t1 = gen(N), gen(1)
    return {"ms_per_step": 1e3 * (tn - t1) / (N - 1), "prefill_ms": 1e3 * t1, "total_s": tn}


def time_hf_compiled(m, c: dict, P: int, N: int, dev, backend: str = "inductor") -> dict:
    """Per-step decode latency of transformers' static cache with the one-token forward under torch.compile
    (mode reduce-overhead: CUDA graphs; fullgraph), greedy, the loop of transformers' "LLM inference optimization"
    guide and gpt-fast: T(N) / N over the decode steps alone, the prefill an untimed eager forward into the same
    StaticCache. The first loop compiles and records; the second is timed. `tokens` are the N greedy tokens
    (equal to model.generate's where the arithmetic is: the caller checks); `cudagraph_skips`: the times inductor
    ran a compiled graph without CUDA graphs (0: the whole step replayed as one)."""
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    ids = _hf_prompt(c, P, dev)
    cache = StaticCache(config=m.config, max_cache_len=P + N)

    def one(tok, pos):
        return m(tok, position_ids=pos[None], cache_position=pos, past_key_values=cache, use_cache=True,
                 return_dict=False)[0]

    step = torch.compile(one, backend=backend, fullgraph=True,
                         **({"mode": "reduce-overhead"} if backend == "inductor" else {}))

    def decode():
        cache.reset()
        with torch.no_grad():
            tok = one(ids, torch.arange(P, device=dev))[:, -1:].argmax(-1)
            out = [tok]
            sync(dev)
            t = time.perf_counter()
            for i in range(N - 1):
                tok = step(tok, torch.tensor([P + i], device=dev))[:, -1:].argmax(-1)
                out.append(tok)
            sync(dev)
        return time.perf_counter() - t, torch.cat(out, 1)[0].tolist()

    t, skips = time.perf_counter(), counters["inductor"]["cudagraph_skips"]
    decode()  # compile, record the graphs
    warm = time.perf_counter() - t
    dt, tokens = decode()
    return {"ms_per_step": 1e3 * dt / (N - 1), "warmup_s": warm, "backend": backend, "tokens": tokens,
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips}


def floor(c: dict, skip: float, ctx: int, bw_GBps: float, esize: int = 2) -> dict:
    """Bytes one batch-1 step must read (weights at `skip`, the KV cache at ctx tokens) and the time."""
    from dejavu.compiler.build_llama import step_bytes
    from dejavu.models.llama import LlamaConfig

    cfg = LlamaConfig.from_hf_dict({**COMMON, **c})
    b = step_bytes(cfg, esize)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * ctx * esize
    n = b["fixed"] + (1 - skip) * b["block"] + kv
    return {"bytes": int(n), "kv_bytes": kv, "ms": 1e3 * n / (bw_GBps * 1e9)}


def smoke(dev) -> dict:
    """Kernels vs reference ops and graph vs eager on a tiny fp32 model (GPU only), at the default settings,
    with fewer splits (min_split_inputs 64), with the fp16 residual stream summed by launches (fp32_residual off),
    with the attention kernel in tiles of 16 slots (two splits per row of 24, combined by the o projection's
    select), and with PyTorch's masked SDPA as the attention."""
    if dev.type != "cuda":
        return {"skipped": "no GPU"}
    c = SHAPES["tiny"]
    ref = engines(c, [0.4], torch.float32, dev, 64, backend="ref")[0][-1][2]  # the same seeded weights
    tris = engines(c, [0.4], torch.float32, dev, 64, variants=[{"min_split_inputs": 64}, {"fp32_residual": False},
                                                               {"gqa_attn": {"block_s": 16, "max_splits": 4}},
                                                               {"gqa_attn": {"kernel": False}}],
                   variant_skip=0.4)[0][1:]
    ids = torch.randint(4, c["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    a, prompts = ref.decode_logits(ids), ids[:, :8].tolist()
    want, out = ref.generate(prompts, 12, stop_at_eos=False), {}
    for system, _, tri in tris:
        g = tri.generate(prompts, 12, stop_at_eos=False)
        tri.use_graphs = False
        e = tri.generate(prompts, 12, stop_at_eos=False)
        out[system] = {"kernels_vs_ref_max_abs": float((a - tri.decode_logits(ids)).abs().max()),
                       "graph_equals_eager": g == e, "greedy_equals_ref": g == want}
    return out


def bench_shape(run: Run, name: str, c: dict, a, dev, bw: float) -> None:
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    ctx = a.prompt_len + a.new_tokens // 2  # mean context of the timed steps
    variants = a.kernel_variants if name in a.variant_models else []
    engs, calib = engines(c, a.skips, dtype, dev, a.calib_tokens, variants=variants, variant_skip=a.variant_skip)
    for i, (system, s, eng) in enumerate(engs):
        if isinstance(eng, Exception):
            run.add("errors", {"model": name, "system": system, "error": f"refused as it loads: {eng}"})
            print(f"{name:16} {system:12} refused: {eng}", flush=True)
            continue
        if i > len(a.skips) and a.budget_s and time.perf_counter() - a.t0 > a.budget_s:  # a variant, past the budget
            run.add("skipped", {"model": name, "system": system, "reason": f"past --budget-s {a.budget_s:g}"})
            eng.release()
            continue
        t_row = time.perf_counter()
        try:
            row = {"model": name, "system": system, "batch": 1, "skip_target": s, "shape": c, "calibration": calib,
                   "density": eng.header["build_config"]["density"],
                   "kernel_settings": eng.header["target"]["kernel_settings"]["input_sparse"]}
            row["skip_realized"] = realized_skip(eng, c, a.prompt_len, a.skip_steps) if s > 0 else 0.0
            row.update(time_engine(eng, c, a.prompt_len, a.new_tokens))
            fl = floor(c, row["skip_realized"], ctx, bw)
            row.update(floor_bytes=fl["bytes"], floor_ms=fl["ms"], floor_ms_nominal=floor(c, row["skip_realized"], ctx,
                                                                                        a.peak_GBps)["ms"])
            row["wall_s"] = time.perf_counter() - t_row  # build of the row: skip count, capture, timing
            run.add("results", row)
            print(f"{name:16} {system:12} {row['ms_per_step']:8.3f} ms/step  floor {row['floor_ms']:.3f} ms  "
                  f"skip {row['skip_realized']:.3f}", flush=True)
            profiled = system in ("dense_graph", f"teal_s{a.variant_skip:g}") or (
                a.profile_variants and system.startswith(f"teal_s{a.variant_skip:g}+"))
            if a.profile_steps and dev.type == "cuda" and profiled:
                row["profile"] = profile_engine(eng, c, a.prompt_len, a.profile_steps, bw, row["skip_realized"])
                run.save()  # the timed row is already recorded: a failing profile only adds an error
                print(profile_summary(row["profile"]), flush=True)
            if a.tune and dev.type == "cuda" and system == f"teal_s{a.variant_skip:g}" and name in a.variant_models:
                tuned_rows(run, name, eng, c, a, row)
        except Exception as e:  # noqa: BLE001 - record and go on to the next system
            run.add("errors", {"model": name, "system": system, "error": f"{type(e).__name__}: {e}",
                               "trace": traceback.format_exc()[-3000:]})
        eng.release()
    del engs
    free(dev)
    if not a.no_hf:
        hf_rows(run, name, c, a, dev, floor(c, 0.0, ctx, bw), dtype)


def hf_rows(run: Run, name: str, c: dict, a, dev, fl: dict, dtype) -> None:
    """transformers' model of shape c: eager generate, then (--hf-compile) the static cache + torch.compile loop,
    its greedy tokens checked against generate's (`tokens_agree`: how many of the first agree; with random
    weights the logits are near ties, so rounding can part them)."""
    m = None
    systems = ["hf_eager"] + (["hf_static_compile"] if a.hf_compile else [])
    for system in systems:
        try:
            if m is None:
                m = hf_model(c, dtype, dev)
            row = {"model": name, "system": system, "batch": 1, "skip_target": 0.0, "shape": c,
                   "floor_bytes": fl["bytes"], "floor_ms": fl["ms"]}
            if system == "hf_eager":
                row.update(time_hf(m, c, a.prompt_len, a.new_tokens, dev))
            else:
                row.update(time_hf_compiled(m, c, a.prompt_len, a.new_tokens, dev, a.hf_compile_backend))
                want = hf_greedy(m, c, a.prompt_len, a.new_tokens, dev)
                row["tokens_agree"] = next((i for i, (x, y) in enumerate(zip(row["tokens"], want)) if x != y),
                                           len(want))
            run.add("results", row)
            print(f"{name:16} {system:12} {row['ms_per_step']:8.3f} ms/step", flush=True)
        except Exception as e:  # noqa: BLE001
            run.add("errors", {"model": name, "system": system, "error": f"{type(e).__name__}: {e}",
                               "trace": traceback.format_exc()[-3000:]})
    del m
    if a.hf_compile:  # compiled code keeps references to the model's weights
        torch._dynamo.reset()
    free(dev)


def tuned_rows(run: Run, name: str, eng, c: dict, a, row: dict) -> None:
    """runtime/tune.tune_engine on the engine at the defaults (its trials recorded), then the tuned engine timed
    as generate runs it, then the defaults' engine again (the drift between the two timings of one engine)."""
    from dejavu.runtime import Engine
    from dejavu.runtime.tune import TuneSettings, tune_engine

    t = time.perf_counter()
    got = tune_engine(eng, TuneSettings(prompt_len=a.prompt_len, budget_s=a.tune_budget_s),
                      say=lambda line: print(f"    {line}", flush=True))
    eng.release()
    tuned = Engine.from_tensors(eng.header, eng.tensors, device=eng.device, kernel_settings=got.settings)
    extra = {k: row[k] for k in ("batch", "skip_target", "shape", "calibration", "density", "skip_realized",
                                 "floor_bytes", "floor_ms", "floor_ms_nominal")}
    trow = {"model": name, "system": f"{row['system']}+tuned", **extra,
            "kernel_settings": got.settings.to_dict()["input_sparse"], "gqa_attn": got.settings.to_dict()["gqa_attn"],
            "tune": {"start_ms": got.start_ms, "ms": got.ms, "s": time.perf_counter() - t,
                     "trials": [dataclasses.asdict(x) for x in got.trials]}}
    trow.update(time_engine(tuned, c, a.prompt_len, a.new_tokens))
    tuned.release()
    run.add("results", trow)
    print(f"{name:16} {trow['system']:12} {trow['ms_per_step']:8.3f} ms/step", flush=True)
    again = {"model": name, "system": f"{row['system']} (again)", **extra,
             "kernel_settings": row["kernel_settings"], **time_engine(eng, c, a.prompt_len, a.new_tokens)}
    run.add("results", again)
    print(f"{name:16} {again['system']:12} {again['ms_per_step']:8.3f} ms/step", flush=True)


def table(results: list[dict]) -> str:
    dense = {r["model"]: r["ms_per_step"] for r in results if r["system"] == "dense_graph"}
    lines = ["| model | system | skip (realized) | ms/step | vs dense graph | floor ms | ms / floor |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        d = dense.get(r["model"])
        lines.append(f"| {r['model']} | {r['system']} | {r.get('skip_realized', 0):.3f} | {r['ms_per_step']:.3f} | "
                     f"{d / r['ms_per_step'] if d else float('nan'):.2f}x | {r['floor_ms']:.3f} | "
                     f"{r['ms_per_step'] / r['floor_ms']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON path (default $OUT/e2e_llama.json, else ./e2e_llama.json)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (tiny shapes, reference ops: a dry run)")
    p.add_argument("--models", default=None, help="default llama-3-8b,llama-3-70b-tp8 (cpu: tiny)")
    p.add_argument("--skips", default="0.25,0.4,0.5", help="fractions of every projection input skipped")
    p.add_argument("--kernel-variants", default=json.dumps(VARIANTS),
                   help="JSON list of InputSparseSettings fields (KernelSettings.input_sparse; another part as "
                        "{\"pdl\": {...}}), each an extra engine at --variant-skip ('[]': none)")
    p.add_argument("--variant-skip", type=float, default=0.5)
    p.add_argument("--variant-models", default=None, help="models the variants run on (default: the first of --models)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no variant after this many seconds of the run (0: no limit); the others are "
                        "recorded as skipped")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--calib-tokens", type=int, default=512, help="random tokens the thresholds are taken from")
    p.add_argument("--skip-steps", type=int, default=16, help="decode steps that count the realized skip")
    p.add_argument("--peak-GBps", type=float, default=4800.0, help="nominal HBM bandwidth (H200: 4800)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--hf-compile", action="store_true",
                   help="also transformers' static cache with the one-token forward under torch.compile (the "
                        "compile takes minutes on the real shapes)")
    p.add_argument("--hf-compile-backend", default="inductor",
                   help="torch.compile backend of --hf-compile (inductor, with mode reduce-overhead; 'eager': "
                        "the same loop uncompiled, what the CPU test runs)")
    p.add_argument("--no-smoke", action="store_true")
    p.add_argument("--profile-steps", type=int, default=20, help="graph replays profiled per profiled system (0: none)")
    p.add_argument("--tune", action="store_true",
                   help="on the --variant-models: runtime/tune.py's search from the defaults at --variant-skip, then "
                        "the tuned engine timed, then the defaults again")
    p.add_argument("--tune-budget-s", type=float, default=240.0, help="the search's budget per model")
    p.add_argument("--profile-variants", action="store_true",
                   help="profile the --kernel-variants engines too (default: the dense graph and teal at the defaults)")
    a = p.parse_args(argv)
    # Run as a script, this folder is sys.path[0]; its kernels.py would shadow the `kernels` package
    # that transformers imports. This script imports nothing from its folder.
    here = Path(__file__).resolve().parent
    sys.path[:] = [q for q in sys.path if Path(q or ".").resolve() != here]
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("e2e_llama: --device cuda but no GPU is available (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    a.skips = [float(s) for s in a.skips.split(",") if s]
    a.kernel_variants = json.loads(a.kernel_variants)
    bad = check_variants(a.kernel_variants)
    if bad:
        p.error(f"--kernel-variants: {bad}")
    models = (a.models or ("llama-3-8b,llama-3-70b-tp8" if dev.type == "cuda" else "tiny")).split(",")
    a.variant_models = a.variant_models.split(",") if a.variant_models else models[:1]
    a.t0 = time.perf_counter()
    out = Path(a.out or Path(os.environ.get("OUT", ".")) / "e2e_llama.json")
    meta = {"argv": sys.argv if argv is None else argv, "torch": torch.__version__, "device": str(dev),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    from dejavu.provenance import tree_commit

    meta["commit"] = tree_commit(Path(__file__), short=False)
    run = Run(out, meta)
    if not a.no_smoke:
        try:
            run.add("smoke", smoke(dev))
        except Exception as e:  # noqa: BLE001 - recorded; the timed rows say whether each form runs
            run.add("smoke", {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]})
        print(f"smoke: {run.data['smoke']}", flush=True)
    bw = copy_bandwidth(dev)
    run.add("bandwidth", bw)
    for name in models:
        bench_shape(run, name, SHAPES[name], a, dev, bw["copy_GBps"])
    print(table(run.data["results"]))
    print(f"e2e_llama: wrote {out} in {time.perf_counter() - a.t0:.0f} s"
          + (f" ({len(run.data['errors'])} errors)" if run.data["errors"] else "")
          + (f" ({len(run.data['skipped'])} variants skipped)" if run.data["skipped"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
