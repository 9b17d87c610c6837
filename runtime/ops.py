"""The sparse operations the decoder calls, bound to a backend (signatures of dejavu.plugins):

    predictor_topk(x[B,D], a, b, bias, k, shared=False, min_share=None, scales=None) -> idx[B,k] | [k]
        (scales: (a_scale, b_scale) fp16 of int8 a and b, the engine's int8 predictors)
        (min_share, a per-token K: (idx[B,k], n[B] int32), the first n[b] kept)
    sparse_fc1(x[B,D], w1, b1, idx, n_kept=None) -> h[B,K]   (n_kept[B]: a per-token K's rows, 0 elsewhere)
    sparse_fc2(h[B,K], w2_t, b2, idx, residual, n_kept=None) -> y[B,D]
        (n_kept[B]: only rows k < n_kept[b])
        (ln=(weight, bias), ln_defer=True: (y, the next LayerNorm of y), the second possibly a
        PendingLN, plugins/layer_norm.py: y plus per-block statistics from the split-K reduction,
        which the next layer's deferred Q/K/V kernel normalises itself; DecodeOptions.defer_ln_attn)
    sparse_attn(x_ln[B,D], wq, bq, wkv, bkv, wo_t, bo, idx, k_cache, v_cache, pos[B], residual) -> y[B,D]
        (K/V of every head are written into the caches at pos; only selected heads attend)
    sparse_attn_deferred(x_ln, wq, bq, wkv, bkv, wo_t, bo, idx, k_cache, v_cache,
                         x_hist[B,S,D], valid_len[B,H] int32, pos[B], residual, refresh=None) -> y[B,D]
        (kv_policy "deferred": x_ln stored at x_hist[:, pos]; K/V computed only for the
        selected heads, over their missing slots valid_len..pos; plugins/deferred_kv.py; x_ln may be
        a PendingLN, the LayerNorm then applied by the Q/K/V kernel; refresh: batch 1, kv_refresh's
        heads, brought up to pos too)
    layer_norm(x[B,D], weight, bias) -> y[B,D]   (eps 1e-5; the decode step's LayerNorms)
    kv_refresh(idx, valid_len[1,H], pos[1], r, lag=None, max_lag=None) -> [r] int32
        (deferred K/V, batch 1: the r most lagging heads outside idx, -1 past the last, whose K/V
        sparse_attn_deferred(..., refresh=) then computes too; plugins/refresh_heads.py;
        the decoder launches it on the predictors' side stream, DecodeOptions.kv_refresh)
    compact_rows(h[B,K], idx[B,K]|[K]) -> (h_c[B,K], idx_c[B,K] int32, n[B] int32)
        (h's nonzero rows first, order kept, n of them, 0 after: sparse_fc2(h_c, ..., idx_c, n_kept=n) sums the
        same rows; plugins/compact_rows.py; where skips_zero)

- "ref": the plugins' PyTorch references (`*_ref`, the CPU path); layer_norm is PyTorch's own
  F.layer_norm (the dense model's exact function).
- "triton": the plugins' Triton launchers (CUDA), bound to the engine's kernel settings
  (plugins.KernelSettings, from the engine header: `settings_for`). `verify()` runs each kernel once against
  its reference on the engine's real weights at activation; a kernel that raises or
  disagrees is replaced by its reference with a warning, so a GPU run never silently
  produces a different function.
"""
from __future__ import annotations

import functools
import logging
import warnings

import torch
import torch.nn.functional as F

import dejavu.plugins as P
from dejavu.errors import DejavuError
from dejavu.plugins import PendingLN, from_stats_ref, pending_ln

NAMES = ("predictor_topk", "sparse_fc1", "sparse_fc2", "sparse_attn", "sparse_attn_deferred", "layer_norm",
         "kv_refresh", "compact_rows")


def attend(q, k_cache, v_cache, valid) -> torch.Tensor:
    """o [B, h, hd] for one query per sequence; q: [B, h, hd] (scale folded in),
    caches [B, h, T, hd], valid [B, T] bool (keys each query may see)."""
    o = F.scaled_dot_product_attention(q[:, :, None], k_cache, v_cache,
                                       attn_mask=valid[:, None, None, :], scale=1.0)
    return o[:, :, 0]


