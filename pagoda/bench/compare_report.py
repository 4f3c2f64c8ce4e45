"""The output of `pagoda compare`: metric table, ratios, Markdown, JSON and PNG plots.

Input is one worker result per configuration (see `compare_worker`); every metric also gets a
ratio to the reference (the first configuration that ran). Plots (matplotlib, Agg backend):
decode tok/s vs batch size, memory split (weights / KV cache / other), KV capacity in tokens,
load and start-up time. Titles are wrapped to the figure's width.
`python -m pagoda.bench.compare_report DIR` re-renders a finished run from its report.json.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Metric:
    key: str
    title: str
    kind: str  # how to format: gib, tokens, x, s, ms, toks, ppl
    better: str  # "lower" | "higher"


def metrics_for(settings: dict[str, Any]) -> list[Metric]:
    """The table's rows, in order; decode rows follow the batch sizes asked for."""
    rows = [
        Metric("weights_gib", "weights in memory (GiB)", "gib", "lower"),
        Metric("weights_disk_gib", "weights on disk (GiB)", "gib", "lower"),
        Metric(
            "source_disk_gib", "source file on disk, before dequantization (GiB)", "gib", "lower"
        ),
        Metric("kv_cache_gib", "KV cache available (GiB)", "gib", "higher"),
        Metric("kv_tokens", "KV cache capacity (tokens)", "tokens", "higher"),
        Metric(
            "max_concurrency",
            f"max concurrency at max_model_len={settings['max_model_len']}",
            "x",
            "higher",
        ),
        Metric("load_s", "weights load time (s)", "s", "lower"),
        Metric("startup_s", "engine start-up, total (s)", "s", "lower"),
        Metric("cuda_graph_s", "CUDA-graph capture (s)", "s", "lower"),
        Metric("peak_allocated_gib", "peak GPU memory allocated (GiB)", "gib", "lower"),
        Metric("peak_reserved_gib", "peak GPU memory reserved (GiB)", "gib", "lower"),
        Metric("peak_rss_gib", "peak host RSS (GiB)", "gib", "lower"),
        Metric("ttft_ms", f"TTFT p50, prompt {settings['prompt_len']} (ms)", "ms", "lower"),
    ]
    rows += [
        Metric(f"decode_tok_s@{b}", f"decode tok/s, batch {b}", "toks", "higher")
        for b in settings["batch_sizes"]
    ]
    n = settings.get("throughput_requests", 0)
    if n:
        rows.append(
            Metric("throughput_tok_s", f"throughput, {n} requests (output tok/s)", "toks", "higher")
        )
    # every run has a perplexity: on --ppl-text, else on a default text (see compare_worker)
    text = "your text" if settings.get("ppl_text") else "held-out text"
    title = f"perplexity, {text} ({settings['ppl_window']}-token windows)"
    rows.append(Metric("ppl", title, "ppl", "lower"))
    rows += [
        Metric("greedy_same", "greedy answers identical to the first's", "pct", "higher"),
        Metric("greedy_tokens", "greedy answer tokens matching the first's", "pct", "higher"),
    ]
    return rows


def flat_values(result: dict[str, Any], metrics: list[Metric]) -> dict[str, float | None]:
    """One number (or None) per metric key from a worker result."""
    values: dict[str, float | None] = {}
    decode = result.get("decode_tok_s") or {}
    for m in metrics:
        if m.key.startswith("decode_tok_s@"):
            v = decode.get(m.key.split("@", 1)[1])
        else:
            v = result.get(m.key)
        values[m.key] = float(v) if isinstance(v, (int, float)) and v == v else None
    return values


def ratios(values: dict[str, float | None], ref: dict[str, float | None]) -> dict[str, float]:
    """value / reference value, for every metric both have (and the reference is not 0)."""
    out = {}
    for k, v in values.items():
        r = ref.get(k)
        if v is not None and r:
            out[k] = v / r
    return out


