"""sweep.png: per workload, time against kv for each batch size (uniform rows): ours, FlashInfer's
best configuration and the bandwidth limit (bytes / measured copy bandwidth). sweep_x.png: x =
FlashInfer's best / ours of every row, grouped by KV-length distribution. Graph-replay times
(eager times where a run has none, e.g. smoke data). Needs matplotlib."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FormatStrFormatter, NullLocator  # noqa: E402


def _series(grouped: dict, workload: str, bs: int, copy_gbs) -> dict:
    out = {"kv": [], "ours": [], "fi": [], "limit": []}
    for (dist, wl, b, kv), recs in grouped.items():
        ours = recs.get("ours")
        if dist != "uniform" or wl != workload or b != bs or not ours or ours["status"] != "ok":
            continue
        key = "graph_us" if ours.get("graph_us") else "eager_us"
        fi = [r[key] for impl, r in recs.items() if impl.startswith("fi_") and r.get(key)]
        out["kv"].append(kv)
        out["ours"].append(ours[key])
        out["fi"].append(min(fi) if fi else float("nan"))
        out["limit"].append(ours["bytes"] / copy_gbs / 1e3 if copy_gbs else float("nan"))
    order = sorted(range(len(out["kv"])), key=lambda i: out["kv"][i])
    return {k: [v[i] for i in order] for k, v in out.items()}


def plot(header: dict, grouped: dict, path) -> None:
    uniform = [key[1:] for key in grouped if key[0] == "uniform"]
    if not uniform:
        return
    workloads = list(dict.fromkeys(wl for wl, _, _ in uniform))
    batches = sorted({bs for _, bs, _ in uniform})
    kvs = sorted({kv for _, _, kv in uniform})
    cols = 5
    rows = -(-len(workloads) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.4 * rows), squeeze=False)
    colors = plt.cm.viridis([i / max(1, len(batches) - 1) for i in range(len(batches))])
    for ax, wl in zip(axes.flat, workloads):
        for bs, color in zip(batches, colors):
            s = _series(grouped, wl, bs, header.get("copy_gbs"))
            if not s["kv"]:
                continue
            ax.plot(s["kv"], s["ours"], "o-", color=color, label=f"bs {bs}")
            ax.plot(s["kv"], s["fi"], "x--", color=color)
            ax.plot(s["kv"], s["limit"], ":", color=color)
        ax.set(title=wl, yscale="log", xlabel="kv tokens", ylabel="us")
        ax.set_xscale("log", base=2)
        ax.set_xticks(kvs, [f"{k // 1024}k" if k >= 1024 else str(k) for k in kvs])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(workloads):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=8, ncol=len(batches),
               title="o- ours   x-- FlashInfer best   : bytes / copy bandwidth", title_fontsize=8)
    fig.suptitle(f"{header.get('device')}: ours vs FlashInfer {header.get('flashinfer') or '-'} "
                 f"(graph replay; dotted = bytes / {header.get('copy_gbs') or '-'} GB/s copy)")
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=72)
    plt.close(fig)


def plot_x(header: dict, rows: dict, path) -> None:
    """``rows``: ``sweep_report.x_rows`` (``{dist: [(label, x graph, x eager)]}``); one point per
    row (graph, else eager), the distributions side by side, the line at 1.0 (above: ours faster)."""
    fig, ax = plt.subplots(figsize=(max(8, 0.18 * sum(map(len, rows.values()))), 4.5))
    x0, ticks = 0, []
    for i, (dist, items) in enumerate(rows.items()):
        xs = [g if g is not None else e for _, g, e in items]
        idx = [x0 + j for j, v in enumerate(xs) if v is not None]
        ax.plot(idx, [v for v in xs if v is not None], "o", color=plt.cm.tab10(i % 10), label=dist)
        ticks.append((x0 + (len(items) - 1) / 2, f"{dist} ({len(items)})"))
        x0 += len(items) + 2
        if i < len(rows) - 1:
            ax.axvline(x0 - 1.5, color="grey", lw=0.5)
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xticks([t for t, _ in ticks], [name for _, name in ticks])
    ax.set(ylabel="x = FlashInfer best / ours", yscale="log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))   # 1.05, not 1.1 twice
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.set_title(f"{header.get('device')}: x per row by KV-length distribution\n(graph replay; above 1: ours faster)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
