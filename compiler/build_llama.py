"""Engine build for Llama-family models: model → TEAL thresholds → kernel layout → `.engine`.

The sparsity is TEAL's (compiler/gated_sparsity.py): each block projection reads only the
input columns whose |x_i| exceeds a per-layer, per-input threshold, calibrated on the
calibration text (never the evaluation text). `--density` keeps the byte-budget meaning of
OPT engines: the fraction of a dense decode step's weight bytes read per token, the LM head,
the embedding row and the norms included. It is mapped to a block skip (`skip_for_density`),
spent over the four input kinds by measured held-out loss (compiler/allocate_llama.py,
`--allocation sensitivity`) or at one level for every input (`--allocation uniform`);
`--max-ppl-increase P` searches the least density within P percent on held-out windows.

Kernel layout (the runtime reads columns of W as contiguous rows of W^T):
    embed_tokens [V, D], lm_head [V, D] (untied only), final_norm [D]
    layers.l.attn_norm [D], layers.l.mlp_norm [D]
    layers.l.attn.wqkv_t [D, (H + 2 Hkv) hd]   q, k, v fused (one input: attn_in)
    layers.l.attn.wo_t   [H hd, D]             (o_in)
    layers.l.mlp.wgu_t   [D, 2 F]              gate, up fused (mlp_in)
    layers.l.mlp.wd_t    [F, D]                (down_in)
    vectors, where the checkpoint has them (engine_file.llama_vector_shapes):
    layers.l.attn.bqkv   [(H + 2 Hkv) hd]      q, k, v's biases (Qwen2; Llama's attention_bias)
    layers.l.attn.bo     [D]                   o's bias (attention_bias)
    layers.l.attn.q_norm [hd], attn.k_norm [hd]  the q and k heads' RMSNorm weights (Qwen3)
    layers.l.mlp.bgu     [2 F], mlp.bd [D]     gate/up's and down's biases (mlp_bias)
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dejavu.compiler.summary import accuracy_lines
from dejavu.engine_file import llama_vector_shapes
from dejavu.errors import DejavuError

FAMILY = "llama"


@dataclass(frozen=True)
class TealSettings:
    """Calibration of TEAL thresholds. --calib-tokens left at BuildConfig's default (sized for
    training OPT predictors, 65,536) means `calib_tokens` here: quantiles of the projection
    inputs need far fewer tokens than a predictor's training set (docs/llama.md used 1,024)."""

    calib_tokens: int = 2048
INPUTS = ("attn_in", "o_in", "mlp_in", "down_in")  # gated_sparsity's calibration keys, in layer order
MAX_SKIP = 0.99  # the top of gated_sparsity's calibrated quantile grid


def step_bytes(cfg, elem: int = 2) -> dict:
    """Weight bytes of one dense decode token: {"fixed", "block", "dense"}.

    fixed: the embedding row, the LM head (all V rows), every RMSNorm weight and bias; block: the projections
    q, k, v, o, gate, up, down of every layer (what the thresholds skip)."""
    from dejavu.compiler.gated_sparsity import projection_bytes

    d = cfg.hidden_size
    fixed = d + cfg.vocab_size * d + (2 * cfg.num_hidden_layers + 1) * d
    fixed += cfg.num_hidden_layers * sum(n for _, n in llama_vector_shapes(cfg))
    block = cfg.num_hidden_layers * sum(projection_bytes(cfg).values())
    return {"fixed": elem * fixed, "block": elem * block, "dense": elem * (fixed + block)}


def skip_for_density(cfg, density: float) -> float:
    """The block skip fraction s whose engine reads `density` of the dense step's bytes:
    fixed + (1 - s) block = density (fixed + block)."""
    b = step_bytes(cfg, 1)
    s = (1.0 - density) * b["dense"] / b["block"]
    if s > MAX_SKIP:
        least = (b["fixed"] + (1 - MAX_SKIP) * b["block"]) / b["dense"]
        raise DejavuError(f"--density {density} is below the least a Llama engine of this model reads "
                          f"({least:.4f}: every projection input at {MAX_SKIP:.0%} skipped)")
    return max(0.0, s)


