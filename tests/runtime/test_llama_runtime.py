"""Llama-family engines (compiler/build_llama.py → runtime/llama_decoder.py) on the CPU path."""
from __future__ import annotations

import json

import pytest
import torch

from dejavu.compiler.build import build_engine
from dejavu.compiler.config import BuildConfig
from dejavu.engine_file import read_engine, write_engine
from dejavu.errors import DejavuError
from dejavu.runtime import Engine
from llama_helpers import tiny_llama, write_tiny_llama

ATOL = 1e-4
CALIB = dict(calib_tokens=512, calib_window=128, dtype="float32")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(folder, {density: engine path}) for a tiny random GQA Llama (6 query / 2 KV heads, tied head)."""
    root = tmp_path_factory.mktemp("llama")
    folder = write_tiny_llama(root / "tiny", seed=3)
    paths = {}
    for d in (1.0, 0.6):
        paths[d] = root / f"d{d}.engine"
        build_engine(folder, BuildConfig(density=d, **CALIB), paths[d], progress=False)
    return folder, paths


def _model(folder):
    from dejavu.models.auto import load_llama
    return load_llama(folder)[0]


def _ids(n=2, s=24, seed=0):
    return torch.randint(0, 320, (n, s), generator=torch.Generator().manual_seed(seed))


def test_density_one_is_the_dense_model(built):
    folder, paths = built
    eng = Engine.load(paths[1.0])
    assert type(eng).__name__ == "LlamaEngine" and eng.header["sparsity"]["skip"] == 0.0
    ids = _ids()
    with torch.no_grad():
        ref = _model(folder)(ids)
    assert (eng.logits(ids) - ref).abs().max() <= ATOL
    assert (eng.decode_logits(ids) - ref).abs().max() <= ATOL  # cached decode steps = full recompute


def test_sparse_logits_equal_the_compilers_simulation(built):
    """Token-parallel and step-by-step decode both equal gated_sparsity's hooks on the dense model,
    given the engine's thresholds."""
    from dejavu.compiler.gated_sparsity import GatedSparsity, gated_sparsity

    folder, paths = built
    eng = Engine.load(paths[0.6])
    th = eng.header["sparsity"]["thresholds"]
    calib = th  # the engine's thresholds, {key: [L]}
    model, ids = _model(folder), _ids(seed=1)
    with torch.no_grad(), gated_sparsity(model, calib, GatedSparsity(skip=eng.header["sparsity"]["skip"])) as reads:
        sim = model(ids)
    assert 0.3 < reads.skipped < 0.7  # thresholds from other text still skip about the target
    assert (eng.logits(ids) - sim).abs().max() <= ATOL
    assert (eng.decode_logits(ids) - sim).abs().max() <= ATOL
    with torch.no_grad():
        assert (model(ids) - sim).abs().max() > 100 * ATOL  # the sparsity changes the logits


def _rule_logits(model, th: dict, ids: torch.Tensor, dense_rows: slice) -> torch.Tensor:
    """The dense model's logits with every projection input thresholded by the engine's thresholds, except
    at the positions `dense_rows`, which read their inputs whole (pre-hooks: an independent reference)."""
    handles = []
    for l, layer in enumerate(model.layers):
        at, mlp = layer.self_attn, layer.mlp
        for key, mods in (("attn_in", (at.q_proj, at.k_proj, at.v_proj)), ("o_in", (at.o_proj,)),
                          ("mlp_in", (mlp.gate_proj, mlp.up_proj)), ("down_in", (mlp.down_proj,))):
            def hook(m, a, t=th[key][l]):
                keep = a[0].abs() > t
                keep[:, dense_rows] = True
                return (a[0] * keep,) + tuple(a[1:])
            handles += [m.register_forward_pre_hook(hook) for m in mods]
    try:
        with torch.no_grad():
            return model(ids)
    finally:
        for h in handles:
            h.remove()


