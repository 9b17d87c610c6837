"""Test helpers for the runtime, independent of the compiler.

`engine_from_dense(model, ...)` builds an engine (header, tensors) in kernel layout straight
from a dense `OPTForCausalLM`, following docs/ARCHITECTURE.md (wq scaled, fused wkv, wo_t,
w2_t) with random predictors; it is also an independent check of the compiler's layout.

`masked_generate(model, preds, ...)` is the masked-dense reference: the dense model with
forward hooks that zero unselected heads (at out_proj's input) and neurons (after the ReLU),
selections from the same predictor weights and K, same lookahead convention.
"""
from __future__ import annotations

import torch

from dejavu.models.opt import OPTConfig, OPTForCausalLM

TINY = dict(model_type="opt", vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            ffn_dim=64, max_position_embeddings=128, word_embed_proj_dim=32, do_layer_norm_before=True)


def tiny_model(seed: int = 0, **over) -> OPTForCausalLM:
    cfg = OPTConfig.from_hf_dict({**TINY, **over})
    torch.manual_seed(seed)
    model = OPTForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "layer_norm" in n:
                p.add_(0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.3)  # large enough that the argmax is not a near-tie
    return model


def random_predictors(cfg: OPTConfig, rank: int | list[int] = 8, rank_attn: int = 4, seed: int = 1) -> dict:
    """rank: the MLP predictors' rank, one for every layer or a list per layer."""
    g = torch.Generator().manual_seed(seed)
    D, F, H = cfg.hidden_size, cfg.ffn_dim, cfg.num_attention_heads
    ranks = rank if isinstance(rank, list) else [rank] * cfg.num_hidden_layers
    out = {}
    for l in range(cfg.num_hidden_layers):
        for kind, n, r in (("pred_mlp", F, ranks[l]), ("pred_attn", H, rank_attn)):
            out[f"layers.{l}.{kind}.a"] = torch.randn(r, D, generator=g) / D**0.5
            out[f"layers.{l}.{kind}.b"] = torch.randn(n, r, generator=g) / r**0.5
            out[f"layers.{l}.{kind}.bias"] = 0.1 * torch.randn(n, generator=g)
    return out


def engine_from_dense(model: OPTForCausalLM, mlp_density: float = 0.5, attn_density: float = 0.5,
                      source: str = "attn_in", lookahead: int = 1, preds: dict | None = None,
                      tokenizer_json: str | None = None) -> tuple[dict, dict]:
    """(header, tensors) of an engine for `model` with K = round(density * N) per layer."""
    cfg = model.config
    D, F, H, L = cfg.hidden_size, cfg.ffn_dim, cfg.num_attention_heads, cfg.num_hidden_layers
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dec = "model.decoder."
    t = {"embed_tokens": sd[dec + "embed_tokens.weight"], "embed_positions": sd[dec + "embed_positions.weight"]}
    if cfg.word_embed_proj_dim != D:
        t["project_in"], t["project_out"] = sd[dec + "project_in.weight"], sd[dec + "project_out.weight"]
    if cfg.has_final_layer_norm:
        t["final_ln.weight"], t["final_ln.bias"] = sd[dec + "final_layer_norm.weight"], sd[dec + "final_layer_norm.bias"]
    scale = cfg.head_dim ** -0.5
    for l in range(L):
        s, p = f"{dec}layers.{l}.", f"layers.{l}."
        a = s + "self_attn."
        t.update({
            p + "ln_attn.weight": sd[s + "self_attn_layer_norm.weight"], p + "ln_attn.bias": sd[s + "self_attn_layer_norm.bias"],
            p + "ln_mlp.weight": sd[s + "final_layer_norm.weight"], p + "ln_mlp.bias": sd[s + "final_layer_norm.bias"],
            p + "attn.wq": sd[a + "q_proj.weight"] * scale, p + "attn.bq": sd[a + "q_proj.bias"] * scale,
            p + "attn.wkv": torch.cat([sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]]),
            p + "attn.bkv": torch.cat([sd[a + "k_proj.bias"], sd[a + "v_proj.bias"]]),
            p + "attn.wo_t": sd[a + "out_proj.weight"].t().contiguous(), p + "attn.bo": sd[a + "out_proj.bias"],
            p + "mlp.w1": sd[s + "fc1.weight"], p + "mlp.b1": sd[s + "fc1.bias"],
            p + "mlp.w2_t": sd[s + "fc2.weight"].t().contiguous(), p + "mlp.b2": sd[s + "fc2.bias"],
        })
    t.update(preds if preds is not None else random_predictors(cfg))
    mlp_k = [max(1, round(mlp_density * F))] * L
    attn_k = [max(1, round(attn_density * H))] * L
    header = {"format": "dejavu-engine", "format_version": 1, "model_config": cfg.to_hf_dict(),
              "build_config": {"density": mlp_density, "mlp_density": mlp_density, "attn_density": attn_density,
                               "mlp_k": mlp_k, "attn_k": attn_k, "predictors": True,
                               "predictor_input": {"source": source, "lookahead": lookahead}},
              "dtype": "float32", "target": {"device": "cpu", "arch": None, "kernel_settings": {}}}
    if tokenizer_json is not None:
        header["tokenizer_json"] = tokenizer_json
    return header, {k: v.contiguous() for k, v in t.items()}


