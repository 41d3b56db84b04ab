"""The rank grid of a 4D layout: tp 2 x cp 2 x pp 2 x dp 2 on 2 nodes of 8 GPUs. One panel per group kind, every rank
in its place (node, local rank), coloured by the group it belongs to; the groups are the layout's own
(``ParallelLayout.group_ranks``), its coordinates ``ParallelLayout.coords``.

    python docs/pictures/rank_grid.py                       # docs/images/rank-grid.png
    python docs/pictures/rank_grid.py --smoke --out DIR     # the same picture, into DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pictures.common import options, save  # noqa: E402

PICTURES = ("rank-grid.png",)
#: The layout drawn: 16 ranks, 8 a node.
LAYOUT = dict(world_size=16, tensor_parallel_size=2, context_parallel_size=2, pipeline_parallel_size=2,
              devices_per_node=8)
#: group kind -> what its ranks do together
PANELS = {"tp": "tensor parallel: split each matmul",
          "cp": "context parallel: split each sequence",
          "pp": "pipeline: one stage each",
          "dp": "data parallel: different samples",
          "dp_cp": "dp x cp: ZeRO partitions, gradient reduction",
          "mp": "tp x pp: one whole copy of the weights"}


def layout():
    from lightning_mgpu.layout import ParallelLayout

    return ParallelLayout(**LAYOUT)


def groups(grid) -> dict[str, list[list[int]]]:
    """What the picture shows: every group of each kind of :data:`PANELS`, as the layout creates them."""
    return {kind: grid.group_ranks(kind) for kind in PANELS}


def draw(grid, path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 6.6), layout="constrained")
    for ax, kind in zip(fig.subplots(3, 2).flat, PANELS):
        draw_panel(ax, grid, kind)
    fig.suptitle(f"tp {grid.tensor_parallel_size} x cp {grid.context_parallel_size} x pp "
                 f"{grid.pipeline_parallel_size} x dp {grid.data_parallel_size} = {grid.world_size} ranks on "
                 f"{grid.world_size // grid.devices_per_node} nodes of {grid.devices_per_node} (local ranks 0-7 "
                 "left to right): one colour per group; under each rank its tp, cp, pp, dp coordinates", fontsize=10)
    return save(fig, path)


def draw_panel(ax, grid, kind: str) -> None:
    """The ranks node by node (a row each), coloured by their group of ``kind``; the title says whether its groups
    stay inside a node."""
    import matplotlib
    from matplotlib.patches import Rectangle

    per_node, members = grid.devices_per_node, grid.group_ranks(kind)
    group_of = {r: g for g, ranks in enumerate(members) for r in ranks}
    colours = matplotlib.colormaps["tab10"]
    nodes = grid.world_size // per_node
    for r in range(grid.world_size):
        node, local = divmod(r, per_node)
        ax.add_patch(Rectangle((local + 0.04, -node + 0.06), 0.92, 0.88, facecolor=colours(group_of[r] % 10),
                               alpha=0.55, edgecolor="black", linewidth=0.6))
        c = grid.coords(r)
        ax.text(local + 0.5, -node + 0.62, str(r), ha="center", va="center", fontsize=11, weight="bold")
        ax.text(local + 0.5, -node + 0.27, f"t{c['tp']} c{c['cp']} p{c['pp']} d{c['dp']}", ha="center",
                va="center", fontsize=6.5)
    across = sum(len({r // per_node for r in g}) > 1 for g in members)
    where = "each inside one node" if not across else "each across nodes" if across == len(members) else \
        f"{across} of them across nodes"
    ax.set_title(f"{kind}: {PANELS[kind]}\n{len(members)} groups of {len(members[0])}, e.g. {members[0]}; {where}",
                 fontsize=8.5)
    ax.set_xlim(0, per_node)
    ax.set_ylim(-nodes + 1, 1)
    ax.set_yticks([-n + 0.5 for n in range(nodes)], [f"node {n}" for n in range(nodes)], fontsize=8)
    ax.set_xticks([i + 0.5 for i in range(per_node)], [str(i) for i in range(per_node)], fontsize=7)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)


def main(argv: Optional[Sequence[str]] = None) -> list[Path]:
    opts = options(argv, __doc__)
    return [draw(layout(), opts.out / PICTURES[0])]


if __name__ == "__main__":
    main()
