"""One place that picks the model family: OPT or Llama, from a folder's config.json or a GGUF file.

    model, cfg = load_any("smollm2-135m")        # packaged GGUF preset
    model, cfg = load_any("/ckpt/Llama-3-8B")    # Hugging Face folder, model_type llama
    tok = load_text_tokenizer("opt-mini")

A name is a GGUF preset, a `.gguf` file, or what `dejavu.models.presets.resolve` accepts
(folder, OPT preset, hub id). OPT folders go through `dejavu.models.loader.load_model`;
Llama-family folders (model_type llama / mistral) and GGUF files load here, built on the meta
device and filled tensor by tensor (mmap), like the OPT loader.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dejavu.errors import DejavuError
from dejavu.models.llama import MODEL_TYPES as LLAMA_TYPES
from dejavu.models.llama import LlamaConfig, LlamaForCausalLM, fold_multipliers, unfuse
from dejavu.models.presets import gguf_preset_path, resolve
from dejavu.models.tokenizer import end_ids, eos_field


def gguf_path(name_or_path: str | os.PathLike) -> Path | None:
    """The GGUF file a name stands for (a packaged preset or a .gguf path), else None."""
    preset = gguf_preset_path(str(name_or_path))
    if preset is not None:
        return preset
    p = Path(name_or_path).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise DejavuError(f"GGUF file not found: {p}")
        return p
    return None


def model_type(name_or_path: str | os.PathLike) -> str:
    """A folder's config.json `model_type`: 'opt' or one of the Llama family's (models.llama.MODEL_TYPES); 'llama'
    for a GGUF file (the family, which is all callers pick by; its loader reads the file's own architecture)."""
    if gguf_path(name_or_path) is not None:
        return "llama"
    path = resolve(name_or_path) / "config.json"
    try:
        mt = json.loads(path.read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise DejavuError(f"{path}: unreadable config.json ({type(e).__name__})") from None
    if mt != "opt" and mt not in LLAMA_TYPES:
        raise DejavuError(f"{path}: model_type {mt!r} is not supported (opt, {', '.join(LLAMA_TYPES)})")
    return mt


def _fill(cfg: LlamaConfig, tensors, where: str, dtype, device) -> LlamaForCausalLM:
    """A LlamaForCausalLM built on meta and filled from (HF name, tensor) pairs, checked whole."""
    from dejavu.models.loader import _name_some, _no_init

    with torch.device("meta"), _no_init():
        model = LlamaForCausalLM(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = cfg.tie_word_embeddings
    state: dict[str, torch.Tensor] = {}
    unexpected = []
    for key, t in tensors:
        if key not in expected or (tied and key == "lm_head.weight"):
            if not (tied and key == "lm_head.weight"):
                unexpected.append(key)
            continue
        if tuple(t.shape) != expected[key]:
            raise DejavuError(f"{where}: tensor {key!r} has shape {list(t.shape)}, but the config "
                              f"implies {list(expected[key])}")
        state[key] = t.to(device=device, dtype=dtype if t.is_floating_point() and dtype is not None else t.dtype)
    if unexpected:
        raise DejavuError(f"{where}: unexpected tensors in the checkpoint: {_name_some(unexpected)}")
    missing = set(expected) - set(state) - ({"lm_head.weight"} if tied else set())
    if missing:
        raise DejavuError(f"{where}: tensors missing from the checkpoint: {_name_some(missing)}")
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight  # assign=True broke the tie
    model.rope_to(device)  # non-persistent buffers: still on meta
    return model.eval()


def load_llama(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", gguf_stored: bool = False) -> tuple[LlamaForCausalLM, LlamaConfig]:
    """A Llama-family model from a GGUF file / preset or a Hugging Face folder (safetensors or .bin); its
    floating tensors in `dtype`, or as the file stores them where dtype is None (GGUF: dequantized to fp32, or
    with gguf_stored in the type the file stores, a quantized type dequantized to fp16)."""
    from dejavu.models.loader import check_device

    device = check_device(device)
    gp = gguf_path(name_or_path)
    if gp is not None:
        from dejavu.models import gguf

        reader = gguf.open_gguf(gp)
        d = gguf.config_dict(reader, gp)
        cfg = _config(d, gp)
        held = None if gguf_stored and dtype is None else torch.float32
        pairs, cfg = fold_multipliers(unfuse(gguf.iter_tensors(reader, d, held, gp), cfg), cfg)  # Granite's
        return _fill(cfg, pairs, str(gp), dtype, device), cfg
    from dejavu.models.loader import iter_weights, weight_files

    folder = resolve(name_or_path)
    cfg = _config(folder_config(folder), folder / "config.json")
    pairs = unfuse(iter_weights(weight_files(folder)), cfg)  # Phi-3's fused q/k/v and gate/up split
    pairs, cfg = fold_multipliers(pairs, cfg)  # Granite's multipliers into the weights
    return _fill(cfg, pairs, str(folder), dtype, device), cfg


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DejavuError(f"{path}: not valid JSON ({e})") from None


def folder_config(folder: Path) -> dict:
    """A Hugging Face folder's config.json, its eos_token_id joined by generation_config.json's where that names
    others (Llama-3-8B-Instruct: <|eot_id|>; Qwen2.5-Instruct: <|endoftext|>): the ids transformers' and vLLM's
    generate stop at. config.json's first id stays the first."""
    d = _json(folder / "config.json")
    gen = folder / "generation_config.json"
    if isinstance(d, dict) and gen.is_file():
        g = _json(gen)
        extra = g.get("eos_token_id") if isinstance(g, dict) else None
        if extra is not None:
            try:
                d = {**d, "eos_token_id": eos_field(end_ids(d.get("eos_token_id")) + end_ids(extra))}
            except DejavuError as e:
                raise DejavuError(f"{folder}: {e}") from None
    return d


def _config(d: dict, where) -> LlamaConfig:
    try:
        return LlamaConfig.from_hf_dict(d)
    except DejavuError as e:
        raise DejavuError(f"{where}: {e}") from None


def load_any(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu"):
    """(model, config) of any supported family; the one dispatch on model_type."""
    if model_type(name_or_path) == "opt":
        from dejavu.models.loader import load_model

        return load_model(name_or_path, dtype=dtype, device=device)
    return load_llama(name_or_path, dtype=dtype, device=device)


def folder_chat_template(folder: Path) -> str | None:
    """A Hugging Face folder's chat template, as transformers loads it: `chat_template.jinja` (transformers >= 4.50
    writes it there), else tokenizer_config.json's `chat_template` (a string, or a list of named templates: the
    "default" one); None where it has none (an unreadable tokenizer_config.json has none)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8") or None
        except (OSError, UnicodeDecodeError) as e:
            raise DejavuError(f"{jinja}: unreadable ({type(e).__name__})") from None
    try:
        t = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    if isinstance(t, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) and t else None


def load_chat_template(name_or_path: str | os.PathLike) -> str | None:
    """The chat template of any supported model (dejavu-serve's chat endpoint): a GGUF file's
    `tokenizer.chat_template`, a folder's (folder_chat_template); None where it has none."""
    gp = gguf_path(name_or_path)
    if gp is None:
        return folder_chat_template(resolve(name_or_path))
    from dejavu.models import gguf

    t = gguf._field(gguf.open_gguf(gp), "tokenizer.chat_template")
    return t if isinstance(t, str) and t else None


_GGUF_SAMPLING = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
                  "top_k": "general.sampling.top_k", "min_p": "general.sampling.min_p",
                  "repetition_penalty": "general.sampling.penalty_repeat"}


def load_sampling_defaults(name_or_path: str | os.PathLike) -> dict:
    """The sampling settings the checkpoint's authors ship, of those dejavu samples with (temperature, top_p,
    top_k, min_p, repetition_penalty): what a folder's generation_config.json names (fields it leaves out are not
    filled in), or a GGUF file's `general.sampling.*`; vLLM and TensorRT-LLM serve with them where a request
    leaves them out. {} where there are none; DejavuError for a value out of range (dejavu.generation.model_sampling)."""
    from dejavu.generation import model_sampling

    gp = gguf_path(name_or_path)
    if gp is not None:
        from dejavu.models import gguf

        reader = gguf.open_gguf(gp)
        return model_sampling({k: gguf._field(reader, key) for k, key in _GGUF_SAMPLING.items()}, gp)
    path = resolve(name_or_path) / "generation_config.json"
    return model_sampling(_json(path), path) if path.is_file() else {}


def load_text_tokenizer(name_or_path: str | os.PathLike):
    """The `TextTokenizer` of any supported model (GGUF: built from the file's metadata)."""
    from dejavu.models.tokenizer import TextTokenizer

    gp = gguf_path(name_or_path)
    if gp is None:
        if model_type(name_or_path) == "opt":
            return TextTokenizer.from_pretrained(name_or_path)
        from dejavu.models.loader import load_tokenizer

        folder = resolve(name_or_path)
        cfg = _config(folder_config(folder), folder / "config.json")
        return TextTokenizer(load_tokenizer(folder), cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id,
                             add_bos=None)
    from dejavu.models import gguf

    reader = gguf.open_gguf(gp)
    ids = gguf.special_ids(reader)
    # Scored text starts with the document separator when the vocabulary has one (SmolLM2 separates its training
    # documents so); a prompt starts as llama.cpp starts it (gguf.build_tokenizer's post-processor).
    bos = ids["document_id"] if ids["document_id"] is not None else ids["bos_id"]
    return TextTokenizer(gguf.build_tokenizer(reader, gp), bos, ids["eos_id"], ids["pad_id"], add_bos=None)
