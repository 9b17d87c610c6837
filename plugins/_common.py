"""Shared launcher plumbing for the Triton plugins: lazy Triton import, input checks.

Triton is imported only when a kernel is launched, so `dejavu.plugins` (and its PyTorch references)
imports without Triton and without a GPU stack. `jit(fn)` wraps a plain kernel function (and the
`@helper` device functions) on first use and puts `tl` into its module's globals; CPU tensors run under
Triton's interpreter (TRITON_INTERPRET=1 before `triton` is imported): docs/kernels.md, "Triton's
interpreter (CI) and CPU tensors".
"""
from __future__ import annotations

import torch

from dejavu.errors import DejavuError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)

_JITTED: dict = {}  # plain kernel function -> its Triton kernel (jitted())
tl = None  # triton.language, bound by the first `jit` (for the helpers defined here)


def _triton():
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the install
        raise DejavuError("the Triton kernels need triton (pip install 'dejavu[gpu]')") from e
    return triton


def interpreting() -> bool:
    """True when Triton was imported in interpreter mode (TRITON_INTERPRET=1)."""
    triton = _triton()
    return type(triton.language.standard.max).__name__ == "InterpretedFunction"


def helper(fn):
    """Mark a plain function as a Triton helper that kernels call: `jit` wraps it with
    `triton.jit` (in its module's globals) before the first kernel of that module compiles."""
    fn._dejavu_helper = True
    return fn


# Programmatic dependent launch (PDL, sm_90+): what a kernel may do before and after its wait is the
# contract in docs/kernels.md, "Programmatic dependent launch". Kinds: fc1 and qkv_full (gather_gemv),
# fc2 and proj (gather_gemv_t), reduce, qkv, qkv_finish, commit, attn, attn_combine, layer_norm, pred
# (the predictors' gather_gemv products on the side stream), compact (compact_rows, before fc2),
# is_select / is_gemv / is_sum (input_sparse), gqa_attn / gqa_combine (gqa_attention: the Llama decode attention).
PDL_KINDS = ("fc1", "qkv_full", "fc2", "proj", "reduce", "qkv", "qkv_finish", "commit", "attn", "attn_combine",
             "layer_norm", "pred", "compact", "is_select", "is_gemv", "is_sum", "gqa_attn", "gqa_combine")  # their triggers (settings.PDLSettings): docs/kernels.md, as measured


_SM90: dict = {}  # device -> compute capability >= 9.0 (asked once per device)


def pdl_args(device: torch.device, kind: str, pdl=None) -> dict:
    """Launch options for a kernel of `kind` (PDL_KINDS) that calls `gdc_enter`, under `pdl`
    (settings.PDLSettings; None: the defaults): {} (plain launch) or {"GDC": 1 (late trigger) or
    2 (early), "launch_pdl": True}."""
    if pdl is None:
        from dejavu.plugins.settings import DEFAULT
        pdl = DEFAULT.pdl
    if not pdl.ENABLED or device.type != "cuda" or interpreting():
        return {}
    sm90 = _SM90.get(device)
    if sm90 is None:
        sm90 = _SM90[device] = torch.cuda.get_device_capability(device)[0] >= 9
    if not sm90:
        return {}
    bad = [k for k in (kind, *pdl.EARLY, *pdl.PLAIN) if k not in PDL_KINDS]
    if bad:
        raise DejavuError(f"pdl settings: unknown kernel kind {bad[0]!r} (known: {', '.join(PDL_KINDS)})")
    if kind in pdl.PLAIN:
        return {}
    gdc = 2 if kind in pdl.EARLY else 1
    return {"GDC": gdc, "launch_pdl": True}


def reg_cap(cfg: dict, device: torch.device) -> dict:
    """Launch options capping a kernel's registers per thread at cfg["maxnreg"] (None: the
    compiler's choice; ptxas spills the rest to local memory), so more programs fit on an SM.
    CUDA only (the interpreter has no registers). Only QKVSettings.UNFOLDED_MAXNREG sets one: caps of 168 / 128
    elsewhere on the Q/K/V partial and fc2 / projection kernels did not pay (docs/kernels.md)."""
    n = cfg.get("maxnreg")
    return {"maxnreg": int(n)} if n and device.type == "cuda" and not interpreting() else {}


@helper
def gdc_enter(GDC: tl.constexpr):
    # PDL: wait for the previous kernel of the stream (its writes visible); GDC 2 (early
    # trigger) then lets the next one launch. A no-op when GDC is 0 (pdl_args).
    if GDC:
        tl.extra.cuda.gdc_wait()
        if GDC == 2:
            tl.extra.cuda.gdc_launch_dependents()


@helper
def gdc_release(GDC: tl.constexpr):
    # PDL, late trigger (GDC 1): after this program's main loop, let the next kernel launch
    # (its programs then take the SM slots of programs that are only storing results).
    if GDC == 1:
        tl.extra.cuda.gdc_launch_dependents()


