"""Draws docs/assets/tile_maps.png: the tile classes the compiler proves for four shipped specs.

Each panel is what `attngen plan SPEC --seq 4096` prints as text: rows are query tiles, columns key tiles, each
tile full (every pair kept), partial (some kept) or empty (none kept), from the interval analysis of the mask
(with a static block pattern joined to it). Tiles of 128 x 128 at 4096 queries and 4096 keys, for every panel.

Run from the repository root, with attngen importable and matplotlib installed:

    python docs/figures/tile_maps.py
"""
from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

try:  # the package layout
    from attngen.lang.check import read_spec
    from attngen.lang.intervals import TileClass, classify_tiles
except ImportError:  # the flat layout of earlier trees
    from attngen.lang.check import read_spec
    from attngen.lang.intervals import TileClass, classify_tiles
try:
    from attngen.plan.plan import plan
except ImportError:
    try:
        from attngen.plan.planner import plan
    except ImportError:
        from attngen.plan import plan

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "assets" / "tile_maps.png"
SPECS = ("causal", "sliding_window", "strided_blocks", "local_global_blocks")
SEQ, TILE = 4096, 128
COLOURS = {TileClass.EMPTY: "#f4f4f4", TileClass.PARTIAL: "#f2a541", TileClass.FULL: "#2b6cb0"}
ORDER = (TileClass.EMPTY, TileClass.PARTIAL, TileClass.FULL)


def main() -> None:
    fig, axes = plt.subplots(1, len(SPECS), figsize=(3.2 * len(SPECS), 4.3))
    cmap = ListedColormap([COLOURS[c] for c in ORDER])
    for ax, name in zip(axes, SPECS):
        spec = read_spec(ROOT / "specs" / f"{name}.attn")
        p = plan(spec, "h100")
        classes = classify_tiles(p.mask, SEQ, SEQ, TILE, TILE)
        grid = [[ORDER.index(c) for c in row] for row in classes]
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=len(ORDER) - 1, interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        n = sum(len(row) for row in classes)
        visited = sum(c is not TileClass.EMPTY for row in classes for c in row)
        ax.set_title(f"{name}\n{visited} of {n} tiles visited", fontsize=10)
        ax.set_xlabel("key tiles")
    axes[0].set_ylabel("query tiles")
    fig.legend(handles=[Patch(color=COLOURS[c], label=c.name.lower()) for c in reversed(ORDER)], loc="lower center",
               ncol=3, frameon=False)
    fig.suptitle(f"Tile classes proved by the compiler ({SEQ} queries x {SEQ} keys, {TILE} x {TILE} tiles)", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.93))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(OUT)


if __name__ == "__main__":
    main()
