"""The PNG plots of `dflash-bench` (matplotlib, headless): offline speedups and acceptance, serve throughput and
latency against concurrency."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dflash_core.bench.output import safe_name


def _pyplot() -> Any:
    """matplotlib.pyplot on the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> None:
    """Write a figure to `path` and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_offline(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """offline_speedup.png (per prompt) and offline_acceptance.png (histogram over 1..B)."""
    plt = _pyplot()
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    s, rows = result["summary"], result["prompts"]
    paths = [out_dir / "offline_speedup.png", out_dir / "offline_acceptance.png"]

    fig, ax = plt.subplots(figsize=(8, 4))
    sources = sorted({r["source"] for r in rows})
    colors = {src: f"C{i}" for i, src in enumerate(sources)}
    ax.bar(
        [r["index"] for r in rows], [r["speedup"] for r in rows], color=[colors[r["source"]] for r in rows]
    )
    line = ax.axhline(s["speedup"], color="k", linestyle="--", label=f"total time: {s['speedup']:.2f}x")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    handles = [line, *(Patch(color=colors[src], label=src) for src in sources)]
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("prompt")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(
        f"DFlash vs plain decoding, B={s['block_size']}, {result['config']['device']} "
        f"(mean acceptance length {s['mean_acceptance_length']:.2f})"
    )
    ax.legend(handles=handles, fontsize=8)
    _save(plt, fig, paths[0])

    fig, ax = plt.subplots(figsize=(8, 4))
    fr = s["acceptance_histogram"]["fractions"]
    ax.bar(range(1, len(fr) + 1), [100 * f for f in fr], color="C0")
    ax.axvline(
        s["mean_acceptance_length"],
        color="k",
        linestyle="--",
        label=f"mean {s['mean_acceptance_length']:.2f}",
    )
    ax.set_xticks(range(1, len(fr) + 1))
    ax.set_xlabel("acceptance length (tokens committed per target forward)")
    ax.set_ylabel("% of draft/verify steps")
    ax.set_title("DFlash acceptance length")
    ax.legend(fontsize=8)
    _save(plt, fig, paths[1])
    return paths


def _save_serve_figure(
    plt: Any, fig: Any, axes: Any, result: dict[str, Any], ylabels: list[str], title: str, path: Path, legend: int
) -> None:
    """Both panels against concurrency (log2 axis, ticks at `result`'s levels), then title and save."""
    conc = [lv["concurrency"] for lv in result["levels"]]
    for ax, ylabel in zip(axes, ylabels):
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=legend)
    fig.suptitle(title)
    _save(plt, fig, path)


def plot_serve(result: dict[str, Any], out_dir: Path, baseline: dict[str, Any] | None = None) -> list[Path]:
    """serve_<label>_throughput.png and serve_<label>_latency.png against concurrency (baseline dashed)."""
    plt = _pyplot()
    name = safe_name(result["label"])
    paths = [out_dir / f"serve_{name}_throughput.png", out_dir / f"serve_{name}_latency.png"]
    runs = [(result, "-")] + ([(baseline, "--")] if baseline else [])

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for res, style in runs:
        conc = [lv["concurrency"] for lv in res["levels"]]
        for ax, key in zip(axes, ("output_tokens_per_s", "request_throughput")):
            ys = [lv[key] for lv in res["levels"]]
            lo = [max(y - lv["spread"][key]["min"], 0.0) for y, lv in zip(ys, res["levels"])]
            hi = [max(lv["spread"][key]["max"] - y, 0.0) for y, lv in zip(ys, res["levels"])]
            ax.errorbar(conc, ys, yerr=[lo, hi], fmt=style, marker="o", capsize=3, label=res["label"])
    ylabels = ["output tokens/s (bars: min-max over rounds)", "requests/s (bars: min-max over rounds)"]
    _save_serve_figure(plt, fig, axes, result, ylabels, "throughput against concurrency", paths[0], legend=8)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for res, style in runs:
        conc = [lv["concurrency"] for lv in res["levels"]]
        for q, color in (("p50", "C0"), ("p90", "C1"), ("p99", "C3")):
            for ax, key in zip(axes, ("ttft_s", "itl_s")):
                ys = [lv[key][q] * 1000 if lv[key][q] is not None else math.nan for lv in res["levels"]]
                ax.plot(conc, ys, style, color=color, marker="o", label=f"{res['label']} {q}")
    ylabels = ["time to first token (ms)", "inter-token latency (ms)"]
    _save_serve_figure(plt, fig, axes, result, ylabels, "latency against concurrency", paths[1], legend=7)
    return paths