def skips_zero(idx: torch.Tensor, rows: int) -> bool:
    """Whether the decode step compacts h's nonzero rows (compact_rows after fc1; fc2 then stops at their
    count, skipping the weight rows of h's ReLU zeros) for these indices: per-sequence sets ([rows, K]) and
    batch 1. A shared set at batch > 1 would skip only rows zero in every sequence, not timed. One layer at
    batch 1 (OPT-30B shape, MLP 0.1 / 0.2 / 0.3): 84.6 / 104.8 / 126.2 us compacted (H100 80GB HBM3,
    2026-12-05, commit 424623d, `bash benchmarks/gpu/compact_ab.sh`; BENCHMARKS.md)."""
    return idx.dim() == 2 or rows == 1


def _layer_norm(x, weight, bias):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, 1e-5)


def _flat(out) -> torch.Tensor:
    """An op's output (a tensor, the (y, layer_norm(y)) pair, or a tuple of those; a PendingLN
    as the LayerNorm its block statistics give) as one flat fp32 tensor."""
    if isinstance(out, PendingLN):
        return from_stats_ref(out).float().flatten()
    if isinstance(out, tuple):
        return torch.cat([_flat(o) for o in out])
    return out.float().flatten()


# op name -> (the plugins' launcher, its reference)
_IMPL = {
    "predictor_topk": (P.predictor_topk, P.predictor_topk_ref),
    "sparse_fc1": (P.sparse_fc1, P.sparse_fc1_ref),
    "sparse_fc2": (P.sparse_fc2, P.sparse_fc2_ref),
    "sparse_attn": (P.sparse_attn_decode, P.sparse_attn_decode_ref),
    "sparse_attn_deferred": (P.sparse_attn_decode_deferred, P.sparse_attn_decode_deferred_ref),
    "layer_norm": (P.layer_norm, _layer_norm),
    "kv_refresh": (P.refresh_heads, P.refresh_heads_ref),
    "compact_rows": (P.compact_rows, P.compact_rows_ref),
}


def settings_for(target: dict | None, device: torch.device) -> P.KernelSettings:
    """The kernel settings an engine header's `target` records (compiler: plugins.resolve_kernel_settings),
    when they were resolved for this device's GPU; else (another GPU, an engine without them, or an
    older format) the settings resolved for this device, with a logged line saying why."""
    return _settings_for(target, device)[0]


def layer_settings_for(target: dict | None, device: torch.device, spec,
                       settings: P.KernelSettings | None = None) -> tuple[P.KernelSettings, list[P.KernelSettings]]:
    """(the engine's kernel settings, each layer's): settings_for's, or `settings` when given (benchmarks'
    ablations), and per layer the header's target.layer_kernel_settings (the compiler's resolution from the
    layer's K, plugins.resolve_layer_settings) where the header's settings apply here; else each layer's
    resolved here from spec's K (logged for a header that records one set for every layer)."""
    base, own = (settings, False) if settings is not None else _settings_for(target, device)
    recorded = (target or {}).get("layer_kernel_settings") if own else None
    log = logging.getLogger("dejavu")
    if recorded is not None:
        try:
            if not isinstance(recorded, list) or len(recorded) != spec.num_layers:
                raise DejavuError(f"expected a list of {spec.num_layers} layers")
            return base, [base.with_overrides(o) for o in recorded]
        except DejavuError as e:
            log.warning("engine layer kernel settings unreadable (%s): resolved per layer here", e)
    elif own:
        log.info("engine records one kernel-settings set for every layer: resolved per layer from their K")
    per_layer = P.resolve_layer_settings(base, spec.hidden_size, spec.head_dim, spec.mlp_k, spec.attn_k)
    return base, [base.with_overrides(o) for o in per_layer]


def _settings_for(target, device) -> tuple[P.KernelSettings, bool]:
    """settings_for's settings, and whether they are the header's own."""
    gpu = None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        gpu = (f"sm_{major}{minor}", torch.cuda.get_device_properties(device).multi_processor_count,
               torch.cuda.get_device_name(device))
    return header_settings(target, gpu)


