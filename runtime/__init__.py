"""dejavu.runtime: load `.engine` files and generate with sparse kernels (`Engine`).

`Engine` is imported on first use, so `dejavu-run --help` and the other CLIs of this package
answer without importing torch."""

__all__ = ["Engine"]


def __getattr__(name):
    if name == "Engine":
        from dejavu.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'dejavu.runtime' has no attribute {name!r}")
