"""dejavu.runtime: load `.engine` files and generate with sparse kernels (`Engine`)."""
from dejavu.runtime.engine import Engine

__all__ = ["Engine"]
