"""Canonical text of a Spec, printed from the IR: what generated headers show and cache keys hash."""
from __future__ import annotations

import hashlib

from .expr import format_expr
from .spec import Spec


def format_spec(spec: Spec) -> str:
    lines = [f"attention {spec.name} {{", f"    head_dim = {spec.head_dim}", f"    dtype = {spec.dtype.value}"]
    if spec.value_dim is not None:  # printed only when set, so the hashes of existing specs stay what they were
        lines.insert(2, f"    value_dim = {spec.value_dim}")
    lines.append(f"    scale = {'auto' if spec.scale is None else repr(spec.scale)}")
    if spec.mask is not None:
        lines.append(f"    mask = {format_expr(spec.mask)}")
    if spec.score is not None:
        lines.append(f"    score = {format_expr(spec.score)}")
    if spec.sink is not None:  # printed only when set, so the hashes of existing specs stay what they were
        lines.append(f"    sink = {format_expr(spec.sink)}")
    if spec.dropout:
        lines.append(f"    dropout = {spec.dropout!r}")
    if spec.sparsity is not None:
        sp = spec.sparsity if isinstance(spec.sparsity, str) else format_expr(spec.sparsity)
        lines.append(f"    sparsity = {sp}")
        lines.append(f"    sparse_block = {spec.sparse_block}")
    lines.append(f"    loop_order = {spec.loop_order.value}")
    lines.append(f"    target = {spec.target}")
    if spec.backend.value != "auto":  # printed only when chosen, so the hashes of existing specs stay what they were
        lines.append(f"    backend = {spec.backend.value}")
    if not spec.deterministic:  # likewise printed only when chosen
        lines.append("    deterministic = false")
    if spec.kv_layout.value != "contiguous":  # likewise
        lines.append(f"    kv_layout = {spec.kv_layout.value}")
        lines.append(f"    page_size = {spec.page_size}")
    if spec.kv_dtype is not None:  # likewise
        lines.append(f"    kv_dtype = {spec.kv_dtype.value}")
    for key in ("block_m", "block_n", "num_warps", "num_stages"):
        val = "auto" if key in spec.tune else getattr(spec, key)
        if val is not None:
            lines.append(f"    {key} = {val}")
    for decl in spec.inputs:
        lines.append(f"    input {decl.name}: {decl.dtype}[{', '.join(str(d) for d in decl.dims)}]")
    lines.append("}")
    return "\n".join(lines)


def spec_hash(spec: Spec) -> str:
    return hashlib.sha256(format_spec(spec).encode()).hexdigest()