def density_for_skip(cfg, skip: float) -> float:
    """The byte fraction an engine with every projection input at `skip` reads (skip_for_density's inverse)."""
    b = step_bytes(cfg, 1)
    return (b["fixed"] + (1.0 - skip) * b["block"]) / b["dense"]


def _check_supported(cfg, config) -> None:
    unsupported = {"mlp_density": None, "attn_density": None, "no_predictors": False}
    for name, default in unsupported.items():
        if getattr(config, name) != default:
            raise DejavuError(f"--{name.replace('_', '-')} is not supported for Llama-family models yet "
                              "(TEAL thresholds from --density or --max-ppl-increase)")
    if config.tp > 1 and (cfg.num_key_value_heads % config.tp or cfg.intermediate_size % config.tp):
        raise DejavuError(f"--tp {config.tp} must divide num_key_value_heads ({cfg.num_key_value_heads}) and "
                          f"intermediate_size ({cfg.intermediate_size})")


class _Blocks(torch.nn.Module):
    """The decoder without its LM head: gated_sparsity.calibrate's hooks see every projection
    input, and no [tokens, vocab] logits are made."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.layers = model, model.config, model.layers

    def forward(self, ids):
        m = self.model
        S = ids.shape[1]
        pos = torch.arange(S, device=ids.device)[None].expand_as(ids)
        x = m.model.embed_tokens(ids)  # [B, S, D]
        cos, sin = m._rope(pos, x.dtype)
        for layer in m.layers:
            x = layer(x, cos, sin, None, None)
        return x


def calib_tokens(config) -> int:
    """The calibration tokens of a Llama build: --calib-tokens, or TealSettings.calib_tokens where it
    was left at BuildConfig's default."""
    from dejavu.compiler.config import CalibSettings

    return TealSettings.calib_tokens if config.calib_tokens == CalibSettings.calib_tokens else config.calib_tokens


def calibration_windows(cfg, tokenizer, config, rotation: bool = False):
    """(ids [B, window] on config.device, corpus) the calibration windows of a build: its thresholds'
    (tokens [0, n) of the calibration corpus), or with rotation=True its rotation's (the next n
    tokens, [n, 2n)): the PCA fitted on the threshold tokens makes the rotated inputs smaller on
    them than on any other text, so its thresholds skip less than their target elsewhere
    (docs/llama.md, "Fitting the rotation on its own tokens"). benchmarks/llama_engine_check.py
    rebuilds both."""
    from dejavu.compiler.text import corpus_tokens

    window = min(config.calib_window, cfg.max_position_embeddings)
    want = calib_tokens(config)
    n = want // window * window
    if n == 0:
        raise DejavuError(f"--calib-tokens {want} is less than one window of {window} tokens")
    first = want if rotation else 0
    ids, corpus = corpus_tokens(tokenizer.tokenizer, config.calib, first + n, bos_id=tokenizer.bos_id)
    ids = torch.as_tensor(ids[first:first + n], dtype=torch.long).view(-1, window).to(config.device)
    return ids, corpus


def calibrate_inputs(model, tokenizer, config):
    """(gated_sparsity.Calibration, calibration header) from the calibration text. With
    config.rotate_keep set, the model is first rotated in place (compiler/rotate_llama.py) on the
    rotation's own windows (calibration_windows), and the thresholds are the rotated model's."""
    from dejavu.compiler.build import _corpus_name
    from dejavu.compiler.gated_sparsity import calibrate
    from dejavu.compiler.text import fingerprint_tokens

    ids, corpus = calibration_windows(model.config, tokenizer, config)
    n, window = ids.numel(), ids.shape[1]
    header = {"corpus": _corpus_name(corpus), "n_tokens": n, "window": window,
              "tokens_fingerprint": fingerprint_tokens(ids.cpu().numpy().reshape(-1)),
              "rotate_keep": config.rotate_keep}
    if config.rotate_keep is not None:
        from dejavu.compiler.rotate_llama import rotate_llama

        rids, _ = calibration_windows(model.config, tokenizer, config, rotation=True)
        rotate_llama(model, rids, config.rotate_keep)
        header["rotation_tokens"] = [calib_tokens(config), calib_tokens(config) + rids.numel()]
        header["rotation_fingerprint"] = fingerprint_tokens(rids.cpu().numpy().reshape(-1))
    calib = calibrate(_Blocks(model), ids)
    return calib, header


