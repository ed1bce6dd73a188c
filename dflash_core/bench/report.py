"""The terminal reports of `dflash-bench`: plain-text tables of an offline or serve result."""

from __future__ import annotations

from typing import Any


def _table(headers: list[str], rows: list[list[str]]) -> str:
    """Plain text, columns right-aligned except the first."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _f(x: float | None, fmt: str = ".2f", scale: float = 1.0) -> str:
    """A figure formatted, "-" when missing."""
    return "-" if x is None else format(x * scale, fmt)


def _pcts(d: dict[str, float | None]) -> str:
    """p50/p90/p99 of a distribution in milliseconds."""
    return "/".join(_f(d[k], ".0f" if (d[k] or 0) >= 0.1 else ".1f", 1000) for k in ("p50", "p90", "p99"))


def format_offline(result: dict[str, Any]) -> str:
    """The terminal report of an offline run: per-prompt rows, then the side-by-side summary."""
    cfg, s = result["config"], result["summary"]
    per_prompt = _table(
        ["prompt", "set", "in", "out", "plain ms", "dflash ms", "speedup", "accept len"],
        [
            [
                str(r["index"]),
                r["source"],
                str(r["prompt_tokens"]),
                str(r["dflash"]["output_tokens"]),
                _f(r["plain"]["time_s"], ".0f", 1000),
                _f(r["dflash"]["time_s"], ".0f", 1000),
                _f(r["speedup"]) + "x",
                _f(r["dflash"]["mean_acceptance_length"]),
            ]
            for r in result["prompts"]
        ],
    )
    p, d = s["plain"], s["dflash"]
    summary = _table(
        ["", "plain", "DFlash"],
        [
            ["output tokens", str(p["output_tokens"]), str(d["output_tokens"])],
            ["total time (s)", _f(p["total_time_s"]), _f(d["total_time_s"])],
            ["output tokens/s", _f(p["output_tokens_per_s"], ".1f"), _f(d["output_tokens_per_s"], ".1f")],
            ["decode tokens/s", _f(p["decode_tokens_per_s"], ".1f"), _f(d["decode_tokens_per_s"], ".1f")],
            ["TTFT mean (ms)", _f(p["ttft_s"]["mean"], ".1f", 1000), _f(d["ttft_s"]["mean"], ".1f", 1000)],
            ["TTFT p50/p90/p99 (ms)", _pcts(p["ttft_s"]), _pcts(d["ttft_s"])],
            ["mean acceptance length", "1.00", _f(s["mean_acceptance_length"])],
            ["speedup (total time)", "", _f(s["speedup"]) + "x"],
            ["speedup (mean per prompt)", "", _f(s["mean_prompt_speedup"]) + "x"],
            ["decode speedup", "", _f(s["decode_speedup"]) + "x"],
            ["estimated speedup (engine)", "", _f(s.get("estimated_speedup")) + "x"],
        ],
    )
    hist = "  ".join(f"{k + 1}:{100 * f:.0f}%" for k, f in enumerate(s["acceptance_histogram"]["fractions"]))
    check = (
        f"greedy outputs identical: {s['identical_outputs']}/{s['num_prompts']}"
        if s["identity_checked"]
        else f"sampled (T={cfg['temperature']}): identity not required; equal outputs "
        f"{s['identical_outputs']}/{s['num_prompts']}"
    )
    head = (
        f"dflash-bench offline: target {cfg['target']}, draft {cfg['draft']}, B={cfg['block_size']}, "
        f"{cfg['device']} {cfg['dtype']}, dataset {cfg['dataset']} ({cfg['num_prompts']} prompts), "
        f"max_tokens {cfg['max_tokens']}, T={cfg['temperature']}"
    )
    return "\n\n".join([head, per_prompt, summary, f"acceptance length histogram (1..B): {hist}", check])


def format_serve(result: dict[str, Any]) -> str:
    """The terminal report of a serve run, with the comparison when there is one."""
    cfg = result["config"]
    rows = []
    for lv in result["levels"]:
        tps = lv["spread"]["output_tokens_per_s"]
        rows.append(
            [
                str(lv["concurrency"]),
                f"{lv['completed']}/{lv['num_requests']}",
                str(lv["repeats"]),
                _f(lv["duration_s"], ".1f"),
                _f(lv["request_throughput"]),
                _f(lv["output_tokens_per_s"], ".1f"),
                f"{_f(tps['min'], '.0f')}-{_f(tps['max'], '.0f')}",
                _f(tps["stdev"], ".1f"),
                _pcts(lv["ttft_s"]),
                _pcts(lv["itl_s"]),
                _pcts(lv["tpot_s"]),
                _f(lv["mean_acceptance_length"]),
            ]
        )
    table = _table(
        [
            "conc",
            "ok",
            "rounds",
            "time s",
            "req/s",
            "out tok/s",
            "round tok/s min-max",
            "stdev",
            "TTFT p50/90/99 ms",
            "ITL p50/90/99 ms",
            "TPOT p50/90/99 ms",
            "accept len",
        ],
        rows,
    )
    head = (
        f"dflash-bench serve [{result['label']}]: {cfg['base_url']} model {cfg['model']}, dataset "
        f"{cfg['dataset']}, max_tokens {cfg['max_tokens']}, T={cfg['temperature']}; each level: at least "
        f"{cfg['repeats']} rounds and {cfg['min_duration_s']:g} s (out tok/s over all rounds; min-max and stdev "
        "over rounds)"
    )
    parts = [head, table]
    cmp = result.get("comparison")
    if cmp:
        crow = [
            [
                str(c["concurrency"]),
                _f(c["output_throughput_speedup"]) + "x",
                _f(c["request_throughput_speedup"]) + "x",
                _f(c["ttft_p50_ratio"]),
                _f(c["itl_p50_ratio"]),
                _f(c["tpot_p50_ratio"]),
                f"{c['identical_outputs']}/{c['compared_outputs']}" if "identical_outputs" in c else "-",
            ]
            for c in cmp["levels"]
        ]
        parts.append(
            f"{result['label']} vs {cmp['baseline_label']} ({cmp['baseline_file']}); latency ratios: "
            f"{result['label']} / {cmp['baseline_label']}, lower is better"
        )
        parts.append(
            _table(
                [
                    "conc",
                    "out tok/s speedup",
                    "req/s speedup",
                    "TTFT p50 ratio",
                    "ITL p50 ratio",
                    "TPOT p50 ratio",
                    "identical",
                ],
                crow,
            )
        )
    errors = [e for lv in result["levels"] for e in lv["errors"]]
    if errors:
        parts.append("failed requests, e.g.: " + errors[0])
    return "\n\n".join(parts)