def test_prefill_is_dense_but_for_the_first_position(built):
    """generate's view (a prompt of p tokens prefilled, the rest decoded): the prompt's positions 1 .. p - 1
    read their inputs whole, its first position and every decoded token are thresholded. A one-token prompt
    is therefore the token-parallel quantity; a dense first position would give other logits."""
    folder, paths = built
    eng = Engine.load(paths[0.6])
    th, model, ids = eng.header["sparsity"]["thresholds"], _model(folder), _ids(seed=4)
    assert (eng.decode_logits(ids, 1) - eng.logits(ids)).abs().max() <= ATOL
    got = eng.decode_logits(ids, 9)
    assert got[:, :8].isnan().all()
    assert (got[:, 8:] - _rule_logits(model, th, ids, slice(1, 9))[:, 8:]).abs().max() <= ATOL
    assert (got[:, 8:] - eng.logits(ids)[:, 8:]).abs().max() > 100 * ATOL  # the dense prompt changes them
    assert (_rule_logits(model, th, ids, slice(0, 9))[:, 8:] - got[:, 8:]).abs().max() > 100 * ATOL
    # batched, right-padded, prompts of 1 and 5 tokens: the prefill's last logits row by row
    lengths = torch.tensor([1, 5])
    eng.decoder.setup(2, 32)
    last = eng.decoder.prefill(ids[:, :5], lengths)
    assert (last[0] - eng.logits(ids[:1, :1])[0, 0]).abs().max() <= ATOL
    assert (last[1] - _rule_logits(model, th, ids[1:, :5], slice(1, 5))[0, 4]).abs().max() <= ATOL


def test_thresholds_are_the_calibration_texts_quantiles(built):
    """The header's thresholds are gated_sparsity.calibrate's on the recorded calibration tokens
    (the shipped WikiText-2 *train* head), each input at its recorded skip; those skips spend
    exactly the block skip the density maps to."""
    from dejavu.compiler.build_llama import _Blocks, skip_for_density
    from dejavu.compiler.gated_sparsity import calibrate
    from dejavu.compiler.text import corpus_tokens, fingerprint_tokens
    from dejavu.models.auto import load_text_tokenizer

    folder, paths = built
    header, _ = read_engine(paths[0.6])
    model, tok = _model(folder), load_text_tokenizer(folder)
    assert header["build_config"]["calibration"]["corpus"] == "dejavu/data/calib/wikitext2-train-head.txt"
    ids, _ = corpus_tokens(tok.tokenizer, None, 512, bos_id=tok.bos_id)
    assert fingerprint_tokens(ids) == header["build_config"]["calibration"]["tokens_fingerprint"]
    skip = skip_for_density(model.config, 0.6)
    assert header["sparsity"]["skip"] == pytest.approx(skip, abs=1e-7)
    with torch.no_grad():
        cal = calibrate(_Blocks(model), torch.as_tensor(ids, dtype=torch.long).view(4, 128))
    skips = header["sparsity"]["skips"]
    for key, values in header["sparsity"]["thresholds"].items():
        assert values == pytest.approx([cal.threshold(key, l, skips[key]) for l in range(2)], rel=1e-6)


def test_density_is_the_byte_fraction(built):
    from dejavu.compiler.build_llama import step_bytes

    _, paths = built
    h, _ = read_engine(paths[0.6])
    b = h["build_config"]["bytes_per_token"]
    assert b["fraction"] == pytest.approx(0.6, abs=1e-5)
    cfg = tiny_llama().config
    full = step_bytes(cfg, 4)
    # every parameter once (the tied head is the embedding: all V rows) plus the token's embedding row
    n = sum(p.numel() for p in tiny_llama().parameters())
    assert b["dense"] == full["dense"] == 4 * (n + cfg.hidden_size)
    assert b["engine"] == round(full["fixed"] + (1 - h["sparsity"]["skip"]) * full["block"])


def test_generate_is_greedy_decoding_of_the_dense_model(built):
    folder, paths = built
    eng = Engine.load(paths[1.0])
    prompt = [0, 17, 93, 5]
    new = eng.generate([prompt], max_new_tokens=6, stop_at_eos=False)[0]
    model, ids = _model(folder), list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert new == ids[len(prompt):]


def test_batched_right_padded_generation_equals_one_by_one(built):
    eng = Engine.load(built[1][0.6])
    prompts = [[0, 5, 9, 44, 80, 3, 7], [0, 12]]
    together = eng.generate(prompts, max_new_tokens=5, stop_at_eos=False)
    alone = [eng.generate([p], max_new_tokens=5, stop_at_eos=False)[0] for p in prompts]
    assert together == alone


def test_engine_survives_save_and_load_and_half_precision(built, tmp_path):
    header, tensors = read_engine(built[1][0.6])
    write_engine(tmp_path / "copy.engine", header, tensors)
    assert (tmp_path / "copy.engine").read_bytes() == built[1][0.6].read_bytes()
    ids = _ids(1, 12, seed=4)
    copy = Engine.load(tmp_path / "copy.engine")
    assert torch.equal(copy.logits(ids), Engine.from_tensors(header, tensors).logits(ids))
    # fp16 on the dense engine (a sparse one flips inputs at the threshold: not a rounding question)
    header, tensors = read_engine(built[1][1.0])
    e32, e16 = Engine.from_tensors(header, tensors), Engine.from_tensors(header, tensors, dtype="float16")
    assert (e16.decode_logits(ids) - e32.logits(ids)).abs().max() < 0.05


