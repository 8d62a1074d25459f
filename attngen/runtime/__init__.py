"""The runtime: a compiled spec as a callable Kernel (kernel.py), compiled just in time (jit.py).

A call is checked against its spec and dispatched by kind: training calls with autograd and custom ops, packed
sequences, serving with per-sequence lengths or paged caches, FP8, context-parallel shards; each kind in a
module of its own. Below them: the generated modules' loading and launching, their disk cache, the layout of
outputs, runtime block sparsity and the dropout pattern.
"""
from .jit import compile
from .kernel import Kernel

__all__ = ["Kernel", "compile"]