def distill_inputs(model, tokenizer, config, calib, skips: dict, calib_tokens: int, heldout: dict, progress=None):
    """config.distill_steps > 0: train the model in place to its own dense outputs under the
    thresholds of `skips` (compiler/distill_llama.py), config.distill_batch windows of the calibration corpus a step,
    past the calibration stream (and past the held-out sets where they are the calibration corpus:
    never trained on), then calibrate the thresholds again on the calibration windows. The held-out
    report's engine figures become the distilled engine's on the same (second) set, the undistilled
    ones kept under "distill". progress: a line every 10 training steps, or None. Returns (the new
    Calibration, the "distill" report)."""
    import math

    from dejavu.compiler.allocate_llama import _pct, heldout_in_calib, heldout_nll, heldout_set, kind_thresholds
    from dejavu.compiler.distill_llama import WINDOW, distill_llama
    from dejavu.compiler.gated_sparsity import calibrate
    from dejavu.compiler.text import corpus_tokens

    cfg = model.config
    window = min(WINDOW, cfg.max_position_embeddings)
    start = calib_tokens + (2 * config.heldout_tokens if heldout_in_calib(config) else 0)  # never trained on
    batch = config.distill_batch
    want = start + config.distill_steps * batch * window
    try:
        ids, _ = corpus_tokens(tokenizer.tokenizer, config.calib, want, bos_id=tokenizer.bos_id)
    except DejavuError:
        raise DejavuError(f"--distill-steps {config.distill_steps} --distill-batch {batch}: the calibration corpus "
                          f"has fewer than the {want} tokens it needs ({start} calibration / held-out tokens, then "
                          f"{batch * window} a step); lower --distill-steps or give a longer --calib") from None
    train = torch.as_tensor(ids[start:], dtype=torch.long).view(-1, window)
    device = next(model.parameters()).device
    hids = heldout_set(tokenizer, config, calib_tokens, cfg.max_position_embeddings, 1)[0].to(device)
    dense = heldout_nll(model, hids)  # the undistilled dense model on resolve_skips' second set
    report = distill_llama(model, kind_thresholds(calib, skips), train.to(device), config.distill_steps,
                           progress=progress, batch=batch)
    report["first_token"] = start
    cids, _ = calibration_windows(cfg, tokenizer, config)
    with torch.no_grad():
        new = calibrate(_Blocks(model), cids)
    got = heldout_nll(model, hids, kind_thresholds(new, skips))
    report.update(engine_ppl_before=heldout["engine_ppl"], increase_pct_before=heldout["increase_pct"],
                  dense_ppl_after=round(math.exp(heldout_nll(model, hids)), 4))
    heldout.update(engine_ppl=round(math.exp(got), 4), increase_pct=_pct(got, dense))
    return new, report


def _stored_shape(module, name: str = "weight") -> tuple[int, ...]:
    """A parameter's shape without reading it (a compute_in_fp32 parameter would be cast to be read)."""
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(module, name):
        return tuple(getattr(module.parametrizations, name).original.shape)
    return tuple(getattr(module, name).shape)


