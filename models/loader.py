"""Load an OPT checkpoint folder (Hugging Face layout) into `dejavu.models.opt`.

Weights: `model.safetensors`, sharded safetensors (`model.safetensors.index.json`), or
`pytorch_model*.bin` (+ index), read with `weights_only=True` (no code is unpickled).
The model is built on the meta device and filled tensor by tensor from memory-mapped files,
so peak memory is about one copy of the model in the target dtype (OPT-30B needs ~60 GB in
fp16, not 120 GB). Key prefixes `model.decoder.` and `decoder.` are both accepted; the tied
`lm_head.weight` may be absent.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

import torch

from dejavu.errors import DejavuError
from dejavu.models.opt import OPTConfig, OPTForCausalLM
from dejavu.models.presets import resolve

TIED_KEY = "lm_head.weight"
EMBED_KEY = "model.decoder.embed_tokens.weight"


def load_config(name_or_path: str | os.PathLike) -> OPTConfig:
    """The OPTConfig of a model folder's config.json (a preset name or hub id also works)."""
    folder = resolve(name_or_path)
    path = folder / "config.json"
    if not path.is_file():
        raise DejavuError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DejavuError(f"{path}: not valid JSON ({e})") from None
    try:
        return OPTConfig.from_hf_dict(d)
    except DejavuError as e:
        raise DejavuError(f"{path}: {e}") from None


def _normalise_key(key: str) -> str:
    """HF `OPTForCausalLM` names: `decoder.x` (bare OPTModel checkpoints) → `model.decoder.x`."""
    if key.startswith("decoder."):
        return "model." + key
    return key


