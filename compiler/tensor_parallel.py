"""Megatron-style tensor-parallel shards of a kernel-layout engine (docs/tensor_parallel.md).

Rank r of n holds heads [r*H/n, (r+1)*H/n) and neurons [r*F/n, (r+1)*F/n):

    attn.wq [D, D], bq          column split: rows of the rank's heads      -> [Dq, D], Dq = H/n*hd
    attn.wkv [2D, D], bkv       K rows then V rows of the rank's heads     -> [2Dq, D]
    attn.wo_t [D, D]            row split (rows = input channels)           -> [Dq, D]
    mlp.w1 [F, D], b1, w2_t     rows of the rank's neurons                  -> [F/n, D]
    attn.bo, mlp.b2             rank 0 only (zeros elsewhere): the all-reduce sums them once
    pred_*.a (.a_scale)         replicated;  pred_*.b (.b_scale) / .bias: rows of the rank's neurons/heads
    everything else             replicated (embeddings, LayerNorms, project_in/out)

Per-layer K becomes `k_per_rank = min(N/n, ceil(K/n))`: every rank takes the top-k_r of *its
own shard's* scores (balanced work). That is a different selection from the global top-K
(the union of per-shard top-k_r, not the top-K of all scores); at density 1.0 they agree.
"""
from __future__ import annotations

import copy
import re

import torch

from dejavu.compiler.build import layer_target
from dejavu.errors import DejavuError
from dejavu.shards import shard_path

_REPLICATED = re.compile(r"(embed_tokens|embed_positions|project_in|project_out|final_ln\.(weight|bias)"
                         r"|layers\.\d+\.(ln_attn|ln_mlp)\.(weight|bias)|layers\.\d+\.pred_(mlp|attn)\.a(_scale)?)$")


def check_tp(tp: int, **dims: int) -> None:
    """DejavuError unless tp >= 1 divides every one of dims (config field name -> value), named as the model's
    config names them: check_tp(2, num_attention_heads=12, ffn_dim=3072)."""
    if type(tp) is not int or tp < 1:
        raise DejavuError(f"--tp must be a positive integer, got {tp!r}")
    if any(v % tp for v in dims.values()):
        raise DejavuError(f"--tp {tp} must divide " + " and ".join(f"{k} ({v})" for k, v in dims.items()))


