"""Draws docs/assets/variants_vs_flex_h100.png: attngen's speed over FlexAttention's, per attention variant.

The numbers are the attngen / FlexAttention column of BENCHMARKS.md's suite table of 2026-11-27 (NVIDIA H100
80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0; bf16, head_dim 128, B*N = 16384 tokens, H*d = 2048;
`python -m attngen bench SPECS --head-dim 128 64 --seq 1024 4096 16384`): attngen with its default choice of
code generators, FlexAttention with a mask_mod / score_mod made from the same spec, both timed in one process.
Copied here so that the figure can be redrawn without the raw results.

Run from the repository root, with matplotlib installed (attngen is not needed):

    python docs/figures/variants.py
"""
from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parents[1] / "assets" / "variants_vs_flex_h100.png"

# spec: {N: (forward, backward) attngen / FlexAttention}, head_dim 128
RATIOS = {
    "dense": {4096: (1.31, 1.16), 16384: (1.28, 1.35)},
    "causal": {4096: (1.47, 1.26), 16384: (1.50, 1.33)},
    "sliding_window": {4096: (1.42, 1.23), 16384: (1.35, 1.16)},
    "document": {4096: (1.33, 0.98), 16384: (1.31, 0.95)},
    "alibi": {4096: (1.51, 1.33), 16384: (1.60, 1.43)},
    "causal_softcap": {4096: (1.29, 1.38), 16384: (1.37, 1.40)},
    "prefix_lm": {4096: (1.42, 1.22), 16384: (1.43, 1.28)},
    "local_global_blocks": {4096: (1.42, 1.40), 16384: (1.19, 1.26)},
}
LENGTHS = (4096, 16384)
COLOURS = {4096: "#90cdf4", 16384: "#2b6cb0"}


def main() -> None:
    names = list(RATIOS)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    height = 0.38
    for ax, (pass_index, title) in zip(axes, ((0, "forward"), (1, "backward"))):
        for k, n in enumerate(LENGTHS):
            ys = [i + (k - 0.5) * height for i in range(len(names))]
            values = [RATIOS[name][n][pass_index] for name in names]
            ax.barh(ys, values, height=height, color=COLOURS[n], label=f"N = {n}")
            for y, v in zip(ys, values):
                ax.text(v + 0.02, y, f"{v:.2f}x", va="center", fontsize=7.5,
                        bbox=dict(facecolor="white", edgecolor="none", pad=0.5))
        ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, 1.85)
        ax.set_xlabel("attngen ÷ FlexAttention (higher is faster)")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[0].set_yticks(range(len(names)))
    axes[0].set_yticklabels(names)
    axes[0].invert_yaxis()
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False, fontsize=9)
    fig.suptitle("H100, bf16, head_dim 128, B·N = 16384 tokens (2026-11-27; BENCHMARKS.md)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(OUT)


if __name__ == "__main__":
    main()
