"""dejavu.plugins: Triton kernels for sparse decode, with launchers and PyTorch references.

Importing this package does not import Triton (kernels are compiled on first launch), so
the references work on a CPU-only install. See docs/kernels.md.
"""
from dejavu.plugins.layer_norm import layer_norm, layer_norm_ref
from dejavu.plugins.predictor import (predictor_scores, predictor_topk, predictor_topk_ref,
                                      predictor_topk_shared)
from dejavu.plugins.sparse_attention import sparse_attn_decode, sparse_attn_decode_ref
from dejavu.plugins.sparse_mlp import (kernel_settings, sparse_fc1, sparse_fc1_ref, sparse_fc2,
                                       sparse_fc2_ref, sparse_mlp_layer, sparse_mlp_layer_ref)

__all__ = [
    "kernel_settings",
    "layer_norm", "layer_norm_ref",
    "predictor_scores", "predictor_topk", "predictor_topk_ref", "predictor_topk_shared",
    "sparse_attn_decode", "sparse_attn_decode_ref",
    "sparse_fc1", "sparse_fc1_ref", "sparse_fc2", "sparse_fc2_ref", "sparse_mlp_layer", "sparse_mlp_layer_ref",
]