def header_settings(target: dict | None, gpu: tuple[str, int, str] | None) -> tuple[P.KernelSettings, bool]:
    """(settings, whether they are the header's own) for the GPU (arch, SM count, name), None for the CPU: the
    header's target.kernel_settings where they were made for this GPU, else those resolved here, with a logged
    line. Made for it: the same arch, and where the header names its GPU (target.name), the same GPU, or settings
    equal to those resolved here. Launch shapes tuned on one GPU (target.tuned) are not taken on another: as
    tuned tables keyed by device name are, they fall back to the defaults, with a warning naming dejavu-tune."""
    arch, sm, name = gpu or (None, None, None)
    here = P.resolve_kernel_settings(arch, sm)
    log = logging.getLogger("dejavu")
    recorded = (target or {}).get("kernel_settings") or None
    if recorded is None:
        if arch is not None:
            log.info("engine records no kernel settings: using those resolved for %s", arch)
        return here, False
    try:
        settings = P.KernelSettings.from_dict(recorded)
    except Exception as e:  # noqa: BLE001 - an older header format: the defaults of this version
        log.warning("engine kernel settings unreadable (%s): using those resolved for %s", e, arch or "cpu")
        return here, False
    if settings.arch != arch:
        log.warning("engine built for %s, running on %s: kernel settings resolved for %s",
                    settings.arch, arch or "cpu", arch or "cpu")
        return here, False
    made_on = target.get("name")
    if made_on is None or made_on == name:
        return settings, True
    if target.get("tuned"):
        log.warning("engine tuned on %s, running on %s: its launch shapes are not used here (the defaults for this "
                    "GPU are); `dejavu-tune FILE.engine` times them on it", made_on, name)
        return here, False
    if settings != here:
        log.info("engine's kernel settings resolved for %s, running on %s: resolved for this GPU", made_on, name)
        return here, False
    return settings, True


class LayerOps:
    """The ops with one layer's kernel settings bound (Ops.layer(l)) where the engine's op is its Triton
    launcher; an op the engine demoted to its reference, or one a benchmark or test wrapped, as the engine's."""

    def __init__(self, ops: "Ops", settings: P.KernelSettings):
        self.ops, self.settings = ops, settings
        self._bound = {name: functools.partial(_IMPL[name][0], settings=settings) for name in NAMES}

    def __getattr__(self, name):
        op = getattr(self.ops, name)
        return self._bound[name] if name in self._bound and op is self.ops.fast.get(name) else op


