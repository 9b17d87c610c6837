"""Dense OPT in plain PyTorch, checkpoint loading, presets, and the shipped opt-mini.

The model classes are imported on first use, so `dejavu-generate --help` answers without
importing torch."""

__all__ = ["KVCache", "OPTConfig", "OPTForCausalLM"]


def __getattr__(name):
    if name in __all__:
        from dejavu.models import opt

        return getattr(opt, name)
    raise AttributeError(f"module 'dejavu.models' has no attribute {name!r}")
