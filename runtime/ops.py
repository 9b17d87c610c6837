"""The four sparse operations the decoder calls, bound to a backend (signatures of dejavu.plugins):

    predictor_topk(x[B,D], a, b, bias, k, shared=False) -> idx[B,k] | [k]
    sparse_fc1(x[B,D], w1, b1, idx, ln_fold=None) -> h[B,K]   (x may be a PendingLN, below)
    sparse_fc2(h[B,K], w2_t, b2, idx, residual) -> y[B,D]
    sparse_attn(x_ln[B,D], wq, bq, wkv, bkv, wo_t, bo, idx, k_cache, v_cache, pos[B], residual) -> y[B,D]
        (K/V of every head are written into the caches at pos; only selected heads attend)
    sparse_attn_deferred(x_ln, wq, bq, wkv, bkv, wo_t, bo, idx, k_cache, v_cache,
                         x_hist[B,S,D], valid_len[B,H] int32, pos[B], residual, after_qkv=None,
                         refresh=None) -> y[B,D]
        (kv_policy "deferred": x_ln stored at x_hist[:, pos]; K/V computed only for the
        selected heads, over their missing slots valid_len..pos; plugins/deferred_kv.py;
        after_qkv() is called once the Q/K/V work is issued, before attention; x_ln may be a
        PendingLN, the LayerNorm then applied by the Q/K/V kernel: SparseDecoder.defer_ln_attn;
        refresh: batch 1, kv_refresh's heads, brought up to pos too)
    layer_norm(x[B,D], weight, bias) -> y[B,D]   (eps 1e-5; the decode step's LayerNorms)
    sparse_mlp(x[1,D], w1, b1, w2_t, b2, idx, residual) -> y[1,D]
        (fc1 + ReLU + fc2 in one launch at batch 1: plugins/fused_mlp.py; the decoder uses
        it when `SparseDecoder.fused_mlp` is on)
    kv_catch_up(x_hist, wkv, bkv, idx, k_cache, v_cache, valid_len, pos[B])
        (deferred K/V, ahead of the step: K/V of the selected heads at the missing slots the Q/K/V
        kernels would leave to their slow path; then sparse_attn_deferred(..., caught_up=True);
        plugins/deferred_kv.catch_up_kv; the decoder launches it on the predictors' side stream)
    kv_refresh(idx, valid_len[1,H], pos[1], r, lag=None, max_lag=None) -> [r] int32
        (deferred K/V, batch 1: the r most lagging heads outside idx, -1 past the last, whose K/V
        sparse_attn_deferred(..., refresh=) then computes too; plugins/deferred_kv.refresh_heads;
        the decoder launches it on the predictors' side stream when SparseDecoder.kv_refresh is set)

sparse_fc2, sparse_attn and sparse_attn_deferred also take `ln=(weight, bias)` and then return
(y, layer_norm(y)): the next LayerNorm of a pre-LN decoder (used when SparseDecoder.fuse_ln
is on; off by default). The Triton kernels compute it in the same launch as y when
plugins.sparse_mlp.FUSED_FINISH is on, else with the layer_norm kernel; the references apply
F.layer_norm to y, the function the unfused step applies. With `ln_defer=True` as well, the
second output may be a `PendingLN` (plugins/layer_norm.py: y plus per-block statistics from
the split-K reduction, no LayerNorm launch) that sparse_fc1 takes as its input and
normalises as it loads it, or with `ln_fold=` (layer_norm.LNFold of its weights) folded into
its rows (SparseDecoder.defer_ln, fold_ln); the references return the tensor and ignore the fold.

- "ref": the plugins' PyTorch references (the CPU path). If `dejavu.plugins` cannot be
  imported, the runtime's own gather-based references below stand in.
- "triton": the plugins' Triton launchers (CUDA). `verify()` runs each kernel once against
  its reference on the engine's real weights at activation; a kernel that raises or
  disagrees is replaced by its reference with a warning, so a GPU run never silently
  produces a different function.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

try:
    from dejavu.plugins.layer_norm import PendingLN
except Exception:  # noqa: BLE001 - without the plugins no op makes one
    class PendingLN:  # type: ignore[no-redef]
        """Stand-in: nothing returns one when dejavu.plugins is missing."""

NAMES = ("predictor_topk", "sparse_fc1", "sparse_fc2", "sparse_attn", "sparse_attn_deferred", "layer_norm",
         "sparse_mlp", "kv_catch_up", "kv_refresh")


def _rows(idx: torch.Tensor, B: int) -> torch.Tensor:
    idx = idx.long()
    return idx.expand(B, -1) if idx.dim() == 1 else idx


def attend(q, k_cache, v_cache, valid) -> torch.Tensor:
    """o [B, h, hd] for one query per sequence; q: [B, h, hd] (scale folded in),
    caches [B, h, T, hd], valid [B, T] bool (keys each query may see)."""
    o = F.scaled_dot_product_attention(q[:, :, None], k_cache, v_cache,
                                       attn_mask=valid[:, None, None, :], scale=1.0)
    return o[:, :, 0]


# ---- the runtime's own references (used only when dejavu.plugins is missing) ----------
def _predictor_topk(x, a, b, bias, k, shared=False):
    s = F.linear(F.linear(x, a), b, bias)  # [B, N]
    if shared:
        s = s.amax(0)
    return torch.topk(s, k, dim=-1, sorted=True).indices


def _sparse_fc1(x, w1, b1, idx, *, ln_fold=None):
    idx = _rows(idx, x.shape[0])
    return torch.relu(torch.einsum("bkd,bd->bk", w1[idx], x) + b1[idx])


def _with_ln(y, ln):
    return y if ln is None else (y, _layer_norm(y, *ln))


def _sparse_fc2(h, w2_t, b2, idx, residual=None, *, ln=None, ln_defer=False):
    y = torch.einsum("bk,bkd->bd", h, w2_t[_rows(idx, h.shape[0])]) + b2
    return _with_ln(y if residual is None else y + residual, ln)


def _sparse_attn(x_ln, wq, bq, wkv, bkv, wo_t, bo, idx, k_cache, v_cache, pos, residual=None, *, ln=None,
                 ln_defer=False):
    B, D = x_ln.shape
    H, T, hd = k_cache.shape[1:]
    rows = torch.arange(B, device=x_ln.device)
    kv = F.linear(x_ln, wkv, bkv).view(B, 2, H, hd)
    k_cache[rows, :, pos] = kv[:, 0]
    v_cache[rows, :, pos] = kv[:, 1]
    idx = _rows(idx, B)  # [B, Kh]
    q = torch.einsum("bkjd,bd->bkj", wq.view(H, hd, D)[idx], x_ln) + bq.view(H, hd)[idx]
    valid = torch.arange(T, device=x_ln.device)[None, :] <= pos[:, None]
    o = attend(q, k_cache[rows[:, None], idx], v_cache[rows[:, None], idx], valid)  # [B, Kh, hd]
    y = torch.einsum("bkj,bkjd->bd", o, wo_t.view(H, hd, D)[idx]) + bo
    return _with_ln(y if residual is None else y + residual, ln)


def _sparse_attn_deferred(x_ln, wq, bq, wkv, bkv, wo_t, bo, idx, k_cache, v_cache, x_hist, valid_len, pos,
                          residual=None, *, ln=None, after_qkv=None, ln_defer=False, caught_up=False, refresh=None):
    # caught_up: every missing slot is recomputed here anyway (kv_catch_up's slots included)
    B, D = x_ln.shape
    H, T, hd = k_cache.shape[1:]
    rows = torch.arange(B, device=x_ln.device)
    x_hist[rows, pos] = x_ln
    if refresh is not None:  # batch 1: the refresh heads (-1: none) brought up to pos, as selected ones are
        _kv_fill(x_hist, wkv, bkv, refresh[refresh >= 0][None, :], k_cache, v_cache, valid_len, pos, last=0)
        valid_len[0, refresh[refresh >= 0].long()] = (pos.reshape(-1)[0] + 1).to(valid_len.dtype)
    idx = _rows(idx, B)  # [B, Kh]
    # K/V of the selected heads over every slot, kept only at their missing ones (min(valid, pos)..pos)
    kv_rows = torch.cat([idx, idx + H], 1)  # [B, 2Kh]: K heads then V heads
    kv = torch.einsum("bsd,bkjd->bksj", x_hist, wkv.view(2 * H, hd, D)[kv_rows])
    kv = (kv + bkv.view(2 * H, hd)[kv_rows][:, :, None]).view(B, 2, -1, T, hd)
    start = torch.minimum(valid_len.long().gather(1, idx), pos[:, None])  # [B, Kh]
    slot = torch.arange(T, device=x_ln.device)
    fill = ((slot >= start[..., None]) & (slot <= pos[:, None, None]))[..., None]  # [B, Kh, T, 1]
    sel = (rows[:, None], idx)
    k_cache[sel] = torch.where(fill, kv[:, 0], k_cache[sel])
    v_cache[sel] = torch.where(fill, kv[:, 1], v_cache[sel])
    valid_len.scatter_(1, idx, (pos[:, None] + 1).to(valid_len.dtype).expand_as(idx))
    if after_qkv is not None:
        after_qkv()
    q = torch.einsum("bkjd,bd->bkj", wq.view(H, hd, D)[idx], x_ln) + bq.view(H, hd)[idx]
    valid = slot[None, :] <= pos[:, None]
    o = attend(q, k_cache[sel], v_cache[sel], valid)  # [B, Kh, hd]
    y = torch.einsum("bkj,bkjd->bd", o, wo_t.view(H, hd, D)[idx]) + bo
    return _with_ln(y if residual is None else y + residual, ln)


def _kv_catch_up(x_hist, wkv, bkv, idx, k_cache, v_cache, valid_len, pos, *, config=None):
    # Every missing slot before pos (min(valid_len, pos) .. pos - 1): the plugin's op fills only those
    # past the Q/K/V kernels' partials, a subset; _sparse_attn_deferred recomputes them all anyway.
    _kv_fill(x_hist, wkv, bkv, idx, k_cache, v_cache, valid_len, pos, last=-1)


def _kv_refresh(idx, valid_len, pos, r, *, lag=15, max_lag=None, **_):
    # The r most lagging heads outside idx with lag..max_lag missing slots (ties: the lower head), -1 after
    H = valid_len.shape[1]
    p = pos.reshape(-1)[0].long()
    miss = p - torch.minimum(valid_len[0].long(), p)
    ok = (miss >= lag) & (miss <= (1 << 30 if max_lag is None else max_lag))
    key = torch.where(ok, miss * H + (H - 1 - torch.arange(H, device=valid_len.device)), -1)
    key[idx.reshape(-1).long()] = -1
    top = key.sort(descending=True).values[:r]
    out = torch.full((r,), -1, dtype=torch.int32, device=valid_len.device)
    out[:top.shape[0]] = torch.where(top >= 0, H - 1 - top % H, -1).to(torch.int32)
    return out


def _kv_fill(x_hist, wkv, bkv, idx, k_cache, v_cache, valid_len, pos, last):
    # K/V of heads idx at their missing slots min(valid_len, pos) .. pos + last
    B, T, D = x_hist.shape
    H, hd = k_cache.shape[1], k_cache.shape[3]
    idx = _rows(idx, B)  # [B, Kh]
    rows = torch.arange(B, device=x_hist.device)[:, None]
    kv_rows = torch.cat([idx, idx + H], 1)  # [B, 2Kh]
    kv = torch.einsum("bsd,bkjd->bksj", x_hist, wkv.view(2 * H, hd, D)[kv_rows])
    kv = (kv + bkv.view(2 * H, hd)[kv_rows][:, :, None]).view(B, 2, -1, T, hd)
    start = torch.minimum(valid_len.long().gather(1, idx), pos[:, None])  # [B, Kh]
    slot = torch.arange(T, device=x_hist.device)
    fill = ((slot >= start[..., None]) & (slot <= pos[:, None, None] + last))[..., None]  # [B, Kh, T, 1]
    for cache, c in ((k_cache, 0), (v_cache, 1)):
        cache[rows, idx] = torch.where(fill, kv[:, c].to(cache.dtype), cache[rows, idx])


def _layer_norm(x, weight, bias):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, 1e-5)


def _sparse_mlp(x, w1, b1, w2_t, b2, idx, residual=None):
    return _sparse_fc2(_sparse_fc1(x, w1, b1, idx), w2_t, b2, idx, residual)


def _flat(out) -> torch.Tensor:
    """An op's output (a tensor, the (y, layer_norm(y)) pair, or a tuple of those; a PendingLN
    as the LayerNorm its block statistics give) as one flat fp32 tensor."""
    if isinstance(out, PendingLN):
        from dejavu.plugins.layer_norm import from_stats_ref
        return from_stats_ref(out).float().flatten()
    if isinstance(out, tuple):
        return torch.cat([_flat(o) for o in out])
    return out.float().flatten()


_LOCAL = {"predictor_topk": _predictor_topk, "sparse_fc1": _sparse_fc1, "sparse_fc2": _sparse_fc2,
          "sparse_attn": _sparse_attn, "sparse_attn_deferred": _sparse_attn_deferred, "layer_norm": _layer_norm,
          "sparse_mlp": _sparse_mlp, "kv_catch_up": _kv_catch_up, "kv_refresh": _kv_refresh}
_PLUGIN = {"predictor_topk": "predictor_topk", "sparse_fc1": "sparse_fc1", "sparse_fc2": "sparse_fc2",
           "sparse_attn": "sparse_attn_decode", "sparse_attn_deferred": "deferred_kv.sparse_attn_decode_deferred",
           "layer_norm": "layer_norm", "sparse_mlp": "sparse_mlp_fused", "kv_catch_up": "deferred_kv.catch_up_kv",
           "kv_refresh": "deferred_kv.refresh_heads"}
_TORCH_REF = {"layer_norm"}  # ops whose reference is PyTorch's own op (the dense model's exact function)


def _plugins():
    try:
        import dejavu.plugins as P
        import dejavu.plugins.deferred_kv  # noqa: F401 - a submodule: P.deferred_kv
        import dejavu.plugins.prefetch  # noqa: F401
        return P
    except Exception as e:  # noqa: BLE001 - any import failure: the local references stand in
        warnings.warn(f"dejavu.plugins unavailable ({e}); using the runtime's own reference ops")
        return None


class Ops:
    """The sparse ops of one engine; `kernels` says which implementation each op uses."""

    def __init__(self, backend: str = "ref"):
        self.backend = backend
        P = _plugins()
        self.kernels: dict[str, str] = {}
        self._ref: dict = {}
        def find(path):  # "fn" or "submodule.fn" in dejavu.plugins
            obj = P
            for part in path.split("."):
                obj = getattr(obj, part, None)
            return obj

        for name in NAMES:
            ref = find(_PLUGIN[name] + "_ref") if P is not None and name not in _TORCH_REF else None
            fast = find(_PLUGIN[name]) if (P is not None and backend == "triton") else None
            self._ref[name] = ref or _LOCAL[name]
            setattr(self, name, fast or self._ref[name])
            self.kernels[name] = "triton" if fast else ("plugin_ref" if ref else "local_ref")
        # L2 warm-up of gathered weight rows (plugins/prefetch.py): a GPU-only optimisation with
        # no effect on any output, so no reference stands in; None off the Triton backend.
        self.prefetch_rows = find("prefetch.prefetch_rows") if (P is not None and backend == "triton") else None

    def demote(self, name: str, why: str) -> None:
        """Use the reference for `name` from now on."""
        warnings.warn(f"kernel {name}: {why}; using its PyTorch reference instead")
        setattr(self, name, self._ref[name])
        self.kernels[name] = "plugin_ref" if self._ref[name] is not _LOCAL[name] else "local_ref"

    @torch.inference_mode()
    def verify(self, t: dict, spec, batch: int, shared: bool, tol: float = 3e-2) -> dict:
        """Run each Triton op once on layer 0's weights against its reference; demote failures.
        For a pre-LN model the ops that take `ln=` run with it (as the decode step calls them,
        `ln_defer` too), both outputs compared, and sparse_fc1 also takes a PendingLN input.

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
        T = 16
        caches = [torch.randn(batch, H, T, hd, generator=g, device=dev).to(dt) for _ in range(2)]
        pos = (torch.arange(batch, device=dev) * 5 + 9) % T
        hist = torch.randn(batch, T, D, generator=g, device=dev).to(dt)
        valid_len = (pos[:, None] * torch.rand(batch, H, generator=g, device=dev)).to(torch.int32)
        # pre-LN: the ops that take ln= run with it, deferred as the decode step asks for it
        # (SparseDecoder.defer_ln; a PendingLN compared through the LayerNorm its stats give)
        ln = {"ln": (t[p + "ln_mlp.weight"], t[p + "ln_mlp.bias"]), "ln_defer": True} if spec.pre_ln else {}
        from dejavu.plugins.layer_norm import ln_fold, pending_ln
        lnw = (t[p + "ln_mlp.weight"], t[p + "ln_mlp.bias"])
        pend = pending_ln(x, *lnw) if spec.pre_ln else x
        fold = {"ln_fold": ln_fold(t[p + "mlp.w1"], t[p + "mlp.b1"], *lnw)} if spec.pre_ln else {}
        # the block fold with the centred product (SparseDecoder.fold_ln "z")
        pend_z = pending_ln(x, *lnw, width=256, z=True) if spec.pre_ln else x
        fold_z = {"ln_fold": ln_fold(t[p + "mlp.w1"], t[p + "mlp.b1"], *lnw, width=256)} if spec.pre_ln else {}
        pend_attn = pending_ln(x, t[p + "ln_attn.weight"], t[p + "ln_attn.bias"]) if spec.pre_ln else x

        def attn_deferred(f, xin):  # y, and the history slot the op stored
            xh = hist.clone()
            y = f(xin, t[p + "attn.wq"], t[p + "attn.bq"], t[p + "attn.wkv"], t[p + "attn.bkv"], t[p + "attn.wo_t"],
                  t[p + "attn.bo"], ia, *[c.clone() for c in caches], xh, valid_len.clone(), pos, res, **ln)
            return y, xh[torch.arange(batch, device=dev), pos]

        # kv_catch_up, then the deferred op told so (caught_up=True; the op as verified above): caches and
        # output against both references, on a longer history whose heads miss more slots than the
        # Q/K/V kernels' partials hold
        T2 = 64
        hist2 = torch.randn(batch, T2, D, generator=g, device=dev).to(dt)
        caches2 = [torch.randn(batch, H, T2, hd, generator=g, device=dev).to(dt) for _ in range(2)]
        pos2 = 40 + (torch.arange(batch, device=dev) * 7) % 24
        vl2 = (pos2[:, None] * 0.5 * torch.rand(batch, H, generator=g, device=dev)).to(torch.int32)

        def catch_up(f):
            deferred = self.sparse_attn_deferred if f is self.kv_catch_up else self._ref["sparse_attn_deferred"]
            kc, vc, xh, vl = [c.clone() for c in caches2] + [hist2.clone(), vl2.clone()]
            f(xh, t[p + "attn.wkv"], t[p + "attn.bkv"], ia, kc, vc, vl, pos2)
            y = deferred(x, t[p + "attn.wq"], t[p + "attn.bq"], t[p + "attn.wkv"], t[p + "attn.bkv"],
                         t[p + "attn.wo_t"], t[p + "attn.bo"], ia, kc, vc, xh, vl, pos2, res, caught_up=True, **ln)
            return y, kc, vc

        def refresh(f):  # the pick (exactly the reference's), then at batch 1 the deferred op with it
            ia1 = ia if ia.dim() == 1 else ia[:1]
            got = f(ia1, vl2[:1], pos2[:1], 4)
            want = self._ref["kv_refresh"](ia1, vl2[:1], pos2[:1], 4)
            if not torch.equal(got.cpu(), want.cpu()):
                raise ValueError(f"picked {got.tolist()}, the reference {want.tolist()}")
            from dejavu.plugins.deferred_kv import refresh_route
            deferred = self.sparse_attn_deferred if f is self.kv_refresh else self._ref["sparse_attn_deferred"]
            kc, vc, xh, vl = [c[:1].clone() for c in caches2] + [hist2[:1].clone(), vl2[:1].clone()]
            takes = refresh_route(1, T2, D, hd, ia1)  # else the kernels leave them out (the reference would not)
            y = deferred(x[:1], t[p + "attn.wq"], t[p + "attn.bq"], t[p + "attn.wkv"], t[p + "attn.bkv"],
                         t[p + "attn.wo_t"], t[p + "attn.bo"], ia1, kc, vc, xh, vl, pos2[:1], res[:1],
                         refresh=got if takes else None, **ln)
            return y, kc, vc, vl.float()

        cases = {
            "sparse_fc1": lambda f: (f(x, t[p + "mlp.w1"], t[p + "mlp.b1"], im),
                                     f(pend, t[p + "mlp.w1"], t[p + "mlp.b1"], im),
                                     f(pend, t[p + "mlp.w1"], t[p + "mlp.b1"], im, **fold),
                                     f(pend_z, t[p + "mlp.w1"], t[p + "mlp.b1"], im, **fold_z)),
            "sparse_fc2": lambda f: f(h, t[p + "mlp.w2_t"], t[p + "mlp.b2"], im, res, **ln),
            "layer_norm": lambda f: f(x, t[p + "ln_attn.weight"], t[p + "ln_attn.bias"]),
            "sparse_mlp": lambda f: f(x[:1], t[p + "mlp.w1"], t[p + "mlp.b1"], t[p + "mlp.w2_t"], t[p + "mlp.b2"],
                                      im[:1] if im.dim() == 2 else im, res[:1]),
            "sparse_attn": lambda f: f(x, t[p + "attn.wq"], t[p + "attn.bq"], t[p + "attn.wkv"], t[p + "attn.bkv"],
                                       t[p + "attn.wo_t"], t[p + "attn.bo"], ia, *[c.clone() for c in caches], pos, res,
                                       **ln),
            # several missing slots per head (valid_len < pos), a history of random inputs; pre-LN:
            # also with its input's LayerNorm pending (SparseDecoder.defer_ln_attn), the history
            # slot it stores compared too
            "sparse_attn_deferred": lambda f: tuple(attn_deferred(f, xin) for xin in (x, pend_attn)[:1 + spec.pre_ln]),
            "kv_catch_up": catch_up,
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
                out = self.predictor_topk(x, t[p + "pred_mlp.a"], t[p + "pred_mlp.b"], t[p + "pred_mlp.bias"],
                                          spec.mlp_k[l], shared=shared)
                want = self._ref["predictor_topk"](x, t[p + "pred_mlp.a"], t[p + "pred_mlp.b"],
                                                   t[p + "pred_mlp.bias"], spec.mlp_k[l], shared=shared)
                same = float((out.long().sort(-1).values == want.long().sort(-1).values).float().mean())
                report["predictor_topk"] = same
                if out.shape != want.shape:
                    self.demote("predictor_topk", f"shape {tuple(out.shape)} != {tuple(want.shape)}")
            except Exception as e:  # noqa: BLE001
                report["predictor_topk"] = f"{type(e).__name__}: {e}"
                self.demote("predictor_topk", f"raised {type(e).__name__}: {e}")
        return report
