"""Load an OPT checkpoint folder (Hugging Face layout) into `dejavu.models.opt`.

Weights: `model.safetensors`, sharded safetensors (`model.safetensors.index.json`), or
`pytorch_model*.bin` (+ index), read with `weights_only=True` (no code is unpickled).
`Checkpoint` indexes a folder (every key and shape checked against config.json from the
files' headers) and reads tensors on demand in their stored dtype. `load_model` fills a
model built on the meta device tensor by tensor (peak: about one copy of the model in the
target dtype); the compiler instead streams one decoder layer at a time
(`iter_decoder_layers`, `load_decoder_shell`). Key prefixes `model.decoder.` and `decoder.`
are both accepted; the tied `lm_head.weight` may be absent.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

import torch

from dejavu.errors import DejavuError
from dejavu.models.opt import OPTConfig, OPTDecoder, OPTDecoderLayer, OPTForCausalLM
from dejavu.models.presets import resolve

TIED_KEY = "lm_head.weight"
DECODER = "model.decoder."
EMBED_KEY = DECODER + "embed_tokens.weight"


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


def _open_safetensors(path: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")  # mmap; validates header + size
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise DejavuError(f"{path}: truncated or corrupt safetensors file ({_first_line(e)})") from None


def _load_bin(path: Path) -> dict:
    """A .bin state dict, memory-mapped where the file allows (zip format)."""
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
    for key, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise DejavuError(f"{path}: entry {key!r} is a {type(t).__name__}, not a tensor")
    return sd


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of every tensor in the weight files, one file mapped at a time (a loader for
    models whose layout `Checkpoint` does not know, e.g. the Llama family)."""
    from safetensors import SafetensorError

    for path in files:
        if path.suffix != ".safetensors":
            yield from _load_bin(path).items()
            continue
        with _open_safetensors(path) as f:
            for key in f.keys():
                try:
                    yield key, f.get_tensor(key)
                except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                    raise DejavuError(f"{path}: cannot read tensor {key!r} ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def _file_shapes(path: Path) -> list[tuple[str, tuple[int, ...]]]:
    """(key, shape) of every tensor in one weight file, without reading the data."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError

        with _open_safetensors(path) as f:
            try:
                return [(k, tuple(f.get_slice(k).get_shape())) for k in f.keys()]
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise DejavuError(f"{path}: truncated or corrupt safetensors file ({_first_line(e)})") from None
    return [(k, tuple(t.shape)) for k, t in _load_bin(path).items()]


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


def _meta_model(cfg: OPTConfig) -> OPTForCausalLM:
    with torch.device("meta"), _no_init():
        return OPTForCausalLM(cfg)


class Checkpoint:
    """Where each tensor of a checkpoint folder lives; reads tensors on demand in their stored dtype.

    Opening checks every key and shape against config.json (from the files' headers: no data
    is read), so a build fails before its long stages. `read(keys)` opens the files that hold
    them, yields one tensor at a time and closes the files again, so the mapped pages of
    finished layers are not kept resident.
    """

    def __init__(self, name_or_path: str | os.PathLike, cfg: OPTConfig | None = None):
        self.folder = resolve(name_or_path)
        self.cfg = cfg or load_config(self.folder)
        self.files = weight_files(self.folder)
        expected = {k: tuple(v.shape) for k, v in _meta_model(self.cfg).state_dict().items()}
        self.where: dict[str, tuple[Path, str]] = {}  # normalised key -> (file, key in the file)
        unexpected = []
        for path in self.files:
            for raw_key, shape in _file_shapes(path):
                key = _normalise_key(raw_key)
                if key not in expected:
                    unexpected.append(raw_key)
                    continue
                if shape != expected[key]:
                    raise DejavuError(f"{path.name}: tensor {raw_key!r} has shape {list(shape)}, but "
                                      f"config.json implies {list(expected[key])}")
                if key == TIED_KEY:
                    continue  # tied to embed_tokens
                if key in self.where:
                    raise DejavuError(f"{path.name}: tensor {raw_key!r} appears twice in the checkpoint")
                self.where[key] = (path, raw_key)
        if unexpected:
            raise DejavuError(f"{self.folder}: unexpected tensors in the checkpoint: {_name_some(unexpected)}")
        missing = set(expected) - set(self.where) - {TIED_KEY}
        if missing:
            raise DejavuError(f"{self.folder}: tensors missing from the checkpoint: {_name_some(missing)}")

    def read(self, keys) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, tensor in its stored dtype on the CPU) for each normalised key, file by file."""
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.where[key][0], []).append(key)
        for path, ks in by_file.items():
            if path.suffix == ".safetensors":
                yield from self._read_safetensors(path, ks)
            else:
                sd = _load_bin(path)
                for key in ks:
                    yield key, sd.pop(self.where[key][1])
                del sd

    def _read_safetensors(self, path: Path, keys: list[str]):
        from safetensors import SafetensorError

        if not path.is_file():
            raise DejavuError(f"{path}: weight file disappeared during the build")
        with _open_safetensors(path) as f:
            for key in keys:
                try:
                    t = f.get_tensor(self.where[key][1])
                except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                    raise DejavuError(f"{path}: cannot read tensor {key!r} ({_first_line(e)})") from None
                yield key, t

    def load_into(self, module: torch.nn.Module, prefix: str, dtype: torch.dtype | None, device) -> torch.nn.Module:
        """Fill `module` (built on meta) from the keys under `prefix`, cast to dtype (None: as
        stored) on device."""
        names = [n for n, _ in module.state_dict().items()]
        state = {}
        for key, t in self.read(prefix + n for n in names):
            # One tensor at a time: the mapped page is read, cast and moved, then released.
            dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
            state[key[len(prefix):]] = t.to(device=device, dtype=dt)
            del t
        module.load_state_dict(state, strict=True, assign=True)
        return module.eval()


