"""dejavu.plugins: Triton kernels for sparse decode, with launchers and PyTorch references.

Importing this package does not import Triton (kernels are compiled on first launch), so
the references work on a CPU-only install. See docs/kernels.md.
"""
from dejavu.plugins.layer_norm import layer_norm, layer_norm_ref
from dejavu.plugins.predictor import (predictor_scores, predictor_topk, predictor_topk_ref,
                                      predictor_topk_shared)
from dejavu.plugins.sparse_attention import sparse_attn_decode, sparse_attn_decode_ref
from dejavu.plugins.deferred_kv import (recompute_kv, recompute_kv_ref, sparse_attn_decode_deferred,
                                        sparse_attn_decode_deferred_ref)
from dejavu.plugins.fc1 import sparse_fc1, sparse_fc1_ref
from dejavu.plugins.fc2 import sparse_fc2, sparse_fc2_ref, sparse_mlp_layer, sparse_mlp_layer_ref
from dejavu.plugins.qkv_partial import hist_slots
from dejavu.plugins.refresh_heads import refresh_heads, refresh_heads_ref, refresh_route


def kernel_settings() -> dict:
    """Every kernel's block choices in force (JSON-ready): the engine header's
    target.kernel_settings, so an engine records what it was built and measured with."""
    import importlib

    mod = lambda name: importlib.import_module(f"dejavu.plugins.{name}")  # noqa: E731
    pr = mod("predictor")
    fc1, fc2 = mod("fc1"), mod("fc2")
    return {"sparse_mlp": {"fc1": {k: dict(v) for k, v in fc1.FC1_CONFIG.items()},
                           "fc2": {k: dict(v) for k, v in fc2.FC2_CONFIG.items()},
                           "dot_min_batch": fc1.DOT_MIN_BATCH, "fc2_dot_min_batch": fc2.FC2_DOT_MIN_BATCH,
                           "fc2_target_programs": fc2.TARGET_PROGRAMS},
            "deferred_qkv": dict(mod("qkv_partial").QKV_CONFIG),
            "deferred_qkv_b1": dict(mod("qkv_partial").QKV_CONFIG_B1),
            "attention": dict(mod("sparse_attention").ATTN_CONFIG),
            "topk": {"method": pr.TOPK_METHOD, **pr.TOPK_CONFIG},
            "scoring": {"method": pr.SCORE_METHOD, **{k: dict(v) for k, v in pr.SCORE_CONFIG.items()}},
            "layer_norm": {k: v for k, v in mod("layer_norm").LN_CONFIG.items()},
            "pdl": {k: (list(v) if isinstance(v, tuple) else v) for k, v in mod("_common").PDL_CONFIG.items()}}

__all__ = [
    "kernel_settings",
    "layer_norm", "layer_norm_ref",
    "predictor_scores", "predictor_topk", "predictor_topk_ref", "predictor_topk_shared",
    "hist_slots", "recompute_kv", "recompute_kv_ref", "refresh_heads", "refresh_heads_ref", "refresh_route",
    "sparse_attn_decode", "sparse_attn_decode_ref", "sparse_attn_decode_deferred", "sparse_attn_decode_deferred_ref",
    "sparse_fc1", "sparse_fc1_ref", "sparse_fc2", "sparse_fc2_ref", "sparse_mlp_layer", "sparse_mlp_layer_ref",
]