def test_bad_llama_headers_and_tensors_are_one_error(built):
    header, tensors = read_engine(built[1][0.6])
    bad = json.loads(json.dumps(header))
    bad["sparsity"]["thresholds"]["o_in"] = [0.1]
    with pytest.raises(DejavuError, match="thresholds.o_in must list 2"):
        Engine.from_tensors(bad, tensors)
    t = dict(tensors)
    t["layers.1.mlp.wd_t"] = t["layers.1.mlp.wd_t"].T.contiguous()
    with pytest.raises(DejavuError, match=r"'layers.1.mlp.wd_t' has shape \[48, 80\], expected \[80, 48\]"):
        Engine.from_tensors(header, t)


def test_compile_rejects_what_llama_engines_do_not_do(built, tmp_path):
    folder, _ = built
    with pytest.raises(DejavuError, match="--density 0.05 is below the least"):
        build_engine(folder, BuildConfig(density=0.05, **CALIB), tmp_path / "x.engine", progress=False)
    with pytest.raises(DejavuError, match="--mlp-density is not supported for Llama"):
        build_engine(folder, BuildConfig(density=0.6, mlp_density=0.5, **CALIB), tmp_path / "x.engine",
                     progress=False)
    assert not (tmp_path / "x.engine").exists()


def test_opt_engines_are_unaffected(tiny_opt_dir, tmp_path):
    """An OPT build's header has no model_family and still loads as the OPT engine."""
    out = tmp_path / "opt.engine"
    build_engine(tiny_opt_dir, BuildConfig(density=1.0, no_predictors=True, calib_tokens=256, calib_window=64),
                 out, progress=False)
    h, _ = read_engine(out)
    assert "model_family" not in h and type(Engine.load(out)).__name__ == "Engine"


