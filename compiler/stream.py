"""Layer-streamed calibration, predictor training and kernel layout (docs/compiler.md, "Streaming").

One decoder layer is in memory at a time. The calibration hidden states [T, D] (every token
of the corpus, window by window, in the compute dtype) are carried from layer to layer on the
build device; layer l's forward over them records what its predictors learn from (the
predictor input, the MLP's active neurons, the heads' norms), its predictors are trained, its
kernel-layout tensors are spilled to the build-state folder, and the layer is dropped.

The state folder (`.OUT.build/` beside the output) makes a build resumable per layer:

    key.json               sha256 of every input that changes a layer's bytes
    shell.{bin,json}       embeddings, project_in/out, final LayerNorm (engine dtype)
    layer_NNNNN.{bin,json} one finished layer: engine tensors, fp32 predictors, metrics, curves
    carry_NNNNN.safetensors hidden states after layer NNNNN, the next layer's predictor input
                           source and the training generator's state
    progress.json          layers done (written last: a layer counts once all its files exist)

It holds at most one carry (T·D·(4 + 2) bytes; older ones are deleted) and the finished
layers (the engine's own bytes); it is deleted once the engine is written.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from dejavu.compiler.calibrate import head_contribution, head_gram
from dejavu.engine_file import TensorPart
from dejavu.errors import DejavuError
from dejavu.fileio import atomic_path, write_json
from dejavu.models.opt import POSITION_OFFSET

STATE_VERSION = 2  # 2: the MLP targets are stored in bfloat16 (1: float32)
CHUNK = 64 << 20  # bytes per read when copying spilled tensors into the engine
# The MLP predictors' targets [T, F] (each neuron's contribution, `predictors.mlp_contributions`):
# computed CHUNK bytes of fp32 rows at a time, stored in bfloat16 (float32's range: no
# overflow, and a token without active neurons stays all zero). float32 storage would be 4 T F
# bytes on the device, 7.5 GB at the OPT-30B shape with 65,536 tokens.
TARGET_DTYPE = torch.bfloat16


# ------------------------------------------------------------------------------- calibration

def calib_batches(n_tokens: int, window: int, batch_size: int) -> list[tuple[int, int, int]]:
    """(t0, t1, windows) per forward: full windows `batch_size` at a time, a short tail alone."""
    n_windows = -(-n_tokens // window)
    full = n_windows - 1 if n_tokens % window else n_windows
    out, done = [], 0
    while done < n_windows:
        b = max(1, min(batch_size, full - done)) if done < full else 1
        out.append((done * window, min((done + b) * window, n_tokens), b))
        done += b
    return out


@torch.no_grad()
def embed_tokens(dec, ids: np.ndarray, batches, dtype, device) -> torch.Tensor:
    """The residual entering layer 0 for every calibration token: [T, D] (each window at
    positions 0..S-1, as the whole model computes it)."""
    x = torch.empty(len(ids), dec.embed_positions.weight.shape[1], dtype=dtype, device=device)
    for t0, t1, b in batches:
        tok = torch.from_numpy(ids[t0:t1].astype(np.int64)).view(b, -1).to(device)  # [b, S]
        h = dec.embed_tokens(tok)  # [b, S, E]
        if dec.project_in is not None:
            h = dec.project_in(h)
        pos = torch.arange(tok.shape[1], device=device)[None, :].expand(*tok.shape)
        h = h + dec.embed_positions(pos.clamp(min=-1) + POSITION_OFFSET)
        x[t0:t1] = h.reshape(-1, x.shape[1])
    return x


@torch.no_grad()
def run_layer(layer, x: torch.Tensor, batches, cfg, record: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Run `layer` over the carried residual x [T, D] (replaced by its output, in place).

    Records (each on x's device): attn_in / mlp_in [T, D] fp16 (those named in `record`),
    mlp_active [T, F] bool (post-ReLU > 0), head_norm [T, H] fp32 (per-head L2 norm of its
    contribution to the layer output, `calibrate.head_contribution`). Hooks on the layer module, so the forward is the model's own."""
    T, D = x.shape
    H, hd, dev = cfg.num_attention_heads, cfg.head_dim, x.device
    rec = {n: torch.empty(T, D, dtype=torch.float16, device=dev) for n in record}
    rec["mlp_active"] = torch.empty(T, cfg.ffn_dim, dtype=torch.bool, device=dev)
    rec["head_norm"] = torch.empty(T, H, dtype=torch.float32, device=dev)
    rows = slice(0)

    def put(name, t):  # t: [b, S, X] -> rows of the [T, X] record
        if name in rec:
            rec[name][rows] = t.reshape(-1, t.shape[-1])

    gram = head_gram(layer.self_attn.out_proj.weight, H)  # [H, hd, hd], once for every batch
    hooks = [layer.register_forward_pre_hook(lambda m, a: put("attn_in", a[0].half())),
             layer.activation_fn.register_forward_hook(lambda m, a, out: put("mlp_active", out > 0)),
             layer.self_attn.out_proj.register_forward_pre_hook(
                 lambda m, a: put("head_norm", head_contribution(a[0].detach(), gram)))]
    if cfg.do_layer_norm_before:  # the residual after attention = input of final_layer_norm
        hooks.append(layer.final_layer_norm.register_forward_pre_hook(lambda m, a: put("mlp_in", a[0].half())))
    else:  # post-LN: the MLP reads the output of self_attn_layer_norm
        hooks.append(layer.self_attn_layer_norm.register_forward_hook(lambda m, a, out: put("mlp_in", out.half())))
    try:
        for t0, t1, b in batches:
            rows = slice(t0, t1)
            x[t0:t1] = layer(x[t0:t1].view(b, -1, D), None, None).reshape(-1, D)
    finally:
        for h in hooks:
            h.remove()
    return rec


