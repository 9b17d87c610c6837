"""The `.engine` file: one safetensors file, a JSON header in its metadata, format version 1.

Layout (valid safetensors; written by hand so the bytes are deterministic):

    u64 little-endian N | N bytes of JSON (canonical, space-padded to a multiple of 8) | data

The JSON maps tensor names (sorted) to {dtype, shape, data_offsets}; tensors are packed in
name order with no gaps. `__metadata__` holds three strings:

- `dejavu_header`: JSON (sorted keys, compact) of the header dict (see docs/ARCHITECTURE.md).
- `dejavu_checksum`: sha256 hex over the tensors sorted by name; for each tensor
  `name NUL dtype NUL json(shape) NUL` then its raw bytes.
- `dejavu_header_checksum`: sha256 hex of the `dejavu_header` text (so an edited header that
  is still valid JSON is caught too).

Reading verifies, in this order and before allocating anything large: the 8-byte header
length against the file size, the JSON header (it must equal its canonical re-encoding, so
any edited byte is caught), offsets (contiguous, ending exactly at the end of the file),
format name and version, both checksums, and the tensor names/shapes required by the model
config. Every failure is a `DejavuError`; nothing here unpickles.
"""
from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import struct
from pathlib import Path

import torch

from dejavu.errors import DejavuError
from dejavu.fileio import atomic_path

FORMAT_NAME = "dejavu-engine"
FORMAT_VERSION = 1
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own cap; a tokenizer.json is ~2 MB

