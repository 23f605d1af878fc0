"""sweep.png: per workload, time against kv for each batch size: ours, FlashInfer's best
configuration and the bandwidth limit (bytes / measured copy bandwidth). Graph-replay
times (eager times where a run has none, e.g. smoke data). Needs matplotlib."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402


def _series(grouped: dict, workload: str, bs: int, copy_gbs) -> dict:
    out = {"kv": [], "ours": [], "fi": [], "limit": []}
    for (wl, b, kv), recs in grouped.items():
        ours = recs.get("ours")
        if wl != workload or b != bs or not ours or ours["status"] != "ok":
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
    workloads = list(dict.fromkeys(wl for wl, _, _ in grouped))
    batches = sorted({bs for _, bs, _ in grouped})
    kvs = sorted({kv for _, _, kv in grouped})
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
