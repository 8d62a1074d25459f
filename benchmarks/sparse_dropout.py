"""Runtime block sparsity and dropout on the GPU, bf16, head_dim 128, N = 8192, B = 2, H = 16.

Block sparsity: random kept blocks of 128 x 128 (the diagonal always kept; each (b, h) its own pattern) at
densities 1, 0.5, 0.25, 0.125. Providers, in this process on the same random inputs, each checked against the
float32 naive reference (batch 0, heads 0-1) before it is timed:
  attngen   specs with `sparsity = runtime`, called with block_mask= (the list conversion is timed with it)
  flex      torch.compile(flex_attention) with a BlockMask of the same blocks, all marked full (no mask_mod
            work inside them, as attngen's blocks), built once with BlockMask.from_kv_blocks (not timed;
            create_block_mask would materialize the 2 x 16 x 8192 x 8192 element mask)
and attngen dense (no sparsity) for proportionality: density s should take <= 1.15 s of the dense time (+ one
block row). TFLOP/s count kept pairs only.

Dropout: fwd + bwd of the same kernel with dropout_p = 0.1 against dropout_p = 0.0 (target <= 1.15x), and
against torch SDPA's flash backend with dropout_p = 0.1 (target: attngen >= 1.4x its speed), dense and causal.
attngen's dropout output is checked against the reference with the same seed (exact pattern).

    python benchmarks/sparse_dropout.py [--json OUT.json]
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import BlockMask

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from attngen.runtime.blocks import block_lists  # noqa: E402
from harness import SDPA_FLASH, flex, measure, median_ms, save_results, sdpa, time_fwd_bwd, versions  # noqa: E402
from torch.nn.attention import sdpa_kernel  # noqa: E402

B, H, N, D, S = 2, 16, 8192, 128, 128
DENSITIES = (1.0, 0.5, 0.25, 0.125)


def random_blocks(density: float, gen: torch.Generator) -> torch.Tensor:
    nb = N // S
    bm = torch.rand(B, H, nb, nb, generator=gen) < density
    bm |= torch.eye(nb, dtype=torch.bool)
    return bm


def sparse_table(q, k, v, do, dense_ms) -> list[dict]:
    kern = attngen.compile(f"attention block_sparse {{ head_dim = {D} dtype = bf16 sparsity = runtime sparse_block = {S} }}")
    twin = attngen.compile(kern.spec, backend="triton") if kern.generator.generator == "gluon" else None  # for comparison
    rows = []
    for density in DENSITIES:
        bm = random_blocks(density, torch.Generator().manual_seed(int(density * 1000))).cuda()
        kept = bm.float().mean().item()
        rows_of_blocks = block_lists(bm, S, B, H, N, N, bm.device)[0]  # (count, kept key blocks) per query block row
        none = torch.zeros_like(rows_of_blocks[..., 0])
        block_mask = BlockMask.from_kv_blocks(none, torch.zeros_like(rows_of_blocks[..., 1:]), rows_of_blocks[..., 0].contiguous(),
                                              rows_of_blocks[..., 1:].contiguous(), BLOCK_SIZE=S)
        ref = attngen.reference(kern, q[:1, :2].float(), k[:1, :2].float(), v[:1, :2].float(), block_mask=bm[:1, :2])
        err = lambda out: (out[:1, :2].float() - ref).abs().max().item()  # noqa: E731
        fwd_flop = 4 * B * H * N * N * D * kept
        row = {"density": density, "kept": kept}
        row["attngen"] = measure("attngen", lambda q, k, v: kern(q, k, v, block_mask=bm), q, k, v, do, err, fwd_flop)
        row["flex"] = measure("flex", lambda q, k, v: flex(q, k, v, block_mask=block_mask), q, k, v, do, err, fwd_flop)
        row["generator"] = f"{kern.generator.generator} / {kern.generator.backward}"
        if twin is not None:
            row["triton"] = measure("attngen (Triton generator)", lambda q, k, v: twin(q, k, v, block_mask=bm), q, k, v, do, err, fwd_flop)
        row["lists_ms"] = median_ms(lambda: block_lists(bm, S, B, H, N, N, bm.device))
        a = row["attngen"]
        if "fwd_ms" in a:
            row["fwd_vs_dense"] = a["fwd_ms"] / (kept * dense_ms[0])
            row["bwd_vs_dense"] = a["bwd_ms"] / (kept * dense_ms[1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def dropout_table(q, k, v, do) -> list[dict]:
    rows = []
    for causal in (False, True):
        mask = "mask = q_idx >= kv_idx" if causal else ""
        kern = attngen.compile(f"attention drop {{ head_dim = {D} dtype = bf16 dropout = 0.1 {mask} }}")
        seed = 1234
        ref = attngen.reference(kern, q[:1, :2].float(), k[:1, :2].float(), v[:1, :2].float(), dropout_p=0.1, seed=seed)
        ref0 = attngen.reference(kern, q[:1, :2].float(), k[:1, :2].float(), v[:1, :2].float())
        flop = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
        row = {"mask": "causal" if causal else "none"}
        row["p0.1"] = measure("attngen p=0.1", lambda q, k, v: kern(q, k, v, dropout_p=0.1, seed=seed), q, k, v, do,
                              lambda out: (out[:1, :2].float() - ref).abs().max().item(), flop)
        row["p0"] = measure("attngen p=0", lambda q, k, v: kern(q, k, v, dropout_p=0.0), q, k, v, do,
                            lambda out: (out[:1, :2].float() - ref0).abs().max().item(), flop)
        row["generator"] = f"{kern.generator.generator} / {kern.generator.backward}"
        if kern.generator.generator == "gluon":  # the Triton generator's kernels of the same spec, for comparison
            twin = attngen.compile(kern.spec, backend="triton")
            row["p0.1_triton"] = measure("attngen p=0.1 (Triton generator)", lambda q, k, v: twin(q, k, v, dropout_p=0.1, seed=seed), q, k, v, do,
                                         lambda out: (out[:1, :2].float() - ref).abs().max().item(), flop)

        def flash(q, k, v):
            return sdpa(SDPA_FLASH, q, k, v, causal)

        def flash_dropout(q, k, v):
            with sdpa_kernel(SDPA_FLASH):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=causal)
        row["sdpa_flash_p0"] = measure("sdpa flash", flash, q, k, v, do, lambda out: (out[:1, :2].float() - ref0).abs().max().item(), flop)
        # SDPA's dropout pattern is its own: check only that its output is finite and near the undropped one
        row["sdpa_flash_p0.1"] = measure("sdpa flash p=0.1", flash_dropout, q, k, v, do,
                                         lambda out: 0.0 if torch.isfinite(out).all() else float("inf"), flop)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _total(r: dict) -> float:
    return r["fwd_ms"] + r["bwd_ms"] if "fwd_ms" in r else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", choices=("sparse", "dropout"), default=None, help="one of the two tables")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    dense = attngen.compile(f"attention dense {{ head_dim = {D} dtype = bf16 }}")
    dense_ms = time_fwd_bwd(lambda q, k, v: dense(q, k, v), q, k, v, do)
    sparse = sparse_table(q, k, v, do, dense_ms) if args.only != "dropout" else []
    drop = dropout_table(q, k, v, do) if args.only != "sparse" else []
    print(f"\n{versions()}; B={B} H={H} N={N} d={D} bf16; dense attngen {dense_ms[0]:.2f} / {dense_ms[1]:.2f} ms")
    print("block-sparse (random 128x128 blocks, diagonal kept): ms fwd / bwd; 'vs flex' = Flex time / attngen time;"
          " 'time/s·dense' = attngen over kept x dense (target <= 1.15)")
    print(f"{'density':>8}{'kept':>7}{'generators':>16}{'attngen':>16}{'triton gen':>16}{'flex':>16}{'vs flex':>12}{'time/s·dense':>14}{'lists us':>10}")
    for r in sparse:
        a, f = r["attngen"], r["flex"]
        cell = lambda x: f"{x['fwd_ms']:6.2f} /{x['bwd_ms']:6.2f}" if "fwd_ms" in x else f"{'error':>13}"  # noqa: E731
        vs = f"{f['fwd_ms'] / a['fwd_ms']:.2f}/{f['bwd_ms'] / a['bwd_ms']:.2f}" if "fwd_ms" in a and "fwd_ms" in f else "-"
        prop = f"{r['fwd_vs_dense']:.2f}/{r['bwd_vs_dense']:.2f}" if "fwd_vs_dense" in r else "-"
        print(f"{r['density']:8.3f}{r['kept']:7.3f}{r['generator']:>16}{cell(a):>16}{cell(r.get('triton', {})):>16}{cell(f):>16}{vs:>12}{prop:>14}"
              f"{r['lists_ms'] * 1e3:10.1f}")
    print("dropout 0.1: fwd+bwd ms (fwd / bwd for p=0.1); 'cost' = attngen p=0.1 over p=0 (target <= 1.15); 'vs flash' = SDPA flash"
          " p=0.1 over attngen p=0.1 (target >= 1.4); 'triton gen' = the same spec through the Triton generator")
    print(f"{'mask':>8}{'generators':>16}{'p=0':>8}{'p=0.1':>20}{'triton gen':>20}{'flash p=0':>11}{'flash p=0.1':>13}{'cost':>7}{'vs flash':>10}")
    for r in drop:
        t = {key: _total(r[key]) for key in ("p0", "p0.1", "sdpa_flash_p0", "sdpa_flash_p0.1")}
        split = lambda x: f"{_total(x):6.2f} ({x['fwd_ms']:.2f}/{x['bwd_ms']:.2f})" if "fwd_ms" in x else "-"  # noqa: E731
        print(f"{r['mask']:>8}{r['generator']:>16}{t['p0']:8.2f}{split(r['p0.1']):>20}{split(r.get('p0.1_triton', {})):>20}"
              f"{t['sdpa_flash_p0']:11.2f}{t['sdpa_flash_p0.1']:13.2f}{t['p0.1'] / t['p0']:7.2f}{t['sdpa_flash_p0.1'] / t['p0.1']:10.2f}")
    errors = [(name, r[name]["error"]) for r in sparse + drop for name in r if isinstance(r[name], dict) and "error" in r[name]]
    for name, err in errors:
        print(f"ERROR {name}: {err}")
    if args.json:
        save_results(args.json, dense_ms=dense_ms, sparse=sparse, dropout=drop)


if __name__ == "__main__":
    main()