def _layout(model) -> list[tuple[str, tuple[int, ...], object]]:
    """(name, shape, make) of every kernel-layout tensor (module docstring): make() builds it from the model's
    weights, in their compute dtype, on their device."""
    cfg, m = model.config, model.model
    V, D = _stored_shape(m.embed_tokens)
    out = [("embed_tokens", (V, D), lambda: m.embed_tokens.weight), ("final_norm", (D,), lambda: m.norm.weight)]
    if not cfg.tie_word_embeddings:
        out.append(("lm_head", (V, D), lambda: model.lm_head.weight))
    for l, layer in enumerate(model.layers):
        at, mlp, p = layer.self_attn, layer.mlp, f"layers.{l}."
        qkv = sum(_stored_shape(x)[0] for x in (at.q_proj, at.k_proj, at.v_proj))
        F2, HD = 2 * _stored_shape(mlp.gate_proj)[0], _stored_shape(at.o_proj)[1]
        out += [(p + "attn_norm", (D,), lambda n=layer.input_layernorm: n.weight),
                (p + "mlp_norm", (D,), lambda n=layer.post_attention_layernorm: n.weight),
                (p + "attn.wqkv_t", (D, qkv), lambda a=at: torch.cat([a.q_proj.weight, a.k_proj.weight,
                                                                       a.v_proj.weight]).T),
                (p + "attn.wo_t", (HD, D), lambda a=at: a.o_proj.weight.T),
                (p + "mlp.wgu_t", (D, F2), lambda x=mlp: torch.cat([x.gate_proj.weight, x.up_proj.weight]).T),
                (p + "mlp.wd_t", (F2 // 2, D), lambda x=mlp: x.down_proj.weight.T)]
        vectors = {"attn.bqkv": lambda a=at: torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
                   "attn.bo": lambda a=at: a.o_proj.bias,
                   "attn.q_norm": lambda a=at: a.q_norm.weight, "attn.k_norm": lambda a=at: a.k_norm.weight,
                   "mlp.bgu": lambda x=mlp: torch.cat([x.gate_proj.bias, x.up_proj.bias]),
                   "mlp.bd": lambda x=mlp: x.down_proj.bias}
        out += [(p + name, (n,), vectors[name]) for name, n in llama_vector_shapes(cfg)]
    return out


def llama_tensors(model, dtype: torch.dtype, device="cpu") -> dict[str, torch.Tensor]:
    """The kernel-layout tensors (module docstring) of a LlamaForCausalLM, in `dtype` on `device`."""
    return {name: make().detach().to(device, dtype).contiguous() for name, _, make in _layout(model)}


def llama_parts(model, dtype: torch.dtype) -> dict:
    """`llama_tensors` as engine_file.TensorParts: each tensor made from the model's weights when the writer
    reaches it, so writing an engine holds one layout tensor at a time beside the model."""
    from dejavu.engine_file import TensorPart, _tensor_bytes

    def chunks(make):
        return lambda: iter((_tensor_bytes(make().detach().to("cpu", dtype)),))

    return {name: TensorPart(dtype, shape, chunks(make)) for name, shape, make in _layout(model)}


def llama_header(name: str, cfg, config, target: dict, skips: dict, thresholds: dict, calibration,
                 tokenizer_json: str, special_ids: tuple | None = None, heldout: dict | None = None) -> dict:
    """The Llama engine header: the family, the TEAL setting and thresholds, bytes per token.
    skips: {input: skip} (one per input kind); special_ids: the tokenizer's (bos, stop ids, pad), written
    over the model config's (several stop ids: eos_token_id a list, as config.json writes it); heldout:
    allocate_llama.resolve_skips's report."""
    from dejavu.compiler.allocate_llama import block_skip, input_bytes
    from dejavu.engine_file import FORMAT_NAME, FORMAT_VERSION

    skip = block_skip(skips, input_bytes(cfg))
    b = step_bytes(cfg, torch.tensor([], dtype=getattr(torch, config.dtype)).element_size())
    read = b["fixed"] + (1 - skip) * b["block"]
    mc = cfg.to_hf_dict()
    if special_ids is not None:  # the ids text starts / ends / pads with (GGUF: the document separator)
        from dejavu.models.tokenizer import eos_field

        mc.update(bos_token_id=special_ids[0], eos_token_id=eos_field(special_ids[1]), pad_token_id=special_ids[2])
    uniform = len(set(skips.values())) == 1
    kept = (heldout or {}).get("allocation_check", {}).get("kept", "uniform" if uniform else "sensitivity")
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "model_family": FAMILY,
        "model": Path(name).name if Path(name).is_dir() else name,
        "model_config": mc, "dtype": config.dtype, "target": target,
        "sparsity": {"method": "teal", "skip": round(skip, 8), "skips": {k: round(skips[k], 8) for k in INPUTS},
                     "inputs": list(INPUTS), "thresholds": thresholds},
        "build_config": {
            "density": round(density_for_skip(cfg, skip), 6) if config.density is None else config.density,
            "allocation": kept,
            "bytes_per_token": {"engine": int(round(read)), "dense": b["dense"],
                                "fraction": round(read / b["dense"], 6)},
            **({"heldout": heldout} if heldout else {}),
            "calibration": calibration, "settings": config.to_dict()},
        "tokenizer_json": tokenizer_json,
    }


OFFLOAD_RESERVE = 8 << 30  # device bytes an offload decision leaves to the build's activations (held-out logits)


def offload_needed(weight_bytes: int, device: torch.device) -> bool:
    """Whether a model of weight_bytes (as stored) leaves too little of `device`'s free memory for the build:
    more than 85% of it less OFFLOAD_RESERVE. Never on the CPU."""
    if device.type != "cuda":
        return False
    free = torch.cuda.mem_get_info(device)[0]
    return weight_bytes > 0.85 * free - OFFLOAD_RESERVE


def offload_layers(model, device) -> None:
    """Run `model` on `device` with its decoder layers' weights left where they are (host memory): the
    embedding, final norm and LM head move to device; each layer's parameters are copied there by a forward
    pre-hook and dropped after its forward, so the device holds one layer at a time (a bf16 Llama-3-70B
    layer: 1.7 GB). For reading only: the calibration and held-out forwards; each forward moves the layers'
    bytes across the bus once."""
    device = torch.device(device)
    for mod in (model.model.embed_tokens, model.model.norm, model.lm_head):
        mod.to(device)
    model.rope_to(device)

    def bring(home):
        def hook(layer, args):
            for p in layer.parameters():
                home.append(p.data)
                p.data = p.data.to(device, copy=True)  # a copy on the CPU too (the tests' device)
        return hook

    def back(home):
        def hook(layer, args, out):
            for p, h in zip(layer.parameters(), home):
                p.data = h
            home.clear()
        return hook

    for layer in model.layers:
        home = []
        layer.register_forward_pre_hook(bring(home))
        layer.register_forward_hook(back(home))


def load_build_model(model_name_or_path, config, rewrites: bool = False, say=None):
    """(model, config) for the build on config.device, computing in fp32. Its weights stay in the checkpoint's
    dtype (models.llama.compute_in_fp32: a bf16 Llama-3-8B takes 16 GB, not 32) unless the build changes them
    (--distill-steps, --rotate-keep) or traces them (`rewrites`: the ONNX export), which load them in fp32;
    the thresholds, the allocation and the engine are the same either way. A checkpoint whose weights do not fit
    the CUDA device (`offload_needed`: a folder's weight files, a GGUF file's fp32 dequantization) is held in host
    memory (a GGUF file's quantized tensors dequantized to fp16) and its layers brought to the device one at a time (`offload_layers`);
    say(line) reports it. Such a checkpoint with a flag that needs the whole model in fp32 on the device is one
    DejavuError line."""
    from dejavu.models.auto import gguf_path, load_llama, resolve
    from dejavu.models.llama import compute_in_fp32
    from dejavu.models.loader import check_device, weight_files

    device = check_device(config.device)
    gp = gguf_path(model_name_or_path)
    if gp is None:
        need = sum(f.stat().st_size for f in weight_files(resolve(model_name_or_path)))
    else:  # a GGUF file is dequantized to fp32
        from dejavu.models import gguf

        need = 4 * gguf.n_elements(gguf.open_gguf(gp))
    offload = offload_needed(need, device)
    rewrite = [f for f, on in (("--distill-steps", config.distill_steps),
                               ("--rotate-keep", config.rotate_keep is not None), ("--onnx-out", rewrites)) if on]
    if offload and rewrite:
        raise DejavuError(f"the weights ({need / 2**30:.1f} GiB) do not fit {device}, and {rewrite[0]} needs the whole "
                          "model there in fp32; leave it out (the build then brings the layers to the device one at a "
                          "time) or use a larger device")
    if rewrite:
        return load_llama(model_name_or_path, dtype=torch.float32, device=device)
    if offload and say is not None:
        say(f"the weights ({need / 2**30:.1f} GiB) do not fit {device}: held in host memory"
            + (" (the GGUF file's quantized tensors dequantized to fp16)" if gp is not None else "")
            + ", each layer brought to the device for its forward")
    # a GGUF file that does not fit is held on the host in the types it stores, its quantized tensors dequantized to
    # fp16: half their fp32 dequantization (a quantized 70B: 140 GB)
    model, cfg = load_llama(model_name_or_path, dtype=None, device="cpu" if offload else device, gguf_stored=offload)
    compute_in_fp32(model)
    if offload:
        offload_layers(model, device)
    return model, cfg


def build_llama_engine(model_name_or_path, config, out, progress: bool = True, onnx_out=None) -> dict:
    """Build a Llama-family `.engine` (called by compiler/build.build_engine); a summary dict.
    onnx_out: a folder for the dense and TEAL-sparse ONNX graphs (compiler/onnx_llama.py)."""
    from dejavu.compiler.allocate_llama import block_skip, input_bytes, kind_thresholds, resolve_skips
    from dejavu.compiler.build import _check_output, _Stages, target_info
    from dejavu.engine_file import write_engine_parts
    from dejavu.models.auto import load_chat_template, load_sampling_defaults, load_text_tokenizer

    out = _check_output(out)
    target = target_info(config.device)  # kernel_settings.input_sparse: the input-sparse kernels' blocks
    stages, t0 = _Stages(progress), time.perf_counter()
    with stages("load model"):
        say = (lambda line: print(f"[dejavu-compile]   {line}", file=sys.stderr, flush=True)) if progress else None
        model, cfg = load_build_model(model_name_or_path, config, rewrites=onnx_out is not None, say=say)
        tokenizer = load_text_tokenizer(model_name_or_path)
        sampling = load_sampling_defaults(model_name_or_path)  # a bad value fails before the long stages
    _check_supported(cfg, config)
    skip = skip_for_density(cfg, config.density) if config.max_ppl_increase is None else None
    with stages("calibrate thresholds"):
        with torch.no_grad():
            calib, calibration = calibrate_inputs(model, tokenizer, config)
    cfg = model.config  # a rotated model's LM head is untied from the embedding
    with stages("allocate budget"):
        used = calibration.get("rotation_tokens", [0, calibration["n_tokens"]])[1]  # held-out text starts past it
        skips, heldout = resolve_skips(model, calib, tokenizer, config, skip, used, say)
    if config.distill_steps and block_skip(skips, input_bytes(cfg)) > 0:
        with stages("distill"):
            calib, heldout["distill"] = distill_inputs(model, tokenizer, config, calib, skips, used, heldout, say)
    thresholds = {k: [round(t, 8) for t in ts] for k, ts in kind_thresholds(calib, skips).items()}
    skip = block_skip(skips, input_bytes(cfg))
    onnx_report = None
    if onnx_out is not None:
        with stages("export ONNX"):
            onnx_report = _export_onnx(model, thresholds, skip, Path(onnx_out))
    parts = llama_parts(model, getattr(torch, config.dtype))  # laid out as the writer reaches each tensor
    header = llama_header(str(model_name_or_path), cfg, config, target, skips, thresholds, calibration,
                          tokenizer.tokenizer.to_str(), (tokenizer.bos_id, tokenizer.stop_ids, tokenizer.pad_id),
                          heldout)
    chat = load_chat_template(model_name_or_path)
    if chat is not None:  # dejavu-serve's chat endpoint; headers of models without one are unchanged
        header["chat_template"] = chat
    if sampling:  # dejavu-serve's defaults where a request leaves them out
        header["sampling_defaults"] = sampling
    with stages("write engine"):
        if config.tp > 1:  # one file per rank (dejavu.shards.shard_path), written side by side
            from dejavu.compiler.tensor_parallel import write_shards

            size, files = write_shards(out, header, parts, config.tp)
            out = f"{files[0]} .. {files[-1]} (tp={config.tp}, sizes summed)"
        else:
            size = write_engine_parts(out, header, parts)
    del model
    if progress:
        print(f"[dejavu-compile] wrote {out}", file=sys.stderr, flush=True)
    return {"engine": str(out), "model_family": FAMILY, **({"onnx": onnx_report} if onnx_report else {}),
            "engine_bytes": size,
            "weight_bytes": sum(t.nbytes for t in parts.values()), "dtype": config.dtype, "target": target,
            "density": header["build_config"]["density"], "allocation": header["build_config"]["allocation"],
            "skip": header["sparsity"]["skip"], "skips": header["sparsity"]["skips"], "heldout": heldout,
            "bytes_per_token": header["build_config"]["bytes_per_token"], "thresholds": thresholds,
            "calibration": calibration, "stage_seconds": stages.times,
            "total_seconds": round(time.perf_counter() - t0, 3)}


def _export_onnx(model, thresholds: dict, skip: float, out_dir: Path) -> dict:
    """Dense and sparse graphs; the sparse prefill checked in ONNX Runtime against the masked-dense
    PyTorch model (compiler/gated_sparsity's hooks with these thresholds)."""
    from dejavu.compiler.gated_sparsity import GatedSparsity, gated_sparsity
    from dejavu.compiler.onnx_llama import build_llama_graph, export_llama_onnx
    from dejavu.compiler.onnx_export import run_onnxruntime

    if out_dir.exists() and not out_dir.is_dir():
        raise DejavuError(f"--onnx-out {out_dir} exists and is not a folder")
    m32 = model.float().cpu()
    sparse = skip > 0
    paths = export_llama_onnx(m32, out_dir, thresholds if sparse else None)
    report = {"dir": str(out_dir), "files": sorted(p.name for p in paths.values()), "max_abs_diff": None}
    ids = (torch.arange(16)[None] * 7919 % m32.config.vocab_size)[:, :m32.config.max_position_embeddings]
    try:
        got = run_onnxruntime(build_llama_graph(m32, "prefill", thresholds if sparse else None),
                              {"input_ids": ids.numpy()})["logits"]
    except ImportError:
        return report  # onnxruntime not installed
    with torch.no_grad(), gated_sparsity(m32, thresholds, GatedSparsity(skip=skip)):
        ref = m32(ids)
    report["max_abs_diff"] = float(abs(torch.from_numpy(got) - ref).max())
    return report


def format_llama_summary(s: dict) -> str:
    """dejavu-compile's printout of a Llama build."""
    mb = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
    lines = [f"engine      {s['engine']}  ({mb(s['engine_bytes'])}, {s['dtype']}, target {s['target']['device']}, "
             f"family llama)"]
    lines += accuracy_lines(s["density"], s["allocation"], s["bytes_per_token"], s["heldout"])
    lines += [f"sparsity    TEAL, {s['skip']:.4f} of the block bytes skipped: "
              + ", ".join(f"{k} {v:.4f}" for k, v in s["skips"].items()),
              f"calibration {s['calibration']['n_tokens']} tokens of {s['calibration']['corpus']} "
              f"(windows of {s['calibration']['window']})",
              f"{'layer':>5} " + " ".join(f"{k:>9}" for k in INPUTS)]
    th = s["thresholds"]
    for l in range(len(th[INPUTS[0]])):
        lines.append(f"{l:>5} " + " ".join(f"{th[k][l]:>9.4f}" for k in INPUTS))
    if "onnx" in s:
        o = s["onnx"]
        lines.append(f"onnx        {o['dir']}: {', '.join(o['files'])}; ONNX Runtime vs masked dense "
                     f"max |diff| = {o['max_abs_diff']}")
    lines.append("time        " + ", ".join(f"{k} {v:.1f}s" for k, v in s["stage_seconds"].items())
                 + f"; total {s['total_seconds']:.1f}s")
    return "\n".join(lines)