# ------------------------------------------------------------------------------- build state

def file_fingerprint(files: list[Path]) -> list:
    """Name, size and sha256 of the first and last MiB of each weight file (cheap, catches edits
    of headers, lengths and most rewrites; the full data are not hashed)."""
    out = []
    for f in files:
        size = f.stat().st_size
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
        out.append([f.name, size, h.hexdigest()])
    return out


class BuildState:
    """The resumable build-state folder of one output (see the module docstring)."""

    def __init__(self, out: Path, key: dict):
        self.folder = out.parent / f".{out.name}.build"
        self.key = hashlib.sha256(json.dumps({"v": STATE_VERSION, **key}, sort_keys=True).encode()).hexdigest()
        try:
            old = json.loads((self.folder / "key.json").read_text())["key"]
        except (OSError, ValueError, KeyError, TypeError):
            old = None
        if old != self.key:  # other inputs (or none): start afresh
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder.mkdir()
            self._json("key.json", {"key": self.key})

    def _json(self, name: str, obj) -> None:
        write_json(self.folder / name, obj, indent=None, sort_keys=True)

    @property
    def layers_done(self) -> int:
        try:
            return int(json.loads((self.folder / "progress.json").read_text())["layers_done"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def has(self, part: str) -> bool:
        return (self.folder / f"{part}.json").is_file()

    def save_part(self, part: str, tensors: dict[str, torch.Tensor], info: dict) -> None:
        """Spill tensors (raw bytes, in name order) and their index + info; the .json marks it done."""
        index, off = {}, 0
        with atomic_path(self.folder / f"{part}.bin") as tmp, open(tmp, "wb") as f:
            for name in sorted(tensors):
                t = tensors[name].detach().cpu().contiguous()
                data = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
                f.write(data)
                index[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                               "offset": off, "nbytes": len(data)}
                off += len(data)
        self._json(f"{part}.json", {"tensors": index, "info": info})

    def part_info(self, part: str) -> dict:
        return json.loads((self.folder / f"{part}.json").read_text())

    def parts(self, part: str, prefix: str = "", consume: bool = False) -> dict[str, TensorPart]:
        """The spilled tensors whose names start with `prefix`, as engine-writer parts.

        consume: the part's file is deleted once its last tensor (in name order, the order
        the engine is written in) has been read, so the state and the engine do not both
        hold the whole model on disk; a build killed then starts afresh."""
        path, out, index = self.folder / f"{part}.bin", {}, self.part_info(part)["tensors"]
        names = sorted(n for n in index if n.startswith(prefix))
        for name in names:
            e = index[name]
            last = consume and name == names[-1]
            out[name] = TensorPart(getattr(torch, e["dtype"]), e["shape"],
                                   lambda p=path, o=e["offset"], n=e["nbytes"], d=last: _read_range(p, o, n, d))
        return out

    def tensors(self, part: str, prefix: str = "") -> dict[str, torch.Tensor]:
        """The spilled tensors in memory (one layer's predictors for --onnx-out and resolve K)."""
        return in_memory(self.parts(part, prefix))

    def save_carry(self, layers_done: int, carry: dict[str, torch.Tensor]) -> None:
        """The state after `layers_done` layers; then progress.json; then older carries go."""
        from safetensors.torch import save_file

        name = f"carry_{layers_done:05d}.safetensors"
        with atomic_path(self.folder / name) as tmp:
            save_file({k: v.detach().cpu().contiguous() for k, v in carry.items()}, str(tmp))
        self._json("progress.json", {"layers_done": layers_done})
        for old in self.folder.glob("carry_*.safetensors"):
            if old.name != name:
                old.unlink()

    def load_carry(self, layers_done: int, device) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        path = self.folder / f"carry_{layers_done:05d}.safetensors"
        try:
            return {k: v.to(device) for k, v in load_file(str(path)).items()}
        except Exception as e:  # noqa: BLE001 - a damaged state folder: start afresh next time
            shutil.rmtree(self.folder, ignore_errors=True)
            raise DejavuError(f"build state {path} is unreadable ({type(e).__name__}); "
                              "it was removed, run the build again") from None

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.folder.iterdir() if f.is_file())

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def in_memory(parts: dict[str, TensorPart]) -> dict[str, torch.Tensor]:
    """Tensors from engine-writer parts (reads them whole)."""
    return {n: torch.frombuffer(bytearray(b"".join(p.chunks())), dtype=p.dtype).view(p.shape)
            if p.nbytes else torch.empty(p.shape, dtype=p.dtype) for n, p in parts.items()}


def _read_range(path: Path, offset: int, nbytes: int, delete_after: bool = False):
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            while nbytes > 0:
                chunk = f.read(min(CHUNK, nbytes))
                if not chunk:
                    raise DejavuError(f"build state {path} is truncated; remove it and run the build again")
                nbytes -= len(chunk)
                yield chunk
    except OSError as e:
        raise DejavuError(f"cannot read build state {path}: {e.strerror or e}") from None
    if delete_after:
        (path.parent / "progress.json").unlink(missing_ok=True)  # the state is no longer whole
        path.unlink()


def predictor_input_of(l: int, rec: dict, prev: torch.Tensor | None, source: str, lookahead: int):
    """What layer l's predictors read: src[l - lookahead]; layer 0's attn_in below layer 0.
    rec: layer l's records; prev: the previous layer's `source` record. [T, D] fp16."""
    if lookahead == 0:
        return rec["attn_in"]
    return rec["attn_in"] if l == 0 else prev


def records_needed(l: int, source: str, lookahead: int) -> tuple[str, ...]:
    need = {"mlp_in"}  # the MLP predictors' targets: the neurons' contributions on it
    if lookahead:
        need.add(source)
    if lookahead == 0 or l == 0:
        need.add("attn_in")
    return tuple(sorted(need))


def mlp_targets(layer, mlp_in: torch.Tensor, device) -> torch.Tensor:
    """The MLP predictors' targets for `layer` over its recorded mlp_in [T, D]: [T, F] TARGET_DTYPE
    on `device`, a chunk of rows at a time (never [T, F] in float32). Training reads them
    through operations that scale each token's row by its sum and compare summed shares, so the
    bfloat16 rounding (relative error <= 2^-8 per element) is all that changes (docs/compiler.md)."""
    from dejavu.compiler.predictors import mlp_contributions

    T, F = len(mlp_in), layer.fc1.out_features
    out = torch.empty(T, F, dtype=TARGET_DTYPE, device=device)
    rows = max(1, CHUNK // (4 * F))
    for i in range(0, T, rows):
        out[i:i + rows] = mlp_contributions(layer, mlp_in[i:i + rows], chunk=rows).to(device, TARGET_DTYPE)
    return out


def predictor_tensors(l: int, dtype, pm: dict | None, pa: dict | None) -> dict[str, torch.Tensor]:
    """Layer l's predictors as the engine stores them, and in fp32 under `fp32.` (kept for --onnx-out and
    resolve K, never written to the engine). A predictor with scales (`predictors.int8_rows`: a, b its
    dequantized values) is stored as a, b int8 (a / scale, exact) with .a_scale / .b_scale fp16; the bias,
    and every tensor of a float predictor, in the engine dtype."""
    out = {}
    for kind, p in (("pred_mlp", pm), ("pred_attn", pa)):
        if p is None:
            continue
        for n in ("a", "b", "bias", "a_scale", "b_scale"):
            if n not in p:
                continue
            t, name = p[n].detach().cpu(), f"layers.{l}.{kind}.{n}"
            if n.endswith("_scale"):
                out[name] = out["fp32." + name] = t.to(torch.float16).contiguous()
                continue
            scale = p.get(n + "_scale")
            out[name] = (t.float() / scale.float()[:, None]).round().to(torch.int8).contiguous() \
                if scale is not None else t.to(dtype).contiguous()
            out["fp32." + name] = t.float().contiguous()
    return out


def rss_peak_bytes() -> int:
    """This process's peak resident set: VmHWM of /proc/self/status on Linux (the high-water
    mark of this process image; getrusage's ru_maxrss also counts the parent's resident set
    at fork time), else ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def gpu_peak_bytes(device: str) -> int | None:
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    return int(torch.cuda.max_memory_allocated(torch.device(device)))


def calib_bytes(n_tokens: int, cfg) -> int:
    """Bytes of the per-layer calibration tensors on the build device (docs/compiler.md): the
    carried residual (fp32), this layer's and the previous layer's predictor source (fp16),
    the fp32 copy the training reads, and one layer's labels (bool), MLP targets (bfloat16,
    `mlp_targets`) and head norms (fp32)."""
    D, F, H = cfg.hidden_size, cfg.ffn_dim, cfg.num_attention_heads
    return n_tokens * (4 * D + 2 * 2 * D + 4 * D + F + 2 * F + 4 * H)


# Freed heap this process's allocator keeps mapped for reuse: `dejavu-compile` raises glibc's trim threshold
# (compiler/cli.reuse_freed_memory) and records it here, so the bound counts it (a library call keeps glibc's own).
_KEPT_HEAP_BYTES = [0]


def set_kept_heap(n: int) -> None:
    """Record the freed heap (bytes) the process's allocator may keep mapped: part of `memory_bound`."""
    _KEPT_HEAP_BYTES[0] = int(n)


def memory_bound(cfg, n_tokens: int, host: bool = True) -> dict:
    """The build's stated peak memory (host with --device cpu, device memory with cuda;
    docs/compiler.md, "Streaming"): 2 x the largest layer in fp32 (the embeddings counted as
    one) + the calibration tensors (n_tokens 0: none) + 1 GiB, + on the host (`host`) the freed heap
    the allocator keeps (`set_kept_heap`; dejavu-compile: 1 GiB). The predictor training's own
    float32 temporaries of the labels (predictors._fit, up to 4 T F bytes) are not in it."""
    D, F, V, E = cfg.hidden_size, cfg.ffn_dim, cfg.vocab_size, cfg.word_embed_proj_dim
    layer = 4 * (4 * D * D + 2 * D * F + F + 9 * D)
    shell = 4 * (V * E + (cfg.max_position_embeddings + 2) * D + (2 * D * E if E != D else 0))
    calib = calib_bytes(n_tokens, cfg) if n_tokens else 0
    largest = max(layer, shell)
    kept = _KEPT_HEAP_BYTES[0] if host else 0
    return {"largest_layer_fp32_bytes": largest, "calib_bytes": calib, "kept_heap_bytes": kept,
            "bound_bytes": 2 * largest + calib + (1 << 30) + kept}