def test_dejavu_run_and_inspect_on_a_llama_engine(built, capsys):
    from dejavu.compiler.cli import inspect_main
    from dejavu.runtime.cli import main as run_main

    path = str(built[1][0.6])
    assert run_main([path, "--prompt", "The game", "--max-new-tokens", "5", "--output-format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)["outputs"][0]
    want = Engine.load(path).generate(["The game"], 5)[0]
    assert out["tokens"] == want and len(want) >= 1
    assert inspect_main([path]) == 0
    text = capsys.readouterr().out
    assert "family llama" in text and "teal:" in text and "layers.0.mlp.wgu_t" in text
    th = read_engine(path)[0]["sparsity"]["thresholds"]
    row = next(line for line in text.splitlines() if line.startswith("    1 "))  # layer 1's threshold row
    assert f"{th['attn_in'][1]:.4f}" in row and "held-out    ppl" in text


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_dejavu_run_chat_renders_the_engines_template(built, tmp_path, capsys):
    """`dejavu-run --chat [--system]`: the prompt as a user message in the engine's chat template, tokenized as
    transformers' apply_chat_template tokenizes it; the reply alone printed. Without a template, and --system
    without --chat: one error line, exit 2."""
    pytest.importorskip("jinja2")
    from transformers import PreTrainedTokenizerFast

    from dejavu.runtime.cli import main as run_main

    header, tensors = read_engine(built[1][0.6])
    path = tmp_path / "chat.engine"
    write_engine(path, {**header, "chat_template": CHATML}, tensors)
    eng = Engine.load(path)
    ref = PreTrainedTokenizerFast(tokenizer_object=eng.tokenizer.tokenizer)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The game"}]
    ids = ref.apply_chat_template(msgs, chat_template=CHATML, add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    want = eng.generate([ids], 5, stop_at_eos=False)[0]
    args = [str(path), "--chat", "--system", "Be brief.", "--prompt", "The game", "--max-new-tokens", "5"]
    assert run_main(args + ["--output-format", "jsonl"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["tokens"] and row["tokens"] == want[:len(row["tokens"])] and row["completion"] == eng.tokenizer.decode(row["tokens"])
    assert run_main(args) == 0
    assert capsys.readouterr().out == row["completion"] + "\n"  # the reply, not the prompt
    for bad, why in (([str(built[1][0.6]), "--chat", "--prompt", "x"], "carries no chat template"),
                     ([str(path), "--system", "s", "--prompt", "x"], "--system is a chat message: give --chat")):
        with pytest.raises(SystemExit) as e:
            run_main(bad)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and why in err[0]


# (min_split_inputs, per-kind settings, attention settings, fp32 residual); None: the engine's own settings
_KINDS = (("qkv", "block_m", 32), ("o", "min_split_inputs", 8), ("o", "num_warps", 2), ("gate_up", "block_m", 32),
          ("gate_up", "block_k", 16), ("down", "block_m", 32), ("down", "min_split_inputs", 16))
_TRITON_RUNS = {"splits": (16, (), dict(block_s=16), True),
                "per_kind": (4096, _KINDS, dict(block_s=16, fuse_combine=False), False),
                "sdpa": (4096, (), dict(kernel=False), True),
                "defaults": None}


@pytest.mark.parametrize("run", list(_TRITON_RUNS))
def test_triton_path_under_the_interpreter_equals_the_reference(built, run):
    """The decode step through plugins/input_sparse (selects fused with RMSNorm / SwiGLU, gate/up's partials
    summed by down's select, the pairs' GEMV, the residual / RoPE and cache write in the split-K sums), blocks
    smaller than the defaults so the shapes take several, with several splits (min_split_inputs 16: `splits`) and
    one, and with settings per projection kind (input_sparse.projections: other blocks, splits: `per_kind`), o and
    down adding into an fp32 residual stream (input_sparse.fp32_residual) or summed by their launches
    (`per_kind`), the attention by plugins/gqa_attention (tiles of 16 slots: two splits per row, combined by the o
    projection's select, or by the combine kernel: `per_kind`) or by SDPA over the whole cache (gqa_attn.kernel
    off: `sdpa`), and at the engine's own settings (`defaults`: gate/up's block_k 64, the attention kernel's tiles
    of 32, the fp32 residual stream), run by Triton's interpreter in a subprocess (TRITON_INTERPRET must be set
    before triton is imported): logits of batched steps and greedy tokens (two rows at different positions)
    equal the reference ops'."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = f"""
import json, torch
from dejavu.plugins import GQAAttnSettings, InputSparseSettings, KernelSettings
from dejavu.runtime import Engine
ref = Engine.load({str(built[1][0.6])!r})
ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(5))  # 20 slots: two tiles of 16
prompts = [[0, 9, 4], [7, 1, 3, 8, 2]]  # rows at different positions
a, want = ref.decode_logits(ids), ref.generate(prompts, 6, stop_at_eos=False)
run = {_TRITON_RUNS[run]!r}
ks = None if run is None else KernelSettings(gqa_attn=GQAAttnSettings(**run[2]), input_sparse=(
    InputSparseSettings(block_m=16, block_k=8, min_split_inputs=run[0], projections=run[1], fp32_residual=run[3])))
tri = Engine.load({str(built[1][0.6])!r}, backend="triton", kernel_settings=ks)
print(json.dumps({{"diff": float((a - tri.decode_logits(ids)).abs().max()), "check": tri.kernel_check,
                  "fp32_residual": tri.ops.fp32_residual, "kernels": tri.describe()["kernels"],
                  "down_block_m": tri.ops.kinds["down"].input_sparse.block_m,
                  "gate_up_block_k": tri.ops.kinds["gate_up"].input_sparse.block_k,
                  "same": want == tri.generate(prompts, 6, stop_at_eos=False)}}))
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    want = {"splits": ("triton", 8, True, 16), "per_kind": ("triton", 16, False, 32), "sdpa": ("torch", 8, True, 16),
            "defaults": ("triton", 64, True, 64)}[run]
    assert (r["kernels"]["gqa_attention"], r["gate_up_block_k"], r["fp32_residual"], r["down_block_m"]) == want
    assert r["kernels"]["input_sparse_gemv"] == "triton" and r["check"]["input_sparse_gemv"] < 1e-4
    # every projection kind's GEMV with its own settings, checked as the engine loads
    assert all(r["check"][f"input_sparse_gemv.{k}"] < 1e-4 for k in ("qkv", "o", "down"))
    # the engine's load-time check of the attention kernel (on: against SDPA, over three tiles)
    assert ("gqa_attention" in r["check"]) == (r["kernels"]["gqa_attention"] == "triton")
    assert r["check"].get("gqa_attention", 0.0) < 1e-4
    assert r["diff"] <= ATOL and r["same"]


def test_dejavu_compile_bad_density_is_one_line_and_no_file(built, tmp_path, capsys):
    from dejavu.compiler.cli import main as compile_main

    out = tmp_path / "x.engine"
    with pytest.raises(SystemExit) as e:
        compile_main([str(built[0]), "--density", "0.02", "-o", str(out), "-q", "--calib-tokens", "256"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("dejavu: error: --density 0.02 is below")
    assert not out.exists()


def test_kernel_settings_are_read_from_the_header(built):
    from dejavu.plugins import InputSparseSettings, KernelSettings
    from dejavu.runtime.ops import settings_for
    from dejavu.runtime.llama_decoder import LlamaOps

    target = {"kernel_settings": {"input_sparse": {"block_m": 16, "block_k": 8}}}
    got = settings_for(target, torch.device("cpu")).input_sparse
    assert got == InputSparseSettings(block_m=16, block_k=8)
    with pytest.raises(DejavuError, match="kernel_settings.input_sparse: unknown key"):
        KernelSettings.from_dict({"input_sparse": {"block_q": 4}})
    # headers written before the GEMV's mask mode was removed carry select "list", the one mode left
    assert KernelSettings.from_dict({"input_sparse": {"select": "list", "block_m": 16}}).input_sparse.block_m == 16
    with pytest.raises(DejavuError, match="kernel_settings.input_sparse: unknown key.s. select"):
        LlamaOps("triton", KernelSettings.from_dict({"input_sparse": {"select": "mask"}}))
    # and before the GEMV's prefetch_w / loop_stages forms were removed: at the plain loop's values (every header
    # of 94b1fda), they load as the header's settings; a removed form itself is an unknown key
    old = {"block_select": 4096, "select_warps": 8, "block_m": 32, "block_k": 128, "split_k": None,
           "target_programs": 528, "min_split_inputs": 256, "num_warps": 4, "loop_stages": None, "prefetch_w": False,
           "projections": [["o", "num_warps", 2]]}
    got = settings_for({"kernel_settings": {"input_sparse": old, "gqa_attn": {"kernel": False}}}, torch.device("cpu"))
    assert got.input_sparse == InputSparseSettings(block_m=32, projections=(("o", "num_warps", 2),))
    assert got.gqa_attn.kernel is False and LlamaOps("triton", got).kinds["o"].input_sparse.num_warps == 2
    # and headers written while the fused MLP was a setting (its off value and blocks)
    fused = {"fuse_mlp": False, "mlp_block_i": 32, "mlp_block_d": 256}
    assert KernelSettings.from_dict({"input_sparse": {**old, **fused}}).input_sparse == got.input_sparse
    for removed in ({"prefetch_w": True}, {"loop_stages": 3}, {"fuse_mlp": True}):
        with pytest.raises(DejavuError, match=f"kernel_settings.input_sparse: unknown key.s. {next(iter(removed))}"):
            KernelSettings.from_dict({"input_sparse": {**old, **removed}})


def test_projection_settings_survive_the_header_and_old_headers_take_one_table(built, tmp_path):
    """Settings per projection kind (input_sparse.projections) survive an engine file's header and reach
    LlamaOps per kind; a header written before the field (no "projections") loads with the defaults' (gate/up's
    block_k 64, the table for the other kinds); a kind or field that is not one is a DejavuError."""
    from dejavu.plugins import DEFAULT, PROJECTIONS, InputSparseSettings, KernelSettings
    from dejavu.runtime.ops import settings_for
    from dejavu.runtime.llama_decoder import LlamaOps

    kinds = (("gate_up", "block_m", 32), ("gate_up", "num_warps", 2), ("o", "target_programs", 264))
    ks = KernelSettings(input_sparse=InputSparseSettings(projections=kinds))
    header, tensors = read_engine(built[1][0.6])
    path = tmp_path / "kinds.engine"
    write_engine(path, {**header, "target": {**header["target"], "kernel_settings": ks.to_dict()}}, tensors)
    got = settings_for(read_engine(path)[0]["target"], torch.device("cpu"))
    assert got == ks and got.input_sparse.projections == kinds
    ops = LlamaOps("triton", got)
    assert ops.kinds["gate_up"].input_sparse == InputSparseSettings(block_m=32, num_warps=2, projections=kinds)
    assert ops.kinds["o"].input_sparse.target_programs == 264 and ops.kinds["o"].input_sparse.block_m == 64
    assert ops.kinds["qkv"] == ops.kinds["down"] == ks
    assert Engine.load(path).ops.kinds["gate_up"].input_sparse.block_m == 32
    old = DEFAULT.to_dict()
    del old["input_sparse"]["projections"]
    ops = LlamaOps("triton", settings_for({"kernel_settings": old}, torch.device("cpu")))
    assert set(ops.kinds) == set(PROJECTIONS) and ops.kinds == LlamaOps("triton", DEFAULT).kinds
    assert ops.kinds["gate_up"].input_sparse.block_k == 64 and ops.kinds["down"] == DEFAULT
    for bad in (("mlp", "block_m", 32), ("o", "block_q", 32), ("o", "block_m")):
        with pytest.raises(DejavuError, match="input_sparse.projections"):
            LlamaOps("triton", KernelSettings(input_sparse=InputSparseSettings(projections=(bad,))))


@pytest.mark.parametrize("over", [dict(tie_word_embeddings=False, num_key_value_heads=6),
                                  dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                         high_freq_factor=4.0, original_max_position_embeddings=16))],
                         ids=["untied_mha", "llama3_rope"])
def test_dense_engine_in_memory_equals_the_model(over):
    """Untied head, multi-head KV, Llama-3.1 rope scaling: a dense engine (thresholds 0) made from
    the compiler's layout and header functions equals the model, token-parallel and decoding."""
    from dejavu.compiler.build_llama import INPUTS, llama_header, llama_tensors

    model = tiny_llama(seed=5, **over)
    th = {k: [0.0, 0.0] for k in INPUTS}
    header = llama_header("m", model.config, BuildConfig(density=1.0, dtype="float32"), {"device": "cpu"},
                          {k: 0.0 for k in INPUTS}, th, None, "")
    eng = Engine.from_tensors(header, llama_tensors(model, torch.float32))
    ids = _ids(2, 40, seed=6)
    with torch.no_grad():
        ref = model(ids)
    assert (eng.logits(ids) - ref).abs().max() <= ATOL and (eng.decode_logits(ids) - ref).abs().max() <= ATOL


def test_serving_scheduler_runs_a_llama_engine(built):
    """dejavu-serve's scheduler (rows, chunked prefill, continuous batching) on a Llama engine:
    greedy completions equal Engine.generate's one by one."""
    import threading

    from dejavu.runtime.scheduler import Request, Scheduler

    eng = Engine.load(built[1][0.6])
    prompts = [[0, 5, 9, 44, 80, 3, 7, 11, 13], [0, 12], [0, 77, 78]]
    want = [eng.generate([p], 5, stop_at_eos=False)[0] for p in prompts]
    sched = Scheduler(eng, max_batch=2, max_queue=8, context=64, prefill_chunk=4)
    done, got = threading.Event(), {}

    def sink(i):
        def f(ev):
            if ev[0] in ("done", "error"):
                got[i] = ev
                if len(got) == len(prompts):
                    done.set()
        return f

    sched.start()
    try:
        sched.submit([Request(p, 5, sink(i), stop_at_eos=False) for i, p in enumerate(prompts)])
        assert done.wait(120)
    finally:
        sched.stop()
    assert [got[i][0] for i in range(3)] == ["done"] * 3
    assert [list(got[i][3]) for i in range(3)] == want


def test_rotated_engine_is_the_dense_model_and_its_thresholds_the_rotated_models(built, tmp_path):
    """--rotate-keep: the engine's weights are the rotated model (dense at density 1.0, head untied),
    rotated on the calibration corpus's tokens after the thresholds' (recorded), and its thresholds
    are calibrate's on the rotated model over the calibration tokens."""
    from dejavu.compiler.build_llama import _Blocks
    from dejavu.compiler.gated_sparsity import GatedSparsity, calibrate, gated_sparsity
    from dejavu.compiler.rotate_llama import rotate_llama
    from dejavu.compiler.text import corpus_tokens, fingerprint_tokens
    from dejavu.models.auto import load_text_tokenizer

    folder, _ = built
    paths = {d: tmp_path / f"r{d}.engine" for d in (1.0, 0.6)}
    for d, p in paths.items():
        build_engine(folder, BuildConfig(density=d, rotate_keep=2, **CALIB), p, progress=False)
    ids = _ids(seed=2)
    with torch.no_grad():
        ref = _model(folder)(ids)
    dense = Engine.load(paths[1.0])
    assert dense.header["model_config"]["tie_word_embeddings"] is False
    rec = dense.header["build_config"]["calibration"]
    assert rec["rotate_keep"] == 2 and rec["n_tokens"] == 512 and rec["rotation_tokens"] == [512, 1024]
    assert (dense.logits(ids) - ref).abs().max() <= ATOL
    assert (dense.decode_logits(ids) - ref).abs().max() <= ATOL
    # the rotated model, rebuilt here on the engine's calibration windows, and its thresholds
    tok = load_text_tokenizer(folder)
    stream = torch.as_tensor(corpus_tokens(tok.tokenizer, None, 1024, bos_id=tok.bos_id)[0], dtype=torch.long)
    cids, rids = stream[:512].view(4, 128), stream[512:].view(4, 128)
    assert rec["rotation_fingerprint"] == fingerprint_tokens(rids.numpy()) != rec["tokens_fingerprint"]
    model = _model(folder)
    with torch.no_grad():
        rotate_llama(model, rids, 2)
        cal = calibrate(_Blocks(model), cids)
    header = Engine.load(paths[0.6]).header
    skips = header["sparsity"]["skips"]
    for key, values in header["sparsity"]["thresholds"].items():
        assert values == pytest.approx([cal.threshold(key, l, skips[key]) for l in range(2)], rel=1e-6)
    eng = Engine.load(paths[0.6])
    with torch.no_grad(), gated_sparsity(model, header["sparsity"]["thresholds"], GatedSparsity(skip=0.4)):
        sim = model(ids)
    assert (eng.logits(ids) - sim).abs().max() <= ATOL
    assert (eng.logits(ids) - Engine.load(built[1][0.6]).logits(ids)).abs().max() > 100 * ATOL  # not the unrotated engine


def test_rotate_keep_must_be_a_non_negative_integer():
    with pytest.raises(DejavuError, match="--rotate-keep must be a non-negative integer"):
        BuildConfig(density=0.5, rotate_keep=-1)


def _engine_model(folder, tensors):
    """The source model with the engine's weights put back (the kernel layout undone)."""
    model = _model(folder)
    cfg = model.config
    qo, kv, f = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    with torch.no_grad():
        model.model.norm.weight.copy_(tensors["final_norm"])
        for l, layer in enumerate(model.layers):
            at, mlp, p = layer.self_attn, layer.mlp, f"layers.{l}."
            layer.input_layernorm.weight.copy_(tensors[p + "attn_norm"])
            layer.post_attention_layernorm.weight.copy_(tensors[p + "mlp_norm"])
            q, k, v = tensors[p + "attn.wqkv_t"].T.split([qo, kv, kv])
            at.q_proj.weight.copy_(q), at.k_proj.weight.copy_(k), at.v_proj.weight.copy_(v)
            at.o_proj.weight.copy_(tensors[p + "attn.wo_t"].T)
            g, u = tensors[p + "mlp.wgu_t"].T.split([f, f])
            mlp.gate_proj.weight.copy_(g), mlp.up_proj.weight.copy_(u)
            mlp.down_proj.weight.copy_(tensors[p + "mlp.wd_t"].T)
    return model


def test_distilled_engine_stores_the_trained_weights_and_thresholds_calibrated_on_them(built, tmp_path):
    """--distill-steps (two windows a step): the same allocation, the block weights trained (the embedding the source's),
    the thresholds calibrate's on the trained weights over the recorded calibration windows."""
    from dejavu.compiler.build_llama import _Blocks
    from dejavu.compiler.gated_sparsity import calibrate
    from dejavu.compiler.text import corpus_tokens
    from dejavu.models.auto import load_text_tokenizer

    folder, paths = built
    p = tmp_path / "distilled.engine"
    build_engine(folder, BuildConfig(density=0.6, distill_steps=3, distill_batch=2, **CALIB), p, progress=False)
    header, tensors = read_engine(p)
    base, base_tensors = read_engine(paths[0.6])
    assert header["sparsity"]["skips"] == base["sparsity"]["skips"]
    assert torch.equal(tensors["embed_tokens"], base_tensors["embed_tokens"])
    assert not torch.equal(tensors["layers.0.mlp.wd_t"], base_tensors["layers.0.mlp.wd_t"])
    report = header["build_config"]["heldout"]["distill"]
    assert report["steps"] == 3 and report["batch"] == 2 and report["tokens"] == 3 * 2 * 128
    assert report["first_token"] == 512
    assert header["build_config"]["heldout"]["engine_ppl"] != report["engine_ppl_before"]
    tok = load_text_tokenizer(folder)
    cids = torch.as_tensor(corpus_tokens(tok.tokenizer, None, 512, bos_id=tok.bos_id)[0], dtype=torch.long).view(4, 128)
    with torch.no_grad():
        cal = calibrate(_Blocks(_engine_model(folder, tensors)), cids)
    skips = header["sparsity"]["skips"]
    for key, values in header["sparsity"]["thresholds"].items():
        assert values == pytest.approx([cal.threshold(key, l, skips[key]) for l in range(2)], rel=1e-5)
    assert header["sparsity"]["thresholds"] != base["sparsity"]["thresholds"]


def test_distill_steps_bad_values_are_one_error(built, tmp_path):
    with pytest.raises(DejavuError, match="--distill-steps must be a non-negative integer"):
        BuildConfig(density=0.5, distill_steps=-1)
    with pytest.raises(DejavuError, match="--distill-batch must be a positive integer"):
        BuildConfig(density=0.5, distill_batch=0)
    with pytest.raises(DejavuError, match="--distill-steps 100000 --distill-batch 1: the calibration corpus has "
                                          "fewer than"):
        build_engine(built[0], BuildConfig(density=0.6, distill_steps=100000, **CALIB), tmp_path / "x.engine",
                     progress=False)
    assert not (tmp_path / "x.engine").exists()


def test_a_half_checkpoint_builds_from_its_own_bytes(tmp_path):
    """A bf16 checkpoint builds with its weights held in bf16 (compiler.build_llama.load_build_model) into the
    engine the same values give as an fp32 checkpoint: the same thresholds, skips and kernel-layout tensors."""
    from safetensors.torch import load_file, save_file

    from dejavu.compiler.build_llama import load_build_model

    engines = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        folder = write_tiny_llama(tmp_path / name, seed=4)
        sd = load_file(str(folder / "model.safetensors"))
        save_file({k: v.to(torch.bfloat16).to(dt) for k, v in sd.items()}, str(folder / "model.safetensors"))
        build_engine(folder, BuildConfig(density=0.6, **CALIB), tmp_path / f"{name}.engine", progress=False)
        engines[name] = read_engine(tmp_path / f"{name}.engine")
    model, _ = load_build_model(tmp_path / "bf16", BuildConfig(density=0.6, **CALIB))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    (hb, tb), (hf, tf) = engines["bf16"], engines["fp32"]
    assert hb["sparsity"] == hf["sparsity"] and hb["sparsity"]["skip"] > 0
    assert tb.keys() == tf.keys() and all(torch.equal(tb[k], tf[k]) for k in tb)


def test_offloaded_layers_compute_what_the_model_computes():
    """offload_layers (a build whose weights do not fit its device): each layer computes on copies of its
    parameters made for its forward, and its parameters are the home tensors again after it; the logits and
    calibration tables equal the model's own (on a GPU: test_offloaded_build_equals_the_on_device_build)."""
    from dejavu.compiler.build_llama import _Blocks, offload_layers
    from dejavu.compiler.gated_sparsity import calibrate

    ref, model = tiny_llama(seed=6, tie_word_embeddings=False), tiny_llama(seed=6, tie_word_embeddings=False)
    home = [p.data_ptr() for p in model.layers.parameters()]
    offload_layers(model, "cpu")
    ids = _ids()
    seen = []
    model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(m.weight.data_ptr()))
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))
        a, b = calibrate(_Blocks(model), ids).tables, calibrate(_Blocks(ref), ids).tables
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [p.data_ptr() for p in model.layers.parameters()] == home
    assert len(seen) == 2 and home[-1] not in seen  # the forward read a copy (down_proj's weight: the last)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA build to offload")
def test_offloaded_build_equals_the_on_device_build(tmp_path, monkeypatch):
    """On a GPU: a build whose layers are offloaded (offload_needed forced) writes the engine a build held on the
    device writes: the same skips, thresholds and tensors (passed on an H100, 2026-12-06, dfb1057)."""
    import dejavu.compiler.build_llama as BL

    folder = write_tiny_llama(tmp_path / "m", seed=4)
    cfg = dict(density=0.6, calib_tokens=512, calib_window=128, dtype="float16", device="cuda")
    build_engine(folder, BuildConfig(**cfg), tmp_path / "a.engine", progress=False)
    monkeypatch.setattr(BL, "offload_needed", lambda need, device: True)
    build_engine(folder, BuildConfig(**cfg), tmp_path / "b.engine", progress=False)
    (ha, ta), (hb, tb) = read_engine(tmp_path / "a.engine"), read_engine(tmp_path / "b.engine")
    assert ha["sparsity"] == hb["sparsity"] and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_offloaded_build_on_the_cpu_and_what_it_refuses(tmp_path, monkeypatch, capsys):
    """The build path with offload_needed forced on the CPU (layers copied for their forwards) writes the engine a
    plain build writes, and says so in one progress line; with a flag that needs the whole model in fp32 on the
    device (--distill-steps) it is one DejavuError line and no file."""
    import dejavu.compiler.build_llama as BL

    folder = write_tiny_llama(tmp_path / "m", seed=4)
    build_engine(folder, BuildConfig(density=0.6, **CALIB), tmp_path / "a.engine", progress=False)
    monkeypatch.setattr(BL, "offload_needed", lambda need, device: True)
    build_engine(folder, BuildConfig(density=0.6, **CALIB), tmp_path / "b.engine", progress=True)
    assert "held in host memory, each layer brought to the device" in capsys.readouterr().err
    (ha, ta), (hb, tb) = read_engine(tmp_path / "a.engine"), read_engine(tmp_path / "b.engine")
    assert ha["sparsity"] == hb["sparsity"] and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    with pytest.raises(DejavuError, match=r"do not fit cpu, and --distill-steps needs the whole model there"):
        build_engine(folder, BuildConfig(density=0.6, distill_steps=2, **CALIB), tmp_path / "c.engine", progress=False)
    assert not (tmp_path / "c.engine").exists()