def memory_split(result: dict[str, Any]) -> dict[str, float] | None:
    """(weights, KV cache, other) GiB. Other = the process peak minus weights and KV: on GPU
    peak reserved + non-torch memory (CUDA context, kernels), on CPU the peak RSS (Python,
    torch runtime, activations)."""
    weights = result.get("weights_gib")
    if weights is None:
        return None
    kv = result.get("kv_cache_gib") or 0.0
    if result.get("peak_reserved_gib") is not None:
        peak = result["peak_reserved_gib"]
        integrated = (result.get("memory_report") or {}).get("integrated_gpu", False)
        extra = 0.0 if integrated else result.get("non_torch_gib") or 0.0
        other = max(0.0, peak - weights - kv) + extra
    elif result.get("peak_rss_gib") is not None:
        other = max(0.0, result["peak_rss_gib"] - weights - kv)
    else:
        other = 0.0
    return {"weights": weights, "kv_cache": kv, "other": other}


# ---------------------------------------------------------------------- formatting


def fmt(value: float | None, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if kind == "gib":
        if 0 < value < 0.1:  # tiny test models: keep three significant digits
            return f"{value:.3g}"
        return f"{value:.3f}" if value < 10 else f"{value:.2f}"
    if kind == "tokens":
        return f"{int(value):,}"
    if kind == "x":
        return f"{value:.1f}×" if value >= 10 else f"{value:.2f}×"
    if kind == "s":
        return f"{value:.2f}"
    if kind == "ms":
        return f"{value:.1f}" if value >= 10 else f"{value:.2f}"
    if kind == "toks":
        return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"
    if kind == "pct":
        return f"{100 * value:.0f} %"
    if kind == "ppl":
        return f"{value:.3f}" if value < 100 else f"{value:.1f}"
    return f"{value:g}"


def markdown_table(report: dict[str, Any]) -> str:
    """Metrics as rows, configurations as columns, `value (ratio×)` against the reference."""
    metrics = [Metric(**m) for m in report["metrics"]]
    configs = [c for c in report["configs"] if c["status"] == "ok"]
    ref = report.get("reference")
    head = "| metric | " + " | ".join(_md_escape(c["label"]) for c in configs) + " |"
    sep = "|---|" + "---:|" * len(configs)
    lines = [head, sep]
    # what ran where: a float32 CPU run must say so next to its numbers
    for key, title in (("dtype", "dtype"), ("device", "device")):
        cells = [_md_escape(str(c.get(key) or c["result"].get(key) or "—")) for c in configs]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    for m in metrics:
        cells = []
        for c in configs:
            v = c["values"].get(m.key)
            cell = fmt(v, m.kind)
            r = c["ratios"].get(m.key)
            if v is not None and r is not None and c["label"] != ref and m.kind != "pct":
                cell += f" ({r:.2f}×)"
            cells.append(cell)
        if all(cell == "—" for cell in cells):
            continue  # e.g. GPU-only rows on a CPU run
        lines.append(f"| {m.title} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def _threads(report: dict[str, Any]) -> str:
    found = {c["result"].get("torch_threads") for c in report["configs"] if c["status"] == "ok"}
    found.discard(None)
    return ",".join(str(t) for t in sorted(found)) or "?"


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    env = report.get("env") or {}
    where = env.get("gpu") or env.get("cpu") or "cpu"
    parts = [
        "# pagoda compare",
        "",
        f"{env.get('date', '')} · {s['device_resolved']} ({where}) · torch "
        f"{env.get('torch', '?')} · transformers {env.get('transformers', '?')} · pagoda "
        f"{report.get('git') or '?'}",
        "",
        f"`{report['command']}`",
        "",
        markdown_table(report),
        "",
        f"Ratios in parentheses are to **{report.get('reference')}** (the first configuration). "
        "Lower is better for memory, time and perplexity; higher for KV capacity and speed.",
        "",
        "Settings: "
        f"gpu_memory_utilization={s['gpu_memory_utilization']}, "
        f"max_model_len={s['max_model_len']}, max_num_seqs={s['max_num_seqs']}, "
        f"torch threads={_threads(report)}, "
        f"TTFT and decode with random prompts of {s['prompt_len']} tokens and "
        f"{s['output_len']} output tokens (greedy, ignore_eos; median of {s['iters']} runs); "
        "decode tok/s counts every sequence's tokens from the step where all of the batch "
        "has its first token to the end.",
    ]
    if s.get("throughput_requests"):
        parts.append("")
        parts.append(
            f"Throughput: the first {s['throughput_requests']} requests of `pagoda bench "
            "throughput`'s workload (random ids, prompt and output lengths uniform in "
            f"[{s['throughput_len_range'][0]}, {s['throughput_len_range'][1]}], temperature "
            "0.6, ignore_eos), all submitted at once."
        )
    parts.append("")
    ppl = (
        next(
            (
                c["result"].get("perplexity")
                for c in report["configs"]
                if c["status"] == "ok" and c["result"].get("perplexity")
            ),
            None,
        )
        or {}
    )
    parts.append(
        f"Perplexity: {ppl.get('text') if not s.get('ppl_text') else '`' + s['ppl_text'] + '`'}"
        f", {ppl.get('text_tokens', '?')} tokens scored in "
        f"windows of {ppl.get('window', s['ppl_window'])} (stride = window, every token after "
        f"the first predicted once; {ppl.get('windows', '?')} windows, tokens hash "
        f"`{ppl.get('tokens_sha256', '?')}`), by `{ppl.get('method', '?')}`: "
        "`pagoda eval perplexity MODEL --text FILE --window W` gives the same number."
    )
    greedy = next(
        (c["result"]["greedy"] for c in report["configs"] if (c.get("result") or {}).get("greedy")),
        None,
    )
    if greedy:
        parts.append("")
        parts.append(
            f"Greedy answers: {len(greedy['questions'])} short chat questions, "
            f"{greedy['max_tokens']} tokens each, compared with **{report.get('reference')}**'s "
            "answers: the share that are identical, and the share of its tokens reproduced "
            "(each answer's common prefix)."
        )
    if report.get("wall_s") is not None:
        parts += ["", f"Wall time of the command up to this table: {report['wall_s']:.0f} s."]
    notes = []
    cores = os.cpu_count() or 1
    loads = [
        max(
            c["result"].get("load_average_start", [0])[0],
            c["result"].get("load_average_end", [0])[0],
        )
        for c in report["configs"]
        if c["status"] == "ok"
    ]
    if loads and max(loads) > cores:
        notes.append(
            f"the machine was busy (1-minute load average up to {max(loads):.1f} on "
            f"{cores} cores): timings are noisy"
        )
    for c in report["configs"]:
        if c["status"] != "ok":
            notes.append(f"**{c['label']}** failed: {c.get('error')}")
            continue
        if c.get("interrupted"):
            notes.append(
                f"**{c['label']}** was interrupted: only the measurements it finished are "
                "shown; run the same command with --resume to complete it"
            )
        for n in c["result"].get("notes", []):
            if n not in notes:
                notes.append(n)
        r = c["result"]
        if r.get("quantization"):
            head = f"; lm_head {r['lm_head']}" if r.get("lm_head") else ""
            notes.append(
                f"{c['label']}: {r['quantized_linear_layers']} of {r['linear_layers']} linear "
                f"layers run {r['quantization']} ({', '.join(r.get('linear_methods', []))})"
                f"{head}"
            )
    hashes = {
        c["label"]: (c["result"].get("perplexity") or {}).get("tokens_sha256")
        for c in report["configs"]
        if c["status"] == "ok" and c["result"].get("perplexity")
    }
    if len(set(hashes.values())) > 1:
        notes.append(
            "perplexity was computed on different tokens (tokenizers differ: "
            + ", ".join(f"{k} `{v}`" for k, v in hashes.items())
            + "), so those perplexities are not comparable"
        )
    skipped = [
        c["label"]
        for c in report["configs"]
        if c["status"] == "ok" and (c["result"].get("perplexity") or {}).get("skipped")
    ]
    if skipped:
        notes.append(f"no perplexity for {', '.join(skipped)}: no tokenizer (dummy config)")
    if report.get("plots_skipped"):
        notes.append(f"plots skipped: {report['plots_skipped']}")
    if notes:
        parts += ["", "Notes:", *[f"- {n}" for n in notes]]
    plots = report.get("plots") or []
    if plots:
        parts += ["", *[f"![{Path(p).stem}]({Path(p).name})" for p in plots]]
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------- plots


def _wrap(label: str, width: int = 18) -> str:
    return "\n".join(textwrap.wrap(label, width, break_long_words=False)) or label


def _title(ax: Any, fig: Any, *lines: str) -> None:
    """A title whose every line fits the figure: long lines are wrapped at word boundaries
    (about 0.62 x the font size per character, a safe width for DejaVu Sans)."""
    size = 13
    chars = max(20, int(fig.get_figwidth() * 72 / (size * 0.62)))
    wrapped = [w for line in lines for w in textwrap.wrap(line, chars) or [""]]
    ax.set_title("\n".join(wrapped), fontsize=size)


def _label_points(fig: Any, ax: Any, by_x: dict[int, list[tuple[float, str]]]) -> None:
    """Each point's value to its right, pushed apart vertically so close curves stay legible."""
    fig.canvas.draw()  # fixes the axis limits, so data -> pixel transforms are final
    min_gap = 16  # pixels: one 9-point line at 120 dpi
    for x, pts in by_x.items():
        placed: list[float] = []
        for y, color in sorted(pts):
            py = ax.transData.transform((x, y))[1]
            ty = py if not placed else max(py, placed[-1] + min_gap)
            placed.append(ty)
            # a white box keeps the curves that pass behind a label from crossing its digits
            box = {"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85}
            ax.annotate(
                fmt(y, "toks"),
                (x, y),
                xytext=(9, ty - py),
                textcoords="offset pixels",
                ha="left",
                va="center",
                fontsize=9,
                color=color,
                bbox=box,
            )


def write_plots(report: dict[str, Any], out_dir: Path) -> list[str]:
    """PNG files in `out_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [c for c in report["configs"] if c["status"] == "ok"]
    if not configs:
        return []
    s = report["settings"]
    device = s["device_resolved"]
    paths = []
    plt.rcParams.update({"font.size": 11, "axes.titlesize": 13, "axes.labelsize": 12})

    # decode tok/s vs batch size
    fig, ax = plt.subplots(figsize=(8.5, 5.5), dpi=120)
    all_y = []
    by_x: dict[int, list[tuple[float, str]]] = {}
    for i, c in enumerate(configs):
        pts = [(b, c["values"].get(f"decode_tok_s@{b}")) for b in s["batch_sizes"]]
        pts = [(b, y) for b, y in pts if y is not None]
        if not pts:
            continue
        xs, ys = zip(*pts, strict=True)
        all_y += ys
        baseline = c["engine"] == "transformers"
        color = "0.45" if baseline else f"C{i}"
        ax.plot(
            xs,
            ys,
            marker="s" if baseline else "o",
            markersize=7,
            linewidth=2,
            linestyle="--" if baseline else "-",
            color=color,
            label=c["label"],
        )
        for x, y in pts:
            by_x.setdefault(x, []).append((y, color))
    ax.set_xscale("log", base=2)
    ax.set_xticks(s["batch_sizes"])
    ax.set_xticklabels([str(b) for b in s["batch_sizes"]])
    ax.minorticks_off()
    if all_y and max(all_y) / max(min(all_y), 1e-9) > 20:
        ax.set_yscale("log")
    ax.set_xlabel("batch size (concurrent sequences, log scale)")
    ax.set_ylabel("decode throughput (tokens/s, all sequences)")
    _title(
        ax,
        fig,
        f"Decode speed vs batch size — {device}",
        f"prompt {s['prompt_len']} tokens, {s['output_len']} output tokens",
    )
    ax.grid(True, which="major", alpha=0.35)
    ax.margins(x=0.15, y=0.12)
    ax.legend(loc="upper left", fontsize=10, framealpha=0.9)
    _label_points(fig, ax, by_x)
    fig.tight_layout()
    p = out_dir / "decode_tok_s.png"
    fig.savefig(p)
    plt.close(fig)
    paths.append(str(p))

    # memory split: stacked bars
    splits = [(c, memory_split(c["result"])) for c in configs]
    splits = [(c, sp) for c, sp in splits if sp is not None]
    if splits:
        fig, ax = plt.subplots(figsize=(max(7.0, 2.2 * len(splits) + 2), 6.4), dpi=120)
        xs = range(len(splits))
        on_gpu = device.startswith("cuda")
        other_name = (
            "other (activations, allocator cache, CUDA context)"
            if on_gpu
            else "other (Python + torch runtime, activations)"
        )
        parts = [
            ("weights", "weights", "C0"),
            ("kv_cache", "KV cache", "C1"),
            ("other", other_name, "0.7"),
        ]
        bottoms = [0.0] * len(splits)
        top = max(sum(sp.values()) for _, sp in splits) or 1.0
        for key, name, color in parts:
            heights = [sp[key] for _, sp in splits]
            ax.bar(
                xs, heights, bottom=bottoms, color=color, label=name, width=0.6, edgecolor="white"
            )
            for x, h, b in zip(xs, heights, bottoms, strict=True):
                if h > 0.06 * top:
                    ax.text(
                        x,
                        b + h / 2,
                        f"{h:.2f}",
                        ha="center",
                        va="center",
                        fontsize=10,
                        color="white" if key != "other" else "black",
                    )
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        for x, b in zip(xs, bottoms, strict=True):
            ax.text(x, b + 0.01 * top, f"{b:.2f} GiB", ha="center", va="bottom", fontsize=10)
        budget_drawn = False
        for x, (c, _) in zip(xs, splits, strict=True):
            budget = c["result"].get("memory_budget_gib")
            # On CPU the budget is the KV cap's bookkeeping, not a device size: GPU only.
            if on_gpu and budget is not None and c["engine"] == "pagoda" and budget <= 1.3 * top:
                ax.hlines(
                    budget,
                    x - 0.36,
                    x + 0.36,
                    colors="black",
                    linestyles="dashed",
                    label=None if budget_drawn else "engine memory budget",
                )
                budget_drawn = True
        ax.set_xticks(list(xs))
        ax.set_xticklabels([_wrap(c["label"]) for c, _ in splits], fontsize=10)
        ax.set_ylabel("GiB")
        what = "peak reserved + non-torch" if device.startswith("cuda") else "peak RSS"
        _title(
            ax,
            fig,
            f"Memory split per configuration — {device}",
            f"(other = {what} − weights − KV cache)",
        )
        ax.set_ylim(0, top * 1.12)
        ax.legend(
            loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=9, frameon=False
        )
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        p = out_dir / "memory_split.png"
        fig.savefig(p)
        plt.close(fig)
        paths.append(str(p))

    # KV cache capacity in tokens
    kv = [(c, c["values"].get("kv_tokens")) for c in configs if c["engine"] == "pagoda"]
    kv = [(c, v) for c, v in kv if v]
    if kv:
        fig, ax = plt.subplots(figsize=(max(6.5, 2.2 * len(kv) + 2), 5.2), dpi=120)
        xs = range(len(kv))
        vals = [v for _, v in kv]
        ax.bar(xs, vals, color=[f"C{i}" for i in range(len(kv))], width=0.6)
        for x, (c, v) in zip(xs, kv, strict=True):
            r = c["ratios"].get("kv_tokens")
            extra = f"\n({r:.2f}×)" if r is not None and c["label"] != report["reference"] else ""
            conc = c["values"].get("max_concurrency")
            conc_s = f"\n{conc:.1f} seqs of {s['max_model_len']}" if conc else ""
            ax.text(
                x,
                v * 1.01,
                f"{int(v):,} tokens{extra}{conc_s}",
                ha="center",
                va="bottom",
                fontsize=10,
            )
        ax.set_xticks(list(xs))
        ax.set_xticklabels([_wrap(c["label"]) for c, _ in kv], fontsize=10)
        ax.set_ylabel("KV cache capacity (tokens)")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        title = [f"KV cache capacity — {device}"]
        if device.startswith("cuda"):
            title.append(f"gpu_memory_utilization={s['gpu_memory_utilization']}")
        else:
            title.append("(CPU: sized for max_num_seqs full-length sequences, at most 1 GiB)")
        _title(ax, fig, *title)
        ax.set_ylim(0, max(vals) * 1.3)
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        p = out_dir / "kv_tokens.png"
        fig.savefig(p)
        plt.close(fig)
        paths.append(str(p))

    # load time: weights load and the whole engine start-up, side by side per configuration
    loads = [
        (c, c["values"].get("load_s"), c["values"].get("startup_s"))
        for c in configs
        if c["values"].get("load_s") is not None
    ]
    if loads:
        fig, ax = plt.subplots(figsize=(max(6.5, 2.2 * len(loads) + 2), 5.2), dpi=120)
        width = 0.38
        top = max(max(lo, st or 0.0) for _, lo, st in loads) or 1.0
        for x, (_, lo, st) in enumerate(loads):
            for dx, v, color, name in (
                (-width / 2, lo, "C0", "weights load"),
                (width / 2, st, "C2", "engine start-up, total"),
            ):
                if v is None:
                    continue
                ax.bar(x + dx, v, width, color=color, label=name if x == 0 else None)
                ax.text(x + dx, v + 0.01 * top, f"{v:.2f} s", ha="center", va="bottom", fontsize=9)
        ax.set_xticks(list(range(len(loads))))
        ax.set_xticklabels([_wrap(c["label"]) for c, _, _ in loads], fontsize=10)
        ax.set_ylabel("seconds")
        ax.set_ylim(0, top * 1.2)
        ax.legend(loc="upper left", fontsize=9, framealpha=0.9)
        ax.grid(True, axis="y", alpha=0.3)
        _title(
            ax,
            fig,
            f"Load time — {device}",
            "(start-up: the whole LLM(...) construction, load included)",
        )
        fig.tight_layout()
        p = out_dir / "load_time.png"
        fig.savefig(p)
        plt.close(fig)
        paths.append(str(p))
    return paths


def write_report(report: dict[str, Any], out_dir: Path, plots: bool = True) -> str:
    """report.json, PNG plots and report.md in `out_dir`; returns the Markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        report["plots"] = [Path(p).name for p in write_plots(report, out_dir)] if plots else []
        report.pop("plots_skipped", None)
    except ImportError as e:
        # A GPU box without matplotlib still gets its table and JSON; the plots can be drawn
        # later from report.json with `python -m pagoda.bench.compare_report DIR`.
        report["plots"] = []
        report["plots_skipped"] = f"{e}; run `python -m pagoda.bench.compare_report {out_dir}`"
    md = render_markdown(report)
    (out_dir / "report.md").write_text(md, encoding="utf-8")
    (out_dir / "report.json").write_text(
        json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8"
    )
    return md


def main(argv: list[str] | None = None) -> int:
    """Re-render report.md and the plots of a finished run from its report.json."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("out_dir", help="a `pagoda compare --out` directory")
    ns = p.parse_args(argv)
    out_dir = Path(ns.out_dir)
    report = json.loads((out_dir / "report.json").read_text(encoding="utf-8"))
    write_report(report, out_dir)
    print(f"wrote {out_dir / 'report.md'} and {', '.join(report['plots']) or 'no plots'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
