"""Plot benchmarks/engine_bench.py's JSON: ratio to the link against job size, per page size and
mechanism, stores and loads side by side. Needs matplotlib (the `cli` extra; not a core dependency of offload-core).

    python benchmarks/plot_engine.py engine.json docs/engine_h200.png [--title TEXT]
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json")
    parser.add_argument("png")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot_engine.py needs matplotlib: pip install matplotlib") from None
    rows = json.load(open(args.json))["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.2), sharey=True)
    styles = {}  # line style and marker per mechanism, colour per page size
    colours = {page: f"C{i}" for i, page in enumerate(sorted({r["page"] for r in rows}))}
    for direction, ax in zip(("store", "load"), axes):
        for mech, page in sorted({(r["mechanism"], r["page"]) for r in rows}):
            pts = sorted(
                (r["job_bytes"] / 2**20, r[f"{direction}_ratio"])
                for r in rows
                if (r["mechanism"], r["page"]) == (mech, page)
            )
            style, marker = styles.setdefault(mech, (["-", "--", ":", "-."][len(styles) % 4], "osD^v"[len(styles) % 5]))
            ax.plot(*zip(*pts), style, color=colours[page], marker=marker, label=f"{mech}, {page} B pages")
        ax.set_xscale("log")
        ax.set_xlabel("job size (MiB)")
        ax.set_title(direction)
        ax.axhline(0.9, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("of the link (jobs back to back)")
    # below the plots, where it hides no point
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=4)
    if args.title:
        fig.suptitle(args.title, fontsize=9)
    fig.tight_layout(rect=(0, 0.15, 1, 1))
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
