"""The pretraining loss curve: `plots/pretrain.csv` (DVC's plot of the stage: step, train and
val loss, learning rate, and train_s: the seconds of optimizer steps before the row's step, for
curves against wall time, evaluations not counted) and its PNG for MLflow. matplotlib is
imported only when drawing, and a machine without it (a bare GPU image) still gets the CSV."""

from __future__ import annotations

import csv
import os
from pathlib import Path

from gptforge.io import atomic_file


def write_plot_csv(path: str | os.PathLike, history: list[dict]) -> None:
    with atomic_file(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "train_loss", "val_loss", "lr", "train_s"])
        writer.writeheader()
        for row in history:
            writer.writerow({k: row.get(k, "") for k in writer.fieldnames})


def plot_losses(history: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # a bare GPU box: no plot, the CSV has the numbers
        return None
    train = [(r["step"], r["train_loss"]) for r in history if "train_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r and not r.get("whole_split")]
    whole = [(r["step"], r["val_loss"]) for r in history if r.get("whole_split")]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train", linewidth=0.8)
    if val:
        ax.plot(*zip(*val), "o-", label="val (first eval_steps batches)", markersize=3)
    if whole:
        ax.plot(*zip(*whole), "*", label=f"val, whole split: {whole[-1][1]:.3f}", markersize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