@helper
def group_rows(idx_row, offs, mask, GROUP: tl.constexpr):
    # Weight rows of positions offs: idx[offs // GROUP] * GROUP + offs % GROUP, int64; masked
    # positions give row 0 (in bounds; what is computed from them is never stored).
    if GROUP == 1:
        rows = tl.load(idx_row + offs, mask=mask, other=0).to(tl.int64)
    else:
        g = tl.load(idx_row + offs // GROUP, mask=mask, other=0).to(tl.int64)
        rows = tl.where(mask, g * GROUP + offs % GROUP, 0)
    return rows


def jit(fn, device: torch.device):
    """The Triton kernel for plain function `fn`, ready to launch on `device`'s tensors."""
    if device.type == "cpu" and not interpreting():
        raise DejavuError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is first "
            "imported (use the *_ref functions for a CPU path)")
    if device.type not in ("cpu", "cuda"):
        raise DejavuError(f"Triton kernels run on cuda (or cpu in interpreter mode), not {device}")
    kernel = _JITTED.get(fn)
    if kernel is None:
        triton = _triton()
        if device.type == "cpu":
            _patch_interpreter_index()
            _patch_interpreter_bf16()
            _patch_interpreter_helper_calls()
            _interpreter_overflow_checks()
        globals()["tl"] = triton.language
        bind_helpers(fn.__globals__, triton)
        kernel = _JITTED[fn] = triton.jit(fn)
    return kernel


def jitted() -> dict:
    """The kernels `jit` has wrapped so far (plain function -> Triton kernel; benchmarks/kernel_regs.py reads
    their compiled resources and clears it between configurations)."""
    return _JITTED


def bind_helpers(g: dict, triton, seen=None) -> None:
    """Bind `tl` in module globals g and wrap the helpers there with triton.jit (kernels call
    them, so they must be JIT functions too); then the same in the modules of helpers imported
    from elsewhere (their own helpers and `tl` live in their module's globals)."""
    seen = set() if seen is None else seen
    if id(g) in seen:
        return
    seen.add(id(g))
    g["tl"] = triton.language
    for name, obj in list(g.items()):
        if getattr(obj, "_dejavu_helper", False) and callable(obj):
            if not hasattr(obj, "run"):
                g[name] = triton.jit(obj)
            bind_helpers(getattr(obj, "fn", obj).__globals__, triton, seen)


def _patch_interpreter_index():
    """Make Triton 3.6's interpreter work with numpy >= 2.4 (loops over runtime bounds).

    The interpreter keeps scalars as 1-element 1-d arrays and defines `tensor.__index__` as
    `int(array)`, which numpy 2.4 no longer allows for 1-d arrays, so `range(0, D, BLOCK)`
    with a runtime D fails. Re-patch `__index__` after the interpreter's own patching (its
    scope restores in reverse order, so the original is restored after each launch).
    """
    import triton.runtime.interpreter as interp

    if getattr(interp._patch_lang_tensor, "_dejavu_index_fix", False):
        return
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._dejavu_index_fix = True
    interp._patch_lang_tensor = patched


def _patch_interpreter_helper_calls():
    """Patch a language module once per launch in Triton's interpreter, not again at every helper call.

    The interpreter patches the language modules a kernel's globals hold (every builtin of tl, tl.tensor and
    tl.math, found by inspect.getmembers) when a launch starts and restores them when it ends; each call of a
    @jit helper patches the modules its own globals hold again, inside that launch, and never restores them.
    For modules the launch already patched that is the same work again: a third of the interpreter's time
    in the helper-heavy kernels (input_sparse). A helper call now patches only modules not yet patched in
    this launch (tl.core, from triton.language.standard's helpers, the first time); the rest is unchanged.
    """
    import triton.language as tl
    import triton.runtime.interpreter as interp

    original = interp._patch_lang
    if getattr(original, "_dejavu_once", False):
        return
    done: set = set()  # ids of the language modules patched in the running launch (empty between launches)

    def langs(fn):
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_lang(fn):
        if done:  # a helper called inside a launch
            if langs(fn) <= done:
                return interp._LangPatchScope()
            done.update(langs(fn))
            return original(fn)
        scope = original(fn)
        done.update(langs(fn))
        restore = scope.restore

        def restore_and_end():
            done.clear()
            restore()

        scope.restore = restore_and_end
        return scope

    patch_lang._dejavu_once, patch_lang.original = True, original
    interp._patch_lang = patch_lang


