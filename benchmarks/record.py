"""A benchmark's figures kept for the docs, and the plot it draws of them.

    python benchmarks/matmul.py --record docs/benchmarks     # writes matmul.json and matmul.svg there
    python benchmarks/record.py docs/benchmarks              # redraws every plot there from its JSON

A benchmark run with `--record DIR` calls `record(DIR, name, figures, draw)`, which writes
- DIR/NAME.json (NAME: the benchmark's, or one it gives): the command that ran, the date, the commit, the machine (CPU model, cores,
  vector features, memory), what the benchmark measures (its docstring's first paragraph),
  and `figures`, the numbers as the benchmark measured them (JSON: sizes as lists of pairs);
- DIR/NAME.svg: the plot, drawn by the benchmark's own `draw(figures, fig)` on a matplotlib
  Figure, from nothing but those figures (so that redrawing from the JSON gives the same
  plot). Text stays text in the SVG (a browser renders it with its fonts, a search finds it).

docs/benchmarks/ holds the committed records; docs/tools/build_site.py makes a page of each
(its plot, command and machine) beside the history of figures in docs/benchmarks.md.
The helpers `lines` and `bars` draw the two kinds of plot the benchmarks need.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "neon", "asimd")


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU model, cores, its vector features, memory."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags = set(value.split())
    except OSError:  # not Linux: the model platform gives
        pass
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        memory = float("nan")
    return {"cpu": cpu, "cores": os.cpu_count(), "features": [f for f in FEATURES if f in flags],
            "memory_gib": round(memory, 1), "system": f"{platform.system()} {platform.release()}",
            "python": platform.python_version()}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _about(module: str) -> str:
    """The first paragraph of module `module`'s docstring, on one line ("" where it is not
    imported: a benchmark run as a script is `__main__`)."""
    doc = sys.modules[module].__doc__ if module in sys.modules else None
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def record(directory: str | Path, benchmark: str, figures: dict, draw: Callable[[dict, Any], None], *,
           name: str | None = None) -> Path:
    """Write NAME.json and NAME.svg into `directory` (made if need be); the JSON's path.
    `benchmark` is the benchmark's module (redraw imports it from this folder), `draw(figures,
    fig)` its plot, `name` the records' name where one benchmark keeps several (default: the
    benchmark's)."""
    directory, name = Path(directory), name or benchmark
    directory.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": benchmark, "name": name,
            "command": " ".join(["python", f"benchmarks/{benchmark}.py", *sys.argv[1:]]),
            "date": datetime.date.today().isoformat(), "commit": _commit(), "machine": machine(),
            "about": _about(benchmark) or _about("__main__"), "figures": figures}
    path = directory / f"{name}.json"
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    plot(data, directory / f"{name}.svg", draw)
    print(f"recorded: {path} and {path.with_suffix('.svg')}")
    return path


def plot(data: dict, path: Path, draw: Callable[[dict, Any], None]) -> None:
    """Draw a record's figures with `draw` into the SVG file `path`; the same figures give
    the same file (no date in it, ids from a fixed salt)."""
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: no window, no global state

    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": data["name"], "font.size": 9}):
        fig = Figure(figsize=(9, 4.8), layout="constrained")
        draw(data["figures"], fig)
        m = data["machine"]
        fig.suptitle(f"{data['name']}: {m['cpu']}, {m['cores']} cores; {data['date']}", fontsize=9)
        fig.savefig(path, format="svg", metadata={"Date": None})


def lines(ax, series: dict[str, Sequence[Sequence[float]]], *, title: str, xlabel: str, ylabel: str,
          logx: bool = False, goal: float | None = None, goal_label: str = "goal",
          xticks: Sequence[tuple[float, str]] = ()) -> None:
    """One line per name of `series` ((x, y) pairs), a point at each measurement; `goal` a
    dashed horizontal line; `xticks` (value, label) pairs replace the x axis's ticks."""
    for label, points in series.items():
        xs, ys = zip(*points) if points else ((), ())
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    if goal is not None:
        ax.axhline(goal, color="red", linestyle="--", linewidth=1, label=goal_label)
    if logx:
        ax.set_xscale("log", base=2)
    if xticks:
        ax.set_xticks([x for x, _ in xticks], [s for _, s in xticks])
        ax.minorticks_off()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.1)  # room above the highest point
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def bars(ax, groups: Sequence[str], values: Sequence[float], *, title: str, ylabel: str,
         highlight: Callable[[str], bool] = lambda g: g.startswith("DTM")) -> None:
    """One bar per group, its value written above it; the groups `highlight` picks (DTM's
    own) in one colour, the peers in another."""
    colors = ["tab:blue" if highlight(g) else "tab:gray" for g in groups]
    rects = ax.bar(range(len(groups)), values, color=colors)
    ax.bar_label(rects, labels=[f"{v:.3g}" for v in values], fontsize=7)
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def redraw(directory: str | Path) -> list[Path]:
    """Every record's plot in `directory` drawn again from its JSON by its benchmark's `draw`."""
    sys.path.insert(0, str(HERE))
    done = []
    for path in sorted(Path(directory).glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        plot(data, path.with_suffix(".svg"), importlib.import_module(data["benchmark"]).draw)
        done.append(path.with_suffix(".svg"))
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description="Redraw every benchmark record's plot from its JSON.")
    ap.add_argument("directory", nargs="?", default=str(HERE.parent / "docs" / "benchmarks"))
    for svg in redraw(ap.parse_args().directory):
        print(f"drew {svg}")


if __name__ == "__main__":
    main()
