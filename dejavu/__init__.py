"""dejavu: contextual-sparsity compiler and runtime for OPT decoding.

Subpackages (each a top-level folder of the repository):
  dejavu.models    dense OPT in plain PyTorch, checkpoint loading, opt-mini
  dejavu.plugins   Triton kernels with PyTorch references
  dejavu.compiler  calibration, predictors, ONNX export and rewrite passes, engine build
  dejavu.runtime   engine loading, sparse decode, CUDA graphs, evaluation
"""
from dejavu.errors import DejavuError

__version__ = "0.1.0"
__all__ = ["DejavuError", "__version__"]