class MaskedDense:
    """The dense model with masking hooks: the masked-dense reference semantics."""

    def __init__(self, model: OPTForCausalLM, header: dict, tensors: dict):
        self.model, self.t = model, tensors
        bc = header["build_config"]
        self.mlp_k, self.attn_k = bc["mlp_k"], bc["attn_k"]
        self.source, self.lookahead = bc["predictor_input"]["source"], bc["predictor_input"]["lookahead"]
        self.token_k = bc.get("token_k")  # a per-token MLP K: top k_max, rows kept by plugins.share_keep
        self.enabled = False
        self.src: dict = {}
        self.selections: list = []  # (layer, kind, sorted index rows) per masked call
        cfg = model.config
        H, hd = cfg.num_attention_heads, cfg.head_dim
        for l, layer in enumerate(model.decoder.layers):
            layer.register_forward_pre_hook(self._src_hook(l, "attn_in"))
            layer.final_layer_norm.register_forward_pre_hook(self._mlp_in_hook(l))
            layer.activation_fn.register_forward_hook(self._mask_hook(l, "mlp"))
            layer.self_attn.out_proj.register_forward_pre_hook(self._mask_hook(l, "attn", H, hd))

    def _src_hook(self, l, kind):
        def hook(mod, args):
            self.src[(kind, l)] = args[0]
        return hook

    def _mlp_in_hook(self, l):
        # pre-LN: final_layer_norm's input is the residual after attention (= mlp_in)
        def hook(mod, args):
            self.src[("mlp_in", l)] = args[0]
        return hook

    def _select(self, l, kind):
        j = l - self.lookahead
        x = self.src[(self.source, j)] if j >= 0 else self.src[("attn_in", 0)]  # [B, S, D]
        p = f"layers.{l}.pred_{kind}."
        a, b = self.t[p + "a"], self.t[p + "b"]
        if p + "a_scale" in self.t:  # int8 rows (build_config.predictor_dtype): their dequantized values
            a, b = (w.to(x.dtype) * self.t[p + n + "_scale"].to(x.dtype)[:, None] for w, n in ((a, "a"), (b, "b")))
        scores = (x @ a.T) @ b.T + self.t[p + "bias"]
        k = (self.mlp_k if kind == "mlp" else self.attn_k)[l]
        if kind == "mlp" and self.token_k is not None:
            from dejavu.plugins import share_keep

            idx = scores.topk(self.token_k["k_max"][l], dim=-1).indices
            keep = share_keep(scores, idx, self.token_k["threshold"][l]).to(scores.dtype)
            return torch.zeros_like(scores).scatter_(-1, idx, keep)
        idx = scores.topk(k, dim=-1).indices  # [B, S, k]
        self.selections.append((l, kind, idx.sort(-1).values.reshape(-1, k)))
        return torch.zeros_like(scores).scatter_(-1, idx, 1.0)

    def _mask_hook(self, l, kind, H=None, hd=None):
        if kind == "mlp":
            def hook(mod, args, out):
                return out * self._select(l, "mlp") if self.enabled else out
            return hook

        def pre(mod, args):
            if not self.enabled:
                return None
            x = args[0]  # [B, S, H*hd], heads concatenated head-major
            m = self._select(l, "attn")  # [B, S, H]
            return (x * m.repeat_interleave(hd, dim=-1),)
        return pre

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy: dense prompt pass, then every new token through the masked model."""
        m = self.model
        m.setup_caches(1, len(prompt) + max_new_tokens)
        try:
            self.enabled = False
            logits = m(torch.tensor([prompt]), 0)[:, -1]
            out = []
            for step in range(max_new_tokens):
                nxt = int(logits.argmax(-1))
                out.append(nxt)
                if step == max_new_tokens - 1:
                    break
                self.enabled = True
                logits = m(torch.tensor([[nxt]]), len(prompt) + step)[:, -1]
                self.enabled = False
        finally:
            m.clear_caches()
        return out

    @torch.no_grad()
    def teacher_forced(self, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Logits [S - p + 1, V] at positions p-1..S-1 of one sequence ids [1, S]: a dense pass
        over its first p tokens, then each later token through the masked model and the cache
        (generate's semantics, fed the given tokens)."""
        m, S = self.model, ids.shape[1]
        m.setup_caches(1, S)
        try:
            self.enabled = False
            out = [m(ids[:, :prompt_len], 0)[0, -1]]
            self.enabled = True
            out += [m(ids[:, t:t + 1], t)[0, -1] for t in range(prompt_len, S)]
        finally:
            self.enabled = False
            m.clear_caches()
        return torch.stack(out)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Token-parallel masked logits [B, S, V] (no cache)."""
        self.enabled = True
        try:
            return self.model(ids, 0)
        finally:
            self.enabled = False


def record_steps(dec, got: list) -> None:
    """Make dec.decode_step append a copy of each step's logits to `got` (graph outputs are
    static buffers); `del dec.decode_step` undoes it."""
    step = dec.decode_step
    dec.decode_step = lambda tokens, pos: got.append(step(tokens, pos).clone()) or got[-1]


def tiny_tokenizer_json(vocab_size: int = 300) -> str:
    """A byte-level BPE over a few lines of the shipped WikiText text (`</s>` = id 2)."""
    from tiny_tokenizer import tiny_tokenizer_json as bpe

    return bpe(vocab_size, chars=20_000)


def free_port() -> int:
    """A free TCP port on the loopback (the gloo rendezvous of the tensor-parallel tests)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_gloo(rank: int, port: int, world: int) -> None:
    """In an mp.spawn worker: torchrun's environment for rank of world on the loopback, Triton's interpreter (read
    when triton is first imported in this process), one thread; then the gloo process group."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      TRITON_INTERPRET="1")
    torch.set_num_threads(1)
    from dejavu.runtime.tp import init_distributed

    init_distributed("cpu")