def k_per_rank(k: int, n: int, tp: int) -> int:
    """Rows each rank keeps for a global K of N: ceil(K/tp), at most N/tp (never below K in total)."""
    return min(n // tp, -(-k // tp))


def _split_rule(header: dict, tp: int):
    """(rank headers, split(name, w, r) -> rank r's part of tensor w) for a single-rank engine."""
    if header.get("model_family") == "llama":
        return _llama_split_rule(header, tp)
    mc, bc = header["model_config"], header["build_config"]
    H, F, D = mc["num_attention_heads"], mc["ffn_dim"], mc["hidden_size"]
    check_tp(tp, num_attention_heads=H, ffn_dim=F)
    if bc.get("tp"):
        raise DejavuError("engine is already a tensor-parallel shard")
    Hr, Fr = H // tp, F // tp
    Dq = Hr * (D // H)
    ks = {"mlp": [k_per_rank(k, F, tp) for k in bc["mlp_k"]], "attn": [k_per_rank(k, H, tp) for k in bc["attn_k"]]}

    def split(name: str, w: torch.Tensor, r: int) -> torch.Tensor:
        q, f, h = slice(r * Dq, (r + 1) * Dq), slice(r * Fr, (r + 1) * Fr), slice(r * Hr, (r + 1) * Hr)
        kind = name.split(".", 2)[-1] if name.startswith("layers.") else name
        if _REPLICATED.match(name):
            return w
        if kind in ("attn.wq", "attn.bq", "attn.wo_t"):
            return w[q].contiguous()
        if kind in ("attn.wkv", "attn.bkv"):  # K rows then V rows, each head-major
            return torch.cat([w[:D][q], w[D:][q]])
        if kind in ("mlp.w1", "mlp.b1", "mlp.w2_t", "pred_mlp.b", "pred_mlp.b_scale", "pred_mlp.bias"):
            return w[f].contiguous()
        if kind in ("pred_attn.b", "pred_attn.b_scale", "pred_attn.bias"):
            return w[h].contiguous()
        if kind in ("attn.bo", "mlp.b2"):  # row-parallel outputs: added once, after the all-reduce
            return w if r == 0 else torch.zeros_like(w)
        raise DejavuError(f"shard_engine: no split rule for tensor {name!r}")

    headers = []
    for r in range(tp):
        hr = copy.deepcopy(header)
        hr["build_config"]["tp"] = {"size": tp, "rank": r, "num_heads": Hr, "ffn_dim": Fr, "k_per_rank": ks}
        if "target" in hr:  # each layer's kernel settings for the rank's K
            hr["target"] = layer_target(hr["target"], D, H, ks["mlp"], ks["attn"])
        headers.append(hr)
    return headers, split


# o's and down's biases too (added once, after the all-reduce), and the q and k heads' norm weights (one for all heads)
_LLAMA_REPLICATED = re.compile(r"(embed_tokens|lm_head|final_norm"
                               r"|layers\.\d+\.(attn_norm|mlp_norm|attn\.bo|attn\.[qk]_norm|mlp\.bd))$")


def _llama_split_rule(header: dict, tp: int):
    """The Llama family's split (a TEAL engine: no predictors, the thresholds the same on every rank): rank r
    holds query heads [r H/n, (r+1) H/n) with their KV heads [r Hkv/n, ...) and neurons [r F/n, ...);
    q/k/v and gate/up are split by output column, o and down by input row (their outputs summed by the
    all-reduce). Each rank's header is a Llama engine of H/n heads, Hkv/n KV heads and F/n neurons with the
    full hidden size, so its thresholds select on its own inputs: o's and down's thresholded inputs are
    the rank's own heads' and neurons', q/k/v's and gate/up's the replicated hidden state."""
    mc = header["model_config"]
    H, Hkv, F, D = mc["num_attention_heads"], mc["num_key_value_heads"], mc["intermediate_size"], mc["hidden_size"]
    hd = mc.get("head_dim") or D // H
    check_tp(tp, num_key_value_heads=Hkv, intermediate_size=F)
    if header["build_config"].get("tp"):
        raise DejavuError("engine is already a tensor-parallel shard")
    Hr, Kr, Fr = H // tp, Hkv // tp, F // tp

    def split(name: str, w: torch.Tensor, r: int) -> torch.Tensor:
        kind = name.split(".", 2)[-1] if name.startswith("layers.") else name
        q, kv = slice(r * Hr * hd, (r + 1) * Hr * hd), slice(r * Kr * hd, (r + 1) * Kr * hd)
        f = slice(r * Fr, (r + 1) * Fr)
        if _LLAMA_REPLICATED.match(name):
            return w
        if kind in ("attn.wqkv_t", "attn.bqkv"):  # columns: q heads, then k heads, then v heads
            return torch.cat([w[..., :H * hd][..., q], w[..., H * hd:(H + Hkv) * hd][..., kv],
                              w[..., (H + Hkv) * hd:][..., kv]], -1)
        if kind == "attn.wo_t":
            return w[q].contiguous()
        if kind in ("mlp.wgu_t", "mlp.bgu"):  # columns: gate, then up
            return torch.cat([w[..., :F][..., f], w[..., F:][..., f]], -1)
        if kind == "mlp.wd_t":
            return w[f].contiguous()
        raise DejavuError(f"shard_engine: no split rule for tensor {name!r}")

    headers = []
    for r in range(tp):
        hr = copy.deepcopy(header)
        hr["model_config"].update(num_attention_heads=Hr, num_key_value_heads=Kr, intermediate_size=Fr, head_dim=hd)
        hr["build_config"]["tp"] = {"size": tp, "rank": r, "num_heads": Hr, "num_kv_heads": Kr, "ffn_dim": Fr}
        headers.append(hr)
    return headers, split


def shard_engine(header: dict, tensors: dict[str, torch.Tensor], tp: int) -> list[tuple[dict, dict]]:
    """[(header_r, tensors_r)] for r in 0..tp-1 from a single-rank engine (kernel layout).

    tp == 1 returns the engine unchanged. Raises DejavuError when tp does not divide the
    heads and the MLP width, or on a tensor this function does not know how to split."""
    if tp == 1:
        _split_rule(header, 1)  # its checks
        return [(header, tensors)]
    headers, split = _split_rule(header, tp)
    return [(hr, {n: split(n, w, r).contiguous() for n, w in tensors.items()}) for r, hr in enumerate(headers)]


def write_shards(out, header: dict, parts: dict, tp: int) -> tuple[int, list[str]]:
    """Shard and write one engine per rank (`dejavu.shards.shard_path` names); (total bytes, paths).

    parts: {name: engine_file.TensorPart or torch.Tensor}. The ranks' files are written side by side in one pass
    over the tensors: each part is read (laid out) once, split, its slices written to their files and dropped
    (memory: a few of the largest tensor, never the engine). Atomic as a set: on any failure no rank's file is
    left."""
    import contextlib

    from dejavu.engine_file import PartsWriter, TensorPart
    from dejavu.fileio import atomic_path

    parts = {n: TensorPart.of(n, p) if isinstance(p, torch.Tensor) else p for n, p in parts.items()}
    headers, split = _split_rule(header, tp)
    paths = [shard_path(out, r, tp) for r in range(tp)]
    try:
        with contextlib.ExitStack() as stack:
            files = [stack.enter_context(open(stack.enter_context(atomic_path(p)), "wb")) for p in paths]
            writers = []
            for r, (hr, f) in enumerate(zip(headers, files)):
                layout = {n: (p.dtype, split(n, torch.empty(p.shape, dtype=p.dtype, device="meta"), r).shape)
                          for n, p in parts.items()}
                writers.append(PartsWriter(f, hr, layout))
            for name in sorted(parts):
                w = _whole(parts[name])
                for r, writer in enumerate(writers):
                    writer.tensor(name, TensorPart.of(name, split(name, w, r).contiguous()).chunks())
                del w
            sizes = [writer.close() for writer in writers]
    except OSError as e:
        raise DejavuError(f"cannot write engine shards {paths[0]} ..: {e.strerror or e}") from None
    return sum(sizes), [str(p) for p in paths]


def _whole(part) -> torch.Tensor:
    # a TensorPart's bytes as one tensor of its dtype and shape
    if not part.nbytes:
        return torch.empty(part.shape, dtype=part.dtype)
    return torch.frombuffer(bytearray(b"".join(part.chunks())), dtype=part.dtype).view(part.shape)
