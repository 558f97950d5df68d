"""The PNG chart of a ``kvdb demo`` run (matplotlib, Agg backend: no display needed).

Top: per-call time to first token without and with kvdb. Bottom: each call's prompt tokens,
split by where they came from: kvdb's device / host / disk tier, or recomputed.
"""

from __future__ import annotations

from pathlib import Path


def write_chart(calls: list[dict], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [c["node"] for c in calls]
    x = list(range(len(calls)))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8.0, 0.42 * len(calls)), 7.5), sharex=True)
    w = 0.4
    top.bar([i - w / 2 for i in x], [c["ttft_without_s"] * 1e3 for c in calls], w, label="without kvdb (full prefill)",
            color="#bbbbbb")
    top.bar([i + w / 2 for i in x], [c["ttft_with_s"] * 1e3 for c in calls], w, label="with kvdb (restore + suffix)",
            color="#1f77b4")
    top.set_ylabel("time to first token (ms)")
    top.set_title("kvdb demo: agent workflow on a random-weight Llama (CPU)")
    top.legend(loc="upper left")
    parts = [("device_tokens", "device tier", "#2ca02c"), ("host_tokens", "host tier", "#ff7f0e"),
             ("disk_tokens", "disk tier", "#9467bd")]
    base = [0] * len(calls)
    for key, label, color in parts:
        vals = [c[key] for c in calls]
        bottom.bar(x, vals, 0.8, bottom=base, label=label, color=color)
        base = [b + v for b, v in zip(base, vals)]
    recomputed = [c["prompt_tokens"] - c["cached_tokens"] for c in calls]
    bottom.bar(x, recomputed, 0.8, bottom=base, label="recomputed", color="#d62728")
    bottom.set_ylabel("prompt tokens")
    bottom.legend(loc="upper left", ncol=4)
    bottom.set_xticks(x)
    bottom.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
