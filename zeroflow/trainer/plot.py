"""A picture of a run: ``plot.png`` in the run folder, drawn from its ``metrics.jsonl`` (training
loss per logged step from the first, held-out loss at each evaluation, the learning rate,
throughput), redrawn at an evaluation when it is over a minute old, and at the end (``run.plot``). ``python -m zeroflow.trainer.plot RUN_DIR`` draws it again, for
a run that is still going or one trained with the plot off.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PLOT = "plot.png"


def read_series(metrics: Path) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(step, value), ...]}`` of the numeric fields of ``metrics.jsonl``'s step rows."""
    series: dict[str, list[tuple[int, float]]] = {}
    if not metrics.exists():
        return series
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            continue
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                series.setdefault(k, []).append((row["step"], float(v)))
    return series


def write_plot(run_dir: Path, title: str | None = None) -> Path | None:
    """Draw ``run_dir/plot.png`` from ``run_dir/metrics.jsonl``; None when it has no step rows."""
    series = read_series(run_dir / "metrics.jsonl")
    if "loss" not in series:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 3.6), layout="constrained")
    loss_ax, lr_ax, speed_ax = fig.subplots(1, 3)
    loss_ax.plot(*zip(*series["loss"]), label="training loss", color="tab:blue")
    if "eval_loss" in series:
        loss_ax.plot(*zip(*series["eval_loss"]), "o-", label="held-out loss", color="tab:orange")
    loss_ax.set(xlabel="step", ylabel="loss (nats per token)", title="loss")
    loss_ax.legend()
    loss_ax.grid(alpha=0.3)
    if "lr" in series:
        lr_ax.plot(*zip(*series["lr"]), color="tab:purple")
    lr_ax.set(xlabel="step", ylabel="learning rate", title="learning-rate schedule")
    lr_ax.set_ylim(bottom=0)
    lr_ax.grid(alpha=0.3)
    rate = "tokens_per_s" if "tokens_per_s" in series else "steps_per_s"  # FuseMix: steps
    if rate in series:
        speed_ax.plot(*zip(*series[rate]), color="tab:green")
    speed_ax.set(xlabel="step", ylabel=rate.replace("_per_s", " / s"), title="throughput")
    speed_ax.set_ylim(bottom=0)
    speed_ax.grid(alpha=0.3)
    fig.suptitle(title or run_dir.name)
    out = run_dir / PLOT
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(out)  # a viewer never reads a half-written file
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m zeroflow.trainer.plot RUN_DIR", file=sys.stderr)
        return 2
    out = write_plot(Path(args[0]))
    print(out if out else f"{args[0]}: metrics.jsonl has no step rows to plot")
    return 0 if out else 1


if __name__ == "__main__":
    sys.exit(main())