class Ops:
    """The sparse ops of one engine; `kernels` says which implementation each op uses, `settings`
    the Triton launchers' kernel settings, `layer(l)` the ops with layer l's (layer_settings_for)."""

    def __init__(self, backend: str = "ref", settings: P.KernelSettings | None = None,
                 layers: list[P.KernelSettings] | None = None):
        if backend not in ("ref", "triton"):
            raise ValueError(f"backend must be 'ref' or 'triton', got {backend!r}")
        self.backend = backend
        self.settings = settings or P.DEFAULT
        self._layers = [LayerOps(self, s) for s in layers or ()]
        self.fast: dict = {}  # op name -> the Triton launcher bound to `settings`
        self.kernels: dict[str, str] = {}
        self._ref: dict = {}
        for name in NAMES:
            fast, ref = _IMPL[name]
            self._ref[name] = ref
            if backend == "triton":
                self.fast[name] = functools.partial(fast, settings=self.settings)
            setattr(self, name, self.fast.get(name, ref))
            self.kernels[name] = "triton" if backend == "triton" else "ref"

    def layer(self, l: int):
        """The ops with layer l's kernel settings (this object where none were given per layer)."""
        return self._layers[l] if self._layers else self

    def demote(self, name: str, why: str) -> None:
        """Use the reference for `name` from now on."""
        warnings.warn(f"kernel {name}: {why}; using its PyTorch reference instead")
        setattr(self, name, self._ref[name])
        self.kernels[name] = "ref"

    @torch.inference_mode()
    def verify(self, t: dict, spec, batch: int, shared: bool, tol: float = 3e-2) -> dict:
        """Run each Triton op once on layer 0's weights against its reference; demote failures.
        For a pre-LN model sparse_fc2 runs with `ln=` and `ln_defer` (as the decode step calls it,
        both outputs compared) and sparse_attn_deferred also with a PendingLN input.

        Returns {op: relative error or the exception text}."""
        if self.backend != "triton":
            return {}
        dev, dt = t["embed_tokens"].device, spec.dtype
        g = torch.Generator(device=dev).manual_seed(0)
        D, H, hd = spec.hidden_size, spec.num_heads, spec.head_dim
        x = torch.randn(batch, D, generator=g, device=dev, dtype=torch.float32).to(dt)
        res = torch.randn(batch, D, generator=g, device=dev, dtype=torch.float32).to(dt)
        l, p = 0, "layers.0."
        km, ka = max(1, spec.mlp_k[l] // 2), max(1, spec.attn_k[l] // 2)

        def idx(n, k):
            r = torch.rand((k,) if shared else (batch, n), generator=g, device=dev)
            return (torch.randperm(n, device=dev)[:k] if shared else r.argsort(-1)[:, :k]).to(torch.int32).contiguous()

        im, ia = idx(spec.ffn_dim, km), idx(H, ka)
        h = torch.relu(torch.randn(batch, km, generator=g, device=dev)).to(dt)
        # a per-token K engine's fc1 / fc2 take the kept count; h's zero rows (about half here) are compacted
        nk = torch.randint(1, km + 1, (batch,), generator=g, device=dev).to(torch.int32)
        keep = (nk,) if spec.token_k is not None and not shared else ()
        if keep:  # fc1 leaves h 0 from n on
            h = h.masked_fill(torch.arange(km, device=dev) >= nk[:, None], 0)
        # fc2 as the decode step calls it (decoder._mlp): where skips_zero, over compact_rows' nonzero rows (the
        # reference's), stopping at their count
        fc2_in, fc2_kw = (h, im), {}
        if skips_zero(im, batch):
            h_c, im_c, n_c = self._ref["compact_rows"](h, im)
            fc2_in, fc2_kw = (h_c, im_c), {"n_kept": n_c}
        T = 16
        caches = [torch.randn(batch, H, T, hd, generator=g, device=dev).to(dt) for _ in range(2)]
        pos = (torch.arange(batch, device=dev) * 5 + 9) % T
        hist = torch.randn(batch, T, D, generator=g, device=dev).to(dt)
        valid_len = (pos[:, None] * torch.rand(batch, H, generator=g, device=dev)).to(torch.int32)
        # pre-LN: fc2 leaves the next LayerNorm pending as the decode step asks for it (defer_ln_attn;
        # a PendingLN compared through the LayerNorm its stats give)
        ln = {"ln": (t[p + "ln_attn.weight"], t[p + "ln_attn.bias"]), "ln_defer": True} if spec.pre_ln else {}
        pend_attn = pending_ln(x, t[p + "ln_attn.weight"], t[p + "ln_attn.bias"]) if spec.pre_ln else x

        def attn_deferred(f, xin):  # y, and the history slot the op stored
            xh = hist.clone()
            y = f(xin, t[p + "attn.wq"], t[p + "attn.bq"], t[p + "attn.wkv"], t[p + "attn.bkv"], t[p + "attn.wo_t"],
                  t[p + "attn.bo"], ia, *[c.clone() for c in caches], xh, valid_len.clone(), pos, res)
            return y, xh[torch.arange(batch, device=dev), pos]

        # a longer history whose heads miss more slots than the Q/K/V kernels' partials hold
        T2 = 64
        hist2 = torch.randn(batch, T2, D, generator=g, device=dev).to(dt)
        caches2 = [torch.randn(batch, H, T2, hd, generator=g, device=dev).to(dt) for _ in range(2)]
        pos2 = 40 + (torch.arange(batch, device=dev) * 7) % 24
        vl2 = (pos2[:, None] * 0.5 * torch.rand(batch, H, generator=g, device=dev)).to(torch.int32)

        def refresh(f):  # the pick (exactly the reference's), then at batch 1 the deferred op with it
            ia1 = ia if ia.dim() == 1 else ia[:1]
            got = f(ia1, vl2[:1], pos2[:1], 4)
            want = self._ref["kv_refresh"](ia1, vl2[:1], pos2[:1], 4)
            if not torch.equal(got.cpu(), want.cpu()):
                raise ValueError(f"picked {got.tolist()}, the reference {want.tolist()}")
            deferred = self.sparse_attn_deferred if f is self.kv_refresh else self._ref["sparse_attn_deferred"]
            kc, vc, xh, vl = [c[:1].clone() for c in caches2] + [hist2[:1].clone(), vl2[:1].clone()]
            takes = P.refresh_route(1, T2, D, hd, ia1, settings=self.settings)  # else the kernels leave them out (the reference would not)
            y = deferred(x[:1], t[p + "attn.wq"], t[p + "attn.bq"], t[p + "attn.wkv"], t[p + "attn.bkv"],
                         t[p + "attn.wo_t"], t[p + "attn.bo"], ia1, kc, vc, xh, vl, pos2[:1], res[:1],
                         refresh=got if takes else None)
            return y, kc, vc, vl.float()

        cases = {
            "sparse_fc1": lambda f: f(x, t[p + "mlp.w1"], t[p + "mlp.b1"], im, *keep),
            "compact_rows": lambda f: f(h, im),  # h about half zeros (and 0 from a per-token K's count on)
            "sparse_fc2": lambda f: f(fc2_in[0], t[p + "mlp.w2_t"], t[p + "mlp.b2"], fc2_in[1], res, **ln, **fc2_kw),
            "layer_norm": lambda f: f(x, t[p + "ln_attn.weight"], t[p + "ln_attn.bias"]),
            "sparse_attn": lambda f: f(x, t[p + "attn.wq"], t[p + "attn.bq"], t[p + "attn.wkv"], t[p + "attn.bkv"],
                                       t[p + "attn.wo_t"], t[p + "attn.bo"], ia, *[c.clone() for c in caches], pos,
                                       res),
            # several missing slots per head (valid_len < pos), a history of random inputs; pre-LN:
            # also with its input's LayerNorm pending (defer_ln_attn), the history slot it stores compared too
            "sparse_attn_deferred": lambda f: tuple(attn_deferred(f, xin) for xin in (x, pend_attn)[:1 + spec.pre_ln]),
            "kv_refresh": refresh,
        }

        report = {}
        for name, run in cases.items():
            if self.kernels[name] != "triton":
                continue
            try:
                got, want = _flat(run(getattr(self, name))), _flat(run(self._ref[name]))
                err = float((got - want).norm() / want.norm().clamp_min(1e-6))
                report[name] = err
                if not err <= tol:
                    self.demote(name, f"relative error {err:.2e} against the reference")
            except Exception as e:  # noqa: BLE001 - any kernel failure: fall back, keep running
                report[name] = f"{type(e).__name__}: {e}"
                self.demote(name, f"raised {type(e).__name__}: {e}")
        if self.kernels["predictor_topk"] == "triton" and f"{p}pred_mlp.a" in t:
            try:
                w = (t[p + "pred_mlp.a"], t[p + "pred_mlp.b"], t[p + "pred_mlp.bias"], spec.mlp_k[l])
                scales = (t[p + "pred_mlp.a_scale"], t[p + "pred_mlp.b_scale"]) if "mlp" in spec.int8_predictors \
                    else None
                out = self.predictor_topk(x, *w, shared=shared, scales=scales)
                want = self._ref["predictor_topk"](x, *w, shared=shared, scales=scales)
                same = float((out.long().sort(-1).values == want.long().sort(-1).values).float().mean())
                report["predictor_topk"] = same
                if out.shape != want.shape:
                    self.demote("predictor_topk", f"shape {tuple(out.shape)} != {tuple(want.shape)}")
            except Exception as e:  # noqa: BLE001
                report["predictor_topk"] = f"{type(e).__name__}: {e}"
                self.demote("predictor_topk", f"raised {type(e).__name__}: {e}")
        return report
