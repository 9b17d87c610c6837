"""dejavu.plugins: Triton kernels for sparse decode, with launchers and PyTorch references.

Importing this package does not import Triton (kernels are compiled on first launch), so
the references work on a CPU-only install. See docs/kernels.md.
"""
from dejavu.plugins._common import PDL_KINDS, jitted, pdl_args
from dejavu.plugins.input_sparse import input_sparse_gemv_ref, select_slices, sliced_gemv, sliced_qkv_rope
from dejavu.plugins.layer_norm import PendingLN, from_stats_ref, layer_norm, layer_norm_ref, pending_ln
from dejavu.plugins.predictor import predictor_scores, predictor_topk, predictor_topk_ref, share_keep
from dejavu.plugins.sparse_attention import sparse_attn_decode, sparse_attn_decode_ref
from dejavu.plugins.deferred_kv import recompute_kv_ref, sparse_attn_decode_deferred, sparse_attn_decode_deferred_ref
from dejavu.plugins.fc1 import sparse_fc1, sparse_fc1_ref
from dejavu.plugins.fc2 import sparse_fc2, sparse_fc2_ref
from dejavu.plugins.compact_rows import compact_rows, compact_rows_ref
from dejavu.plugins.qkv_partial import hist_slots
from dejavu.plugins.refresh_heads import refresh_heads, refresh_heads_ref, refresh_route
from dejavu.plugins.gqa_attention import GQAPartials, gqa_decode, gqa_decode_ref
from dejavu.plugins.settings import (DEFAULT, PROJECTIONS, GQAAttnSettings, InputSparseSettings, KernelSettings,
                                     resolve_kernel_settings, resolve_layer_settings, resolve_projection_settings)

__all__ = [
    "DEFAULT", "PROJECTIONS", "GQAAttnSettings", "InputSparseSettings", "KernelSettings", "resolve_kernel_settings",
    "resolve_layer_settings", "resolve_projection_settings",
    "PDL_KINDS", "jitted", "pdl_args",
    "GQAPartials", "gqa_decode", "gqa_decode_ref", "input_sparse_gemv_ref", "select_slices", "sliced_gemv", "sliced_qkv_rope",
    "PendingLN", "from_stats_ref", "layer_norm", "layer_norm_ref", "pending_ln",
    "predictor_scores", "predictor_topk", "predictor_topk_ref", "share_keep",
    "hist_slots", "recompute_kv_ref", "refresh_heads", "refresh_heads_ref", "refresh_route",
    "sparse_attn_decode", "sparse_attn_decode_ref", "sparse_attn_decode_deferred", "sparse_attn_decode_deferred_ref",
    "sparse_fc1", "sparse_fc1_ref", "sparse_fc2", "sparse_fc2_ref", "compact_rows", "compact_rows_ref",
]
