"""Dense OPT in plain PyTorch, checkpoint loading, presets, and the shipped opt-mini."""
from dejavu.models.opt import KVCache, OPTConfig, OPTForCausalLM

__all__ = ["KVCache", "OPTConfig", "OPTForCausalLM"]
