"""gpt-oss's attention layers on a GPU, forward + backward: attngen against FlexAttention (the sink applied outside,
from Flex's output and row log-sum-exp) and transformers' eager path (gpt-oss's own `eager_attention_forward`, the
one its models fall back to for sinks), in one process on the same inputs.

gpt-oss-20b's shape: 64 query heads over 8 key/value heads, head_dim 64, bf16, a learned sink per head; its layers
alternate a sliding window of 128 keys and full causal attention. B = 1 sequence of N tokens (default 4096 8192
16384; eager only where its N x N scores fit, --eager-max). For each layer kind and provider: forward + backward
time (do_bench median, the sinks' gradient included), the peak memory the call adds, and the largest difference
from attngen's output; attngen itself is checked against attngen.reference (float32, first 8 heads) first.

    python benchmarks/gpt_oss.py [--seq 4096 8192 16384] [--generators triton gluon] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import types

import torch

import attngen
from attngen.tools.bench import flex, median_ms, versions, with_sink

HQ, HKV, D, WINDOW = 64, 8, 64, 128
LAYERS = {
    "sliding": f"mask = q_idx >= kv_idx and kv_idx > q_idx - {WINDOW}",
    "full": "mask = q_idx >= kv_idx",
}


def spec_text(kind: str) -> str:
    return (f"attention gpt_oss_{kind} {{\n    head_dim = {D}\n    dtype = bf16\n    input sinks: fp32[H]\n    sink = sinks[h]\n"
            f"    {LAYERS[kind]}\n}}")


def eager_fn(kind: str, n: int):
    """transformers' gpt-oss eager attention, with the additive mask its models build (bf16 minimum where masked)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    i = torch.arange(n, device="cuda")
    keep = i[:, None] >= i[None, :]
    if kind == "sliding":
        keep &= i[None, :] > i[:, None] - WINDOW
    mask = torch.zeros(n, n, device="cuda", dtype=torch.bfloat16).masked_fill(~keep, torch.finfo(torch.bfloat16).min)[None, None]

    def run(q, k, v, sinks):
        module = types.SimpleNamespace(num_key_value_groups=HQ // HKV, sinks=sinks.to(q.dtype), training=False)  # the model's bf16 sinks
        out, _ = eager_attention_forward(module, q, k, v, mask, scaling=D ** -0.5)
        return out.transpose(1, 2)  # (B, N, H, D) -> (B, H, N, D)
    return run


def flex_fn(kind: str, n: int):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        return keep & (kv_idx > q_idx - WINDOW) if kind == "sliding" else keep
    block_mask = create_block_mask(mask_mod, None, None, n, n, device="cuda")

    def run(q, k, v, sinks):
        out, lse = flex()(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
        return with_sink(out, lse, sinks.float()[None, :, None])
    return run


def measure(fn, q, k, v, sinks, do) -> dict:
    """Forward + backward ms (the gradients of q, k, v and the sinks) and the peak memory one such call adds."""
    def step():
        for t in (q, k, v, sinks):
            t.grad = None
        fn(q, k, v, sinks).backward(do)
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"ms": median_ms(step), "peak_mib": peak / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--eager-max", type=int, default=8192, help="longest N the eager path runs at (its scores are N x N a head)")
    ap.add_argument("--generators", nargs="*", default=[], choices=["triton", "gluon"],
                    help="also time the spec through these code generators (backend = ...), in the same process as auto's")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for kind in LAYERS:
        kern = attngen.compile(spec_text(kind))
        also = {f"attngen_{g}": attngen.compile(spec_text(kind), backend=g) for g in args.generators}
        for n in args.seq:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(1, HQ, n, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
            k, v = (torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in range(2))
            sinks = torch.randn(HQ, device="cuda", generator=gen).requires_grad_()
            do = torch.randn(1, HQ, n, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            with torch.no_grad():
                mine = kern(q, k, v, sinks=sinks)
                if n == args.seq[0]:
                    ref = attngen.reference(kern, q[:, :8].float(), k[:, :1].float(), v[:, :1].float(), sinks=sinks[:8])
                    err = (mine[:, :8].float() - ref).abs().max().item()
                    assert err < 2e-2 and not mine.isnan().any(), f"attngen against the reference: {err}"
            row = {"layer": kind, "N": n}
            providers = {name: (lambda q, k, v, s, kern=kern: kern(q, k, v, sinks=s)) for name, kern in {"attngen": kern, **also}.items()}
            providers["flex"] = flex_fn(kind, n)
            if n <= args.eager_max:
                providers["eager"] = eager_fn(kind, n)
            for name, fn in providers.items():
                try:
                    with torch.no_grad():
                        diff = (fn(q, k, v, sinks).float() - mine.float()).abs().max().item()
                    row[name] = {**measure(fn, q, k, v, sinks, do), "max_diff": diff}
                except Exception as exc:  # one provider failing must not hide the others
                    row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                torch.cuda.empty_cache()
            rows.append(row)
            print(format_row(row), flush=True)
    print(f"\n{versions()}; B=1, {HQ}/{HKV} heads, d={D}, bf16, sinks; forward+backward ms, peak MiB a call adds\n"
          + "\n".join(format_row(r) for r in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions(), "rows": rows}, f, indent=1)


def format_row(r: dict) -> str:
    a = r["attngen"]
    cells = [f"{r['layer']:<8}{r['N']:>7}"]
    for name in [key for key in r if key.startswith("attngen")] + ["flex", "eager"]:
        x = r.get(name)
        if x is None:
            cells.append(f"{name} -")
        elif "error" in x:
            cells.append(f"{name} error: {x['error'][:60]}")
        else:
            ratio = "" if name == "attngen" or "ms" not in a else f" ({x['ms'] / a['ms']:.2f}x attngen's time)"
            cells.append(f"{name} {x['ms']:.3f} ms {x['peak_mib']:.0f} MiB{ratio}")
    return " | ".join(cells)


if __name__ == "__main__":
    main()
