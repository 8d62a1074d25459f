"""Draws docs/assets/gluon_forward_schedule.png: the Gluon forward's schedule on Hopper (sm_90), as a timeline.

The schedule is the one templates/gluon/forward.py.jinja implements and templates/gluon/module.py.jinja draws in
the comment of every generated Gluon module (FlashAttention-3: warp specialization, ping-pong, intra-warpgroup
overlap):

  load (1 warp)   Q0 Q1 | K0 V0 | K1 V1 | wait free[0] K2 V2 | wait free[1] K3 V3 | ...   TMA into the ring
  tensor cores    [WG0 S0] [WG1 S0] [WG0 S1 + PV0] [WG1 S1 + PV0] [WG0 S2 + PV1] ...
  WG0 softmax              softmax(S0) ......   softmax(S1) ......
  WG1 softmax                       softmax(S0) ......   softmax(S1) ......

The timeline below comes from a small simulation of those rules with schematic durations (a product of one
tile: 1 unit, a softmax step: 1.5, a TMA copy: 0.5); it shows the order of events and what overlaps what, not
measured times:
- the load warp copies Q (one tile per consumer warpgroup), then K_j and V_j into a ring of STAGES slots; a
  slot is reused once both warpgroups have released it (the `free` barriers);
- in its turn (the `turn` barriers) a consumer warpgroup issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to
  back and passes the turn on; it waits for S_j only, runs the softmax of S_j while P V runs, then waits for
  P V and rescales O. So one warpgroup's softmax runs under the other's products, and the tensor cores stay
  busy.

Run from the repository root, with matplotlib installed (attngen is not needed):

    python docs/figures/schedule.py
"""
from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parents[1] / "assets" / "gluon_forward_schedule.png"
TILES = 5  # key tiles per program (each consumer warpgroup visits them all, for its own query rows)
STAGES = 3  # the K/V ring's depth (3 at head_dim 128 on the H100)
PRODUCT, SOFTMAX, COPY, EPILOGUE = 1.0, 1.5, 0.5, 1.5
WG_COLOURS = ("#2b6cb0", "#dd6b20")


def simulate():
    """Intervals (lane, start, end, label, warpgroup or None, kind) of one program's forward."""
    bars = []
    # consumers' state
    ready = [0.0, 0.0]  # when each warpgroup may take its next turn (its softmax and last P V done)
    turn_free = 0.0  # when the other warpgroup passed the turn
    tc_free = 0.0  # when the tensor cores finish what was issued so far
    s_end = [[0.0] * TILES for _ in range(2)]
    pv_end = [[0.0] * TILES for _ in range(2)]

    # the load warp: Q, then K_j, V_j as ring slots free up (computed lazily: slot j needs tile j - STAGES released)
    load_t = 0.0
    bars.append(("load warp\n(TMA)", load_t, load_t + COPY, "Q", None, "load"))
    load_t += COPY
    q_arrived = load_t
    k_arrived, v_arrived = [0.0] * TILES, [0.0] * TILES

    def load(j):
        nonlocal load_t
        start = load_t
        # K, then V: each waits until both warpgroups released slot j % STAGES (K after S, V after P V)
        for tile, released, arrived in (("K", s_end, k_arrived), ("V", pv_end, v_arrived)):
            if j >= STAGES:
                free = max(released[0][j - STAGES], released[1][j - STAGES])
                if free > start:
                    bars.append(("load warp\n(TMA)", start, free, f"wait free[{j % STAGES}]", None, "wait"))
                    start = free
            bars.append(("load warp\n(TMA)", start, start + COPY, f"{tile}{j}", None, "load"))
            arrived[j] = start + COPY
            start += COPY
        load_t = start

    loaded = 0
    for j in range(TILES + 1):  # step TILES: the last tile's P V alone
        for wg in (0, 1):
            while loaded < min(TILES, j + STAGES - 1):  # as far ahead as the ring's released slots allow
                load(loaded)
                loaded += 1
            issue = max(ready[wg], turn_free, q_arrived)
            if j < TILES:
                issue = max(issue, k_arrived[j])
            if j > 0:
                issue = max(issue, v_arrived[j - 1])
            turn_free = issue  # the turn passes once this warpgroup's products are issued
            t = max(issue, tc_free)
            if j < TILES:
                bars.append(("tensor cores\n(wgmma)", t, t + PRODUCT, f"S{j}", wg, "S"))
                s_end[wg][j] = t + PRODUCT
                t += PRODUCT
            if j > 0:
                bars.append(("tensor cores\n(wgmma)", t, t + PRODUCT, f"PV{j - 1}", wg, "PV"))
                pv_end[wg][j - 1] = t + PRODUCT
                t += PRODUCT
            tc_free = t
            lane = f"consumer WG{wg}\n(CUDA cores)"
            if j < TILES:
                start = s_end[wg][j]
                bars.append((lane, start, start + SOFTMAX, f"softmax S{j}", wg, "softmax"))
                ready[wg] = max(start + SOFTMAX, pv_end[wg][j - 1] if j > 0 else 0.0)
            else:
                start = pv_end[wg][j - 1]
                bars.append((lane, start, start + EPILOGUE, "O = acc / l", wg, "epilogue"))
    return bars


def main() -> None:
    bars = simulate()
    lanes = ["load warp\n(TMA)", "tensor cores\n(wgmma)", "consumer WG0\n(CUDA cores)", "consumer WG1\n(CUDA cores)"]
    fig, ax = plt.subplots(figsize=(13, 3.6))
    for lane, start, end, label, wg, kind in bars:
        y = len(lanes) - 1 - lanes.index(lane)
        if kind == "wait":
            ax.barh(y, end - start, left=start, height=0.5, color="none", edgecolor="#999999", hatch="///", linewidth=0.6)
            ax.text((start + end) / 2, y, label, ha="center", va="center", fontsize=7, color="#555555")
            continue
        colour = "#718096" if wg is None else WG_COLOURS[wg]
        alpha = {"S": 1.0, "PV": 0.55, "softmax": 0.3, "epilogue": 0.15, "load": 0.8}[kind]
        ax.barh(y, end - start, left=start, height=0.6, color=colour, alpha=alpha, edgecolor="black", linewidth=0.6)
        ax.text((start + end) / 2, y, label, ha="center", va="center", fontsize=7.5,
                color="white" if kind in ("S", "load") else "black")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(list(reversed(lanes)), fontsize=9)
    ax.set_xlabel("time (schematic)")
    ax.set_xticks([])
    ax.set_xlim(left=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(handles=[Patch(color=WG_COLOURS[0], label="warpgroup 0 (query rows 0-63)"),
                       Patch(color=WG_COLOURS[1], label="warpgroup 1 (query rows 64-127)"),
                       Patch(color=WG_COLOURS[0], alpha=1.0, label="S = Q K$^T$"),
                       Patch(color=WG_COLOURS[0], alpha=0.55, label="O += P V"),
                       Patch(color=WG_COLOURS[0], alpha=0.3, label="softmax, rescale O")],
              loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=5, frameon=False, fontsize=8)
    ax.set_title(f"Gluon forward on sm_90: one program, {TILES} key tiles, a ring of {STAGES} K/V stages", fontsize=10)
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110, bbox_inches="tight")
    print(OUT)


if __name__ == "__main__":
    main()
