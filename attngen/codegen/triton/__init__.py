"""The portable generator: Triton kernels for every GPU from sm_75, also run by Triton's CPU interpreter."""
from .render import build_dropout_source, build_source, context, render

__all__ = ["build_dropout_source", "build_source", "context", "render"]