_DTYPES = {  # safetensors dtype name <-> torch dtype
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
DTYPE_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


# --------------------------------------------------------------------------- encoding

def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return b""
    return t.view(-1).view(torch.uint8).numpy().tobytes()


def _checksum(items) -> str:
    """sha256 over (name, dtype, shape, bytes) for items sorted by name."""
    h = hashlib.sha256()
    for name, dtype, shape, data in items:
        h.update(f"{name}\0{dtype}\0{json.dumps(list(shape))}\0".encode())
        h.update(data)
    return h.hexdigest()


def _header_blob(meta: dict, entries: dict) -> bytes:
    obj = dict(entries)
    obj["__metadata__"] = meta
    blob = _canonical(obj).encode()
    return blob + b" " * (-len(blob) % 8)


class TensorPart:
    """One tensor to write: its dtype, shape and a callable yielding its raw bytes in chunks
    (so a writer never holds more than a chunk of a tensor stored elsewhere, e.g. on disk)."""

    def __init__(self, dtype: torch.dtype, shape, chunks):
        if dtype not in _NAMES:
            raise DejavuError(f"engine tensor dtype {dtype} is not supported")
        self.dtype, self.shape, self.chunks = dtype, [int(s) for s in shape], chunks
        numel = 1
        for n in self.shape:
            numel *= n
        self.nbytes = numel * dtype.itemsize

    @classmethod
    def of(cls, name: str, t) -> "TensorPart":
        if not isinstance(t, torch.Tensor):
            raise DejavuError(f"engine tensor {name!r} is not a torch.Tensor")
        if t.dtype not in _NAMES:
            raise DejavuError(f"engine tensor {name!r} has unsupported dtype {t.dtype}")
        return cls(t.dtype, t.shape, lambda: iter((_tensor_bytes(t),)))


def _header_text(header: dict) -> str:
    if not isinstance(header, dict):
        raise DejavuError("engine header must be a dict")
    try:
        return _canonical(header)
    except (TypeError, ValueError) as e:
        raise DejavuError(f"engine header is not JSON-serialisable: {e}") from None


class PartsWriter:
    """An engine written to the seekable binary file `f` a tensor at a time: the tensors' names, dtypes and
    shapes up front ({name: (dtype, shape)}), then `tensor(name, chunks)` in name order, then `close()` -> the
    size. The data are streamed while the checksum is computed; the safetensors header, whose length does not
    depend on the checksum's value (64 hex digits), is written first with a placeholder and rewritten in place
    at the end. Several writers can be fed from one pass over the tensors (tensor-parallel shards)."""

    def __init__(self, f, header: dict, layout: dict[str, tuple[torch.dtype, list]]):
        header_text = _header_text(header)
        self.f, self.entries, self.order, off = f, {}, sorted(layout), 0
        for name in self.order:
            dtype, shape = layout[name]
            p = TensorPart(dtype, shape, None)
            self.entries[name] = {"dtype": _NAMES[dtype], "shape": p.shape, "data_offsets": [off, off + p.nbytes]}
            off += p.nbytes
        self.meta = {"dejavu_header": header_text,
                     "dejavu_header_checksum": hashlib.sha256(header_text.encode()).hexdigest(),
                     "dejavu_checksum": "0" * 64}
        self.blob = _header_blob(self.meta, self.entries)
        self.start = f.tell()
        f.write(struct.pack("<Q", len(self.blob)) + self.blob)
        self.h, self.next = hashlib.sha256(), 0

    def tensor(self, name: str, chunks) -> None:
        """The next tensor (name order): its raw bytes in chunks."""
        if self.next >= len(self.order) or self.order[self.next] != name:
            raise DejavuError(f"engine tensor {name!r} written out of order")
        e = self.entries[name]
        self.h.update(f"{name}\0{e['dtype']}\0{json.dumps(e['shape'])}\0".encode())
        n = 0
        for chunk in chunks:
            self.h.update(chunk)
            self.f.write(chunk)
            n += len(chunk)
        want = e["data_offsets"][1] - e["data_offsets"][0]
        if n != want:
            raise DejavuError(f"engine tensor {name!r}: {n} bytes written, {want} expected")
        self.next += 1

    def close(self) -> int:
        if self.next != len(self.order):
            raise DejavuError(f"engine tensor {self.order[self.next]!r} was not written")
        end = self.f.tell()
        self.meta["dejavu_checksum"] = self.h.hexdigest()
        final = _header_blob(self.meta, self.entries)
        assert len(final) == len(self.blob)  # same length: the header is rewritten in place
        self.f.seek(self.start + 8)
        self.f.write(final)
        self.f.seek(end)
        return end - self.start


def write_parts(f, header: dict, parts: dict[str, TensorPart]) -> int:
    """Write an engine to the seekable binary file `f` from tensor parts; return its size (PartsWriter)."""
    w = PartsWriter(f, header, {n: (p.dtype, p.shape) for n, p in parts.items()})
    for name in sorted(parts):
        w.tensor(name, parts[name].chunks())
    return w.close()


def encode_engine(header: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    """The engine file's bytes (deterministic: same header and tensors, same bytes)."""
    buf = io.BytesIO()
    write_parts(buf, header, {n: TensorPart.of(n, t) for n, t in tensors.items()})
    return buf.getvalue()


def write_engine_parts(path: str | os.PathLike, header: dict, parts: dict[str, TensorPart]) -> int:
    """Write an engine from tensor parts atomically (temporary name, then rename); return its size."""
    _header_text(header)  # fail before creating anything
    try:
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                return write_parts(f, header, parts)
    except OSError as e:
        raise DejavuError(f"cannot write engine {path}: {e.strerror or e}") from None


def write_engine(path: str | os.PathLike, header: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Write an engine atomically (temporary name, then rename); return its size in bytes."""
    return write_engine_parts(path, header, {n: TensorPart.of(n, t) for n, t in tensors.items()})


# --------------------------------------------------------------------------- decoding

def _corrupt(path, why: str) -> DejavuError:
    return DejavuError(f"{path}: not a valid dejavu engine ({why})")


def _parse_container(buf, path) -> tuple[dict, dict, int]:
    """Validate the safetensors framing; return (metadata, tensor entries, data start)."""
    size = len(buf)
    if size < 8:
        raise _corrupt(path, f"file is {size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
        raise _corrupt(path, f"header length {n} does not fit the file size {size} (truncated or corrupt)")
    raw = bytes(buf[8:8 + n])
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _corrupt(path, "header is not valid JSON") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("__metadata__"), dict):
        raise _corrupt(path, "header has no __metadata__")
    meta = obj.pop("__metadata__")
    for k in ("dejavu_header", "dejavu_checksum", "dejavu_header_checksum"):
        if not isinstance(meta.get(k), str):
            raise _corrupt(path, f"metadata field {k!r} is missing")
    entries, end = {}, 0
    for name in sorted(obj):
        e = obj[name]
        if not (isinstance(e, dict) and set(e) == {"dtype", "shape", "data_offsets"}):
            raise _corrupt(path, f"tensor entry {name!r} is malformed")
        dt, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        ok_shape = isinstance(shape, list) and len(shape) <= 8 and all(
            type(s) is int and 0 <= s < 2**40 for s in shape)
        ok_offs = isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
        if dt not in _DTYPES or not ok_shape or not ok_offs:
            raise _corrupt(path, f"tensor entry {name!r} is malformed")
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * _DTYPES[dt].itemsize
        if offs[0] != end or offs[1] - offs[0] != nbytes:
            raise _corrupt(path, f"tensor {name!r} has inconsistent data offsets")
        end = offs[1]
        entries[name] = (dt, shape, offs[0], offs[1])
    try:
        canonical = _header_blob(meta, {k: obj[k] for k in obj})
    except (TypeError, ValueError):  # NaN / Infinity and the like are never written
        raise _corrupt(path, "header holds values dejavu never writes (edited)") from None
    if canonical != raw:
        raise _corrupt(path, "header bytes are not in canonical form (edited)")
    if 8 + n + end != size:
        raise _corrupt(path, f"data section is {size - 8 - n} bytes, expected {end} (truncated or padded)")
    return meta, entries, 8 + n


def _parse_header(meta: dict, path) -> dict:
    text = meta["dejavu_header"]
    if hashlib.sha256(text.encode()).hexdigest() != meta["dejavu_header_checksum"]:
        raise _corrupt(path, "header checksum mismatch (edited header)")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError):
        raise _corrupt(path, "dejavu_header is not valid JSON") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise _corrupt(path, f"format is not {FORMAT_NAME!r}")
    version = header.get("format_version")
    if version != FORMAT_VERSION:
        raise DejavuError(f"{path}: engine format version {version!r} is not supported "
                          f"(this dejavu reads version {FORMAT_VERSION}); rebuild it with dejavu-compile")
    return header


def _open(path):
    p = Path(path)
    if not p.is_file():
        raise DejavuError(f"engine file not found: {path}")
    try:
        return open(p, "rb")
    except OSError as e:
        raise DejavuError(f"cannot read engine {path}: {e.strerror or e}") from None


def read_header(path: str | os.PathLike) -> dict:
    """The header dict, from the safetensors header only (cheap; the data is not checked)."""
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        if len(first) < 8:
            raise _corrupt(path, f"file is {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", first)
        if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
            raise _corrupt(path, f"header length {n} does not fit the file size {size} (truncated or corrupt)")
        raw = f.read(n)
    # Reuse the full framing check on a view that claims the data is present; offsets
    # beyond the file are caught by read_engine, which checks the whole file.
    meta, _, _ = _parse_container(_HeaderOnly(first + raw, size), path)
    return _parse_header(meta, path)


class _HeaderOnly:
    """A bytes view of the first 8+N bytes that reports the real file size."""

    def __init__(self, data: bytes, size: int):
        self.data, self.size = data, size

    def __len__(self):
        return self.size

    def __getitem__(self, s):
        return self.data[s]


def expected_shapes(header: dict) -> dict[str, list[int]]:
    """Tensor name → shape required by `header['model_config']` / `['build_config']`.

    Predictor ranks are free (read from the `.a` tensors by the caller's check)."""
    from dejavu.models.opt import OPTConfig  # models is upstream of the engine format

    from dejavu.shards import tp_info

    cfg = OPTConfig.from_hf_dict(header.get("model_config"))
    V, E, D, F, H = cfg.vocab_size, cfg.word_embed_proj_dim, cfg.hidden_size, cfg.ffn_dim, cfg.num_attention_heads
    tp = tp_info(header)  # a tensor-parallel shard holds H/n heads and F/n neurons (docs/tensor_parallel.md)
    Dq = D if tp is None else tp["num_heads"] * (D // H)
    F = F if tp is None else tp["ffn_dim"]
    s = {"embed_tokens": [V, E], "embed_positions": [cfg.max_position_embeddings + 2, D]}
    if E != D:
        s["project_in"], s["project_out"] = [D, E], [E, D]
    if cfg.has_final_layer_norm:
        s["final_ln.weight"] = s["final_ln.bias"] = [D]
    for l in range(cfg.num_hidden_layers):
        p = f"layers.{l}."
        s.update({p + "ln_attn.weight": [D], p + "ln_attn.bias": [D], p + "ln_mlp.weight": [D],
                  p + "ln_mlp.bias": [D], p + "attn.wq": [Dq, D], p + "attn.bq": [Dq],
                  p + "attn.wkv": [2 * Dq, D], p + "attn.bkv": [2 * Dq], p + "attn.wo_t": [Dq, D],
                  p + "attn.bo": [D], p + "mlp.w1": [F, D], p + "mlp.b1": [F], p + "mlp.w2_t": [F, D],
                  p + "mlp.b2": [D]})
    return s


def llama_vector_shapes(cfg) -> list[tuple[str, int]]:
    """(tensor name after "layers.l.", length) of a Llama-family layer's optional vectors (a LlamaConfig's; none
    for Llama-2/3): the biases of q/k/v (Qwen2, attention_bias), o (attention_bias), gate/up and down (mlp_bias),
    and the q and k heads' RMSNorm weights (Qwen3)."""
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    out = [("attn.bqkv", qkv)] if cfg.attention_bias or cfg.qkv_bias else []
    out += [("attn.bo", cfg.hidden_size)] if cfg.attention_bias else []
    out += [("attn.q_norm", cfg.head_dim), ("attn.k_norm", cfg.head_dim)] if cfg.qk_norm else []
    return out + ([("mlp.bgu", 2 * cfg.intermediate_size), ("mlp.bd", cfg.hidden_size)] if cfg.mlp_bias else [])


def llama_shapes(header: dict) -> dict[str, list[int]]:
    """Tensor name → shape of a Llama-family engine (compiler/build_llama.py's kernel layout)."""
    from dejavu.models.llama import LlamaConfig

    cfg = LlamaConfig.from_hf_dict(header.get("model_config"))
    V, D, F, L = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    qo, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    s = {"embed_tokens": [V, D], "final_norm": [D]}
    if not cfg.tie_word_embeddings:
        s["lm_head"] = [V, D]
    for l in range(L):
        p = f"layers.{l}."
        s.update({p + "attn_norm": [D], p + "mlp_norm": [D], p + "attn.wqkv_t": [D, qo + 2 * kv],
                  p + "attn.wo_t": [qo, D], p + "mlp.wgu_t": [D, 2 * F], p + "mlp.wd_t": [F, D]})
        s.update({p + name: [n] for name, n in llama_vector_shapes(cfg)})
    return s


def _check_llama_sparsity(header: dict, path) -> None:
    sp, L = header.get("sparsity"), header["model_config"]["num_hidden_layers"]
    if not isinstance(sp, dict) or sp.get("method") != "teal" or not isinstance(sp.get("thresholds"), dict):
        raise _corrupt(path, "sparsity must be {method: teal, skip, thresholds}")
    for key in ("attn_in", "o_in", "mlp_in", "down_in"):
        t = sp["thresholds"].get(key)
        if not (isinstance(t, list) and len(t) == L and all(type(v) in (int, float) and v >= 0 for v in t)):
            raise _corrupt(path, f"sparsity.thresholds.{key} must list {L} non-negative numbers")


def _check_contents(header: dict, entries: dict, path) -> None:
    if header.get("model_family", "opt") == "llama":
        try:
            want = llama_shapes(header)
        except DejavuError as e:
            raise _corrupt(path, f"model_config: {e}") from None
        _check_llama_sparsity(header, path)
        _check_names_shapes(header, want, entries, path)
        return
    if header.get("model_family", "opt") != "opt":
        raise _corrupt(path, f"model_family {header.get('model_family')!r} is not 'opt' or 'llama'")
    mc = header.get("model_config")
    L = mc.get("num_hidden_layers") if isinstance(mc, dict) else None
    if type(L) is int and L * 14 > len(entries):  # bound the work before listing names per layer
        raise _corrupt(path, f"model_config has {L} layers but the file holds {len(entries)} tensors")
    try:
        want = expected_shapes(header)
    except DejavuError as e:
        raise _corrupt(path, f"model_config: {e}") from None
    bc = header.get("build_config")
    if not isinstance(bc, dict):
        raise _corrupt(path, "build_config is missing")
    L, F, H, D = mc["num_hidden_layers"], mc["ffn_dim"], mc["num_attention_heads"], mc["hidden_size"]
    for key, n in (("mlp_k", F), ("attn_k", H)):
        ks = bc.get(key)
        if not (isinstance(ks, list) and len(ks) == L and all(type(k) is int and 1 <= k <= n for k in ks)):
            raise _corrupt(path, f"build_config.{key} must list {L} integers in [1, {n}]")
    stored = {}  # name -> the dtype it is stored in where not the engine dtype (int8 predictors)
    if bc.get("predictors", True):
        tp = bc.get("tp")  # validated by expected_shapes: predictor rows of this shard only
        Fr, Hr = (F, H) if tp is None else (tp["ffn_dim"], tp["num_heads"])
        forms = predictor_dtypes(header)
        for l in range(L):
            for kind, n in (("pred_mlp", Fr), ("pred_attn", Hr)):
                p = f"layers.{l}.{kind}."
                a = entries.get(p + "a")
                r = a[1][0] if a and len(a[1]) == 2 else -1
                want.update({p + "a": [r, D], p + "b": [n, r], p + "bias": [n]})
                if forms[kind[len("pred_"):]] == "int8":
                    want.update({p + "a_scale": [r], p + "b_scale": [n]})
                    stored.update({p + "a": "I8", p + "b": "I8", p + "a_scale": "F16", p + "b_scale": "F16"})
    _check_names_shapes(header, want, entries, path, stored)


PREDICTOR_DTYPES = ("float", "int8")  # a predictor kind's storage (build_config.predictor_dtype)


def predictor_dtypes(header: dict) -> dict[str, str]:
    """{"mlp"|"attn": "float"|"int8"} from build_config.predictor_dtype; engines without the field: float.
    int8: a, b int8 with one fp16 scale a row (.a_scale [r], .b_scale [N]), the bias in the engine dtype."""
    got = (header.get("build_config") or {}).get("predictor_dtype")
    if got is None:
        return {"mlp": "float", "attn": "float"}
    if not (isinstance(got, dict) and set(got) == {"mlp", "attn"} and all(v in PREDICTOR_DTYPES for v in got.values())):
        raise DejavuError(f"engine header: build_config.predictor_dtype must map mlp and attn to one of "
                          f"{PREDICTOR_DTYPES}, got {got!r}")
    return dict(got)


def _check_names_shapes(header: dict, want: dict, entries: dict, path, stored: dict | None = None) -> None:
    missing = sorted(set(want) - set(entries))
    extra = sorted(set(entries) - set(want))
    if missing:
        raise _corrupt(path, f"missing tensor {missing[0]!r}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    if extra:
        raise _corrupt(path, f"unexpected tensor {extra[0]!r}")
    dtype = header.get("dtype")
    if dtype not in DTYPE_NAMES:
        raise _corrupt(path, f"dtype {dtype!r} is not one of {sorted(DTYPE_NAMES)}")
    for name, shape in want.items():
        dt, got = entries[name][0], entries[name][1]
        if got != shape:
            raise _corrupt(path, f"tensor {name!r} has shape {got}, expected {shape}")
        own = (stored or {}).get(name)  # stored in its own dtype (int8 predictors), else the engine's
        if (own is not None and dt != own) or (own is None and _DTYPES[dt] != DTYPE_NAMES[dtype]):
            raise _corrupt(path, f"tensor {name!r} is {dt}, expected {own or 'the engine dtype ' + dtype}")


def read_engine(path: str | os.PathLike, device: str | torch.device = "cpu",
                verify: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """Load and verify an engine: (header, {name: tensor}) with tensors on `device`.

    `verify=False` skips only the data checksum (for quick loads of trusted files)."""
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise _corrupt(path, "file is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            meta, entries, start = _parse_container(mm, path)
            header = _parse_header(meta, path)
            _check_contents(header, entries, path)
        data = bytearray(size - start)  # one copy of the tensor bytes, read straight into place
        f.seek(start)
        if f.readinto(data) != len(data):
            raise _corrupt(path, "file changed while reading")
    view = memoryview(data)
    if verify:
        items = ((n, dt, shape, view[a:b]) for n, (dt, shape, a, b) in entries.items())
        if _checksum(items) != meta["dejavu_checksum"]:
            raise _corrupt(path, "tensor checksum mismatch (corrupt data)")
    tensors = {}
    for name, (dt, shape, a, b) in entries.items():
        if b > a and a % _DTYPES[dt].itemsize == 0:
            t = torch.frombuffer(data, dtype=_DTYPES[dt], count=(b - a) // _DTYPES[dt].itemsize, offset=a)
        elif b > a:  # misaligned for its dtype (mixed dtypes): copy to aligned memory
            t = torch.frombuffer(bytearray(view[a:b]), dtype=_DTYPES[dt])
        else:
            t = torch.empty(0, dtype=_DTYPES[dt])
        tensors[name] = t.view(shape).to(device)
    return header, tensors