def _index_files(folder: Path, index_name: str) -> list[Path]:
    index = folder / index_name
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise DejavuError(f"{index}: unreadable shard index ({type(e).__name__}: {e})") from None
    files = [folder / n for n in names]
    for f in files:
        if not f.is_file():
            raise DejavuError(f"{index} lists {f.name}, which is missing")
    return files


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint files of a folder, safetensors preferred over .bin."""
    if (folder / "model.safetensors.index.json").is_file():
        return _index_files(folder, "model.safetensors.index.json")
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    if (folder / "pytorch_model.bin.index.json").is_file():
        return _index_files(folder, "pytorch_model.bin.index.json")
    if (folder / "pytorch_model.bin").is_file():
        return [folder / "pytorch_model.bin"]
    found = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if found:  # shards without an index: take them all
        return found
    raise DejavuError(f"{folder}: no weights (model.safetensors, its index, or pytorch_model*.bin)")


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        f = safe_open(str(path), framework="pt", device="cpu")  # mmap; validates header + size
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise DejavuError(f"{path}: truncated or corrupt safetensors file ({_first_line(e)})") from None
    with f:
        for key in f.keys():
            try:
                t = f.get_tensor(key)
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise DejavuError(f"{path}: cannot read tensor {key!r} ({_first_line(e)})") from None
            yield key, t


def _iter_bin(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    def _load(mmap: bool):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)

    try:
        try:
            sd = _load(mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # legacy (non-zip) files cannot be mapped; others are errors
                raise
            sd = _load(mmap=False)
    except Exception as e:  # noqa: BLE001 - torch.load raises many types for a bad file
        raise DejavuError(f"{path}: truncated, corrupt or unsafe PyTorch weight file "
                          f"({type(e).__name__}: {_first_line(e)})") from None
    if not isinstance(sd, dict):
        raise DejavuError(f"{path}: expected a state dict, found {type(sd).__name__}")
    for key in list(sd):
        t = sd.pop(key)  # drop our reference as we go
        if not isinstance(t, torch.Tensor):
            raise DejavuError(f"{path}: entry {key!r} is a {type(t).__name__}, not a tensor")
        yield key, t


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def _iter_checkpoint(files: list[Path]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    for path in files:
        it = _iter_safetensors(path) if path.suffix == ".safetensors" else _iter_bin(path)
        for key, t in it:
            yield path, key, t


@contextlib.contextmanager
def _no_init():
    """Skip parameter init while building on meta: it is wasted work, and filling Embedding's
    padding row on a meta tensor imports torch._dynamo (seconds of CLI start-up)."""
    classes = (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm)
    saved = [c.__dict__["reset_parameters"] for c in classes]
    try:
        for c in classes:
            c.reset_parameters = lambda self: None
        yield
    finally:
        for c, fn in zip(classes, saved):
            c.reset_parameters = fn


def _name_some(keys, n: int = 4) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def load_model(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> tuple[OPTForCausalLM, OPTConfig]:
    """Build OPTForCausalLM from a folder / preset / hub id; weights cast to `dtype` on `device`."""
    folder = resolve(name_or_path)
    cfg = load_config(folder)
    files = weight_files(folder)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DejavuError("device 'cuda' requested but no CUDA device is available")

    with torch.device("meta"), _no_init():
        model = OPTForCausalLM(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for path, raw_key, t in _iter_checkpoint(files):
        key = _normalise_key(raw_key)
        if key not in expected:
            unexpected.append(raw_key)
            continue
        if tuple(t.shape) != expected[key]:
            raise DejavuError(f"{path.name}: tensor {raw_key!r} has shape {list(t.shape)}, but "
                              f"config.json implies {list(expected[key])}")
        if key == TIED_KEY:
            continue  # tied to embed_tokens; re-tied below
        if key in state:
            raise DejavuError(f"{path.name}: tensor {raw_key!r} appears twice in the checkpoint")
        # One tensor at a time: the mmap page is read, cast and moved, then released.
        state[key] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
        del t
    if unexpected:
        raise DejavuError(f"{folder}: unexpected tensors in the checkpoint: {_name_some(unexpected)}")
    missing = set(expected) - set(state) - {TIED_KEY}
    if missing:
        raise DejavuError(f"{folder}: tensors missing from the checkpoint: {_name_some(missing)}")

    model.load_state_dict(state, strict=False, assign=True)
    model.lm_head.weight = model.decoder.embed_tokens.weight  # assign=True broke the tie
    leftover = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if leftover:  # cannot happen if the key checks above are complete; keep the model honest
        raise DejavuError(f"{folder}: tensors left unloaded: {_name_some(leftover)}")
    model.eval()
    return model, cfg


def load_tokenizer(name_or_path: str | os.PathLike):
    """A `tokenizers.Tokenizer` from tokenizer.json, or built from GPT-2 vocab.json + merges.txt."""
    from tokenizers import Tokenizer

    folder = resolve(name_or_path)
    tj = folder / "tokenizer.json"
    if tj.is_file():
        try:
            return Tokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
            raise DejavuError(f"{tj}: unreadable tokenizer ({_first_line(e)})") from None
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if vocab.is_file() and merges.is_file():
        return gpt2_bpe_tokenizer(vocab, merges)
    raise DejavuError(f"{folder}: no tokenizer (tokenizer.json, or vocab.json + merges.txt)")


def gpt2_bpe_tokenizer(vocab: Path, merges: Path, bos_token: str = "</s>"):
    """Byte-level BPE like OPT's GPT2Tokenizer: no prefix space, `</s>` prepended as BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    try:
        bpe = models.BPE.from_file(str(vocab), str(merges))
    except Exception as e:  # noqa: BLE001
        raise DejavuError(f"{vocab.parent}: unreadable vocab.json/merges.txt ({_first_line(e)})") from None
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [s for s in ("<s>", "<pad>", "</s>", "<unk>") if tok.token_to_id(s) is not None]
    tok.add_special_tokens(specials)  # already in the vocab: keeps their ids, marks them special
    bos_id = tok.token_to_id(bos_token)
    if bos_id is None:
        raise DejavuError(f"{vocab}: no {bos_token!r} token to use as BOS")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B",
        special_tokens=[(bos_token, bos_id)])
    return tok