def _interpreter_overflow_checks():
    """Stop Triton's interpreter computing overflow checks it then throws away.

    Every int32 add / sub / mul of a kernel is checked for overflow (redone in int64 and compared) when the
    builder's sanitize_overflow is on, its default; the assert the check feeds is only made under the builder's
    debug option, off in the interpreter (a compiled kernel keeps it only in a debug build). So the interpreter
    computed the checks and dropped them: about half of its time in the kernels' index arithmetic. With debug off
    the checks are now not computed; nothing a kernel computes changes.
    """
    import dataclasses

    import triton.runtime.interpreter as interp

    builder = interp.interpreter_builder
    if builder.options.sanitize_overflow and not builder.options.debug:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def _patch_interpreter_bf16():
    """Round fp32 -> bf16 casts to nearest even in Triton's interpreter, as the GPU does.

    The interpreter converts by dropping the low 16 bits (round toward zero), so a kernel's bf16
    output in the CPU tests can be one unit in the last place below what the GPU stores (outputs
    near 4 then miss a float64 bound by ~0.03). Other casts are left to the interpreter.
    """
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    builder = getattr(interp, "InterpreterBuilder", None)
    if builder is None or getattr(builder.cast_impl, "_dejavu_bf16_fix", False):
        return
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            nan = np.isnan(src.data)
            out = np.where(nan, ((bits >> 16) | 0x0040).astype(np.uint16), rounded)  # NaN stays a quiet NaN
            return interp.TensorHandle(out.reshape(np.shape(src.data)), dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl._dejavu_bf16_fix = True
    builder.cast_impl = cast_impl


def check_tensor(name, t, *, ndim=None, shape=None, dtype=None, device=None, dtypes=None):
    """Raise DejavuError unless `t` is a contiguous tensor of the given rank/shape/dtype/device."""
    if not isinstance(t, torch.Tensor):
        raise DejavuError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise DejavuError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise DejavuError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise DejavuError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        raise DejavuError(f"{name}: dtype {t.dtype} not supported (use one of {list(dtypes)})")
    if device is not None and t.device != device:
        raise DejavuError(f"{name}: on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise DejavuError(f"{name}: must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")


def check_weight(name, w, cols, like, what="x's D"):
    """w [N, cols], contiguous, in `like`'s dtype and on its device (a layer's weight): returns N."""
    check_tensor(name, w, ndim=2, dtype=like.dtype, device=like.device)
    if w.shape[1] != cols:
        raise DejavuError(f"{name}: shape {tuple(w.shape)} does not match {what}={cols}")
    return w.shape[0]


def check_index(name, idx, *, batch, upper, device, validate):
    """Check an index tensor [B, K] or [K] of int32/int64 with values in [0, upper).

    Returns (K, shared). The range check reads min/max back to the host (a sync): only
    when `validate` is true.
    """
    check_tensor(name, idx, dtypes=INDEX_DTYPES, device=device)
    if idx.dim() == 2:
        if idx.shape[0] != batch:
            raise DejavuError(f"{name}: shape {tuple(idx.shape)} does not match batch {batch}")
        shared = False
    elif idx.dim() == 1:
        shared = True
    else:
        raise DejavuError(f"{name}: expected [B, K] or [K], got shape {tuple(idx.shape)}")
    k = idx.shape[-1]
    if validate and idx.numel() > 0:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= upper:
            raise DejavuError(f"{name}: indices out of range [0, {upper}) (min {lo}, max {hi})")
    return k, shared


def check_pos(pos, batch, device, S=None, validate=False):
    """pos (an int, or an int32/int64 tensor [], [1] or [batch] on device) -> (tensor, batch stride
    0 or 1); with `validate` (a host sync) every position in [0, S)."""
    if isinstance(pos, int):
        pos, stride = torch.full((1,), pos, dtype=torch.int32, device=device), 0
    elif not isinstance(pos, torch.Tensor) or pos.dtype not in INDEX_DTYPES:
        raise DejavuError("pos: expected an int or an int32/int64 tensor")
    elif pos.device != device:
        raise DejavuError(f"pos: on {pos.device}, expected {device}")
    elif pos.numel() == 1:
        pos, stride = pos.reshape(1), 0
    elif pos.dim() == 1 and pos.shape[0] == batch:
        check_tensor("pos", pos)
        stride = 1
    else:
        raise DejavuError(f"pos: expected shape [], [1] or [B={batch}], got {tuple(pos.shape)}")
    if validate:
        lo, hi = int(pos.min()), int(pos.max())
        if lo < 0 or hi >= S:
            raise DejavuError(f"pos: out of range [0, {S}) (min {lo}, max {hi})")
    return pos, stride


def pos_rows(pos, batch, device) -> torch.Tensor:
    """pos (int or tensor) as int64 [batch] on device (the references)."""
    return torch.as_tensor(pos).to(device).long().reshape(-1).expand(batch)


def default_validate(validate, device) -> bool:
    """Range checks default on for CPU (tests) and off on GPU (the hot path: no host sync)."""
    return device.type == "cpu" if validate is None else bool(validate)


def check_out(out, shape, dtype, device, name="out"):
    """An output tensor (`out=`) must match exactly; None allocates."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(name, out, shape=shape, dtype=dtype, device=device)
    return out


def dot_fp32(dtype, device) -> bool:
    """Whether a kernel's tl.dot runs on fp32 operands in IEEE fp32 (DOT_FP32; Triton's default would
    be tf32): fp32 inputs, and bf16 on CPU (Triton 3.6's interpreter computes bf16 dots wrongly)."""
    return dtype == torch.float32 or (device.type == "cpu" and dtype == torch.bfloat16)


def expand_idx(idx, batch) -> torch.Tensor:
    """An index set [K] (shared) or [B, K] as int64 [batch, K] (the references)."""
    return idx.long().expand(batch, -1) if idx.dim() == 1 else idx.long()


def cdiv(a, b):
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