def iter_decoder_layers(ckpt: Checkpoint, dtype: torch.dtype | None = torch.float32, device="cpu",
                        start: int = 0) -> Iterator[tuple[int, OPTDecoderLayer]]:
    """(index, OPTDecoderLayer) for layers start..L-1, each read from the checkpoint when reached
    (dtype None: as stored)."""
    for l in range(start, ckpt.cfg.num_hidden_layers):
        with torch.device("meta"), _no_init():
            layer = OPTDecoderLayer(ckpt.cfg)
        yield l, ckpt.load_into(layer, f"{DECODER}layers.{l}.", dtype, device)


def load_decoder_shell(ckpt: Checkpoint, dtype: torch.dtype = torch.float32, device="cpu") -> OPTDecoder:
    """The decoder without its layers: embeddings, project_in/out, final LayerNorm (the LM head
    is tied to embed_tokens)."""
    with torch.device("meta"), _no_init():
        dec = OPTDecoder(ckpt.cfg)
    dec.layers = torch.nn.ModuleList()
    return ckpt.load_into(dec, DECODER, dtype, device)


def check_device(device: str | torch.device) -> torch.device:
    """torch.device(device), or one DejavuError line when CUDA is asked for and absent."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DejavuError("device 'cuda' requested but no CUDA device is available")
    return device


def load_model(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> tuple[OPTForCausalLM, OPTConfig]:
    """Build OPTForCausalLM from a folder / preset / hub id; weights cast to `dtype` on `device`."""
    device = check_device(device)
    ckpt = Checkpoint(name_or_path)
    model = _meta_model(ckpt.cfg)
    del model.lm_head.weight  # tied: filled below
    ckpt.load_into(model, "", dtype, device)
    model.lm_head.weight = model.decoder.embed_tokens.weight  # assign=True broke the tie
    leftover = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if leftover:  # cannot happen if the key checks above are complete; keep the model honest
        raise DejavuError(f"{ckpt.folder}: tensors left unloaded: {_name_some(leftover)}")
    return model.eval(), ckpt.cfg


def load_tokenizer(name_or_path: str | os.PathLike):
    """A `tokenizers.Tokenizer` from tokenizer.json, or built from GPT-2 vocab.json + merges.txt, or from a
    SentencePiece tokenizer.model (as transformers converts one: `spm.folder_tokenizer`)."""
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
    if (folder / "tokenizer.model").is_file():
        from dejavu.models.spm import folder_tokenizer

        return folder_tokenizer(folder)
    raise DejavuError(f"{folder}: no tokenizer (tokenizer.json, vocab.json + merges.txt, or tokenizer.model)")


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
