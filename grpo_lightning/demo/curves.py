"""The demo's picture: the training reward over optimizer steps, one line per seed, and the held-out
accuracies measured (before and after training), each a point with its standard error: nothing is measured
between them, so no line joins them.

`RewardHistory` records `train/reward` (and the training accuracy and tool calls per sample) after every
training step; `write_curves` draws the runs into one
PNG (matplotlib, the `[plot]` extra: `pip install -e ".[plot]"`) and writes the numbers beside it as JSON,
so that the picture can be checked and redrawn.
"""

from __future__ import annotations

import json
import os

import lightning as L

__all__ = ["RewardHistory", "write_curves"]

REWARD_COLOR = "#1f77b4"  # the reward panel's lines
ACCURACY_COLOR = "#d62728"  # the held-out accuracy panel's lines
FIGURE_INCHES, DPI = (8.0, 6.0), 100


class RewardHistory(L.Callback):
    """`(optimizer step, value)` after each training step that updated the weights: `reward` (`train/reward`),
    `accuracy` (the sampled completions' mean `accuracy_reward`, where it is a reward) and `calls` (tool calls
    per sample, with tools)."""

    SERIES = {
        "reward": "train/reward",
        "accuracy": "train/rewards/accuracy_reward",
        "calls": "train/tools/call_frequency",
    }

    def __init__(self) -> None:
        self.reward: list[tuple[int, float]] = []
        self.accuracy: list[tuple[int, float]] = []
        self.calls: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if getattr(pl_module, "last_rollout", None) is None:
            return
        for name, key in self.SERIES.items():
            value = trainer.callback_metrics.get(key)
            if value is not None:
                getattr(self, name).append((trainer.global_step, float(value)))


def write_curves(path: str, runs: list[dict]) -> str | None:
    """Draw `runs` into the PNG `path` and write their numbers to `<path without .png>.json`.

    Each run is `{"seed": ..., "reward": [(step, reward), ...], "accuracy": [(step, accuracy, se), ...]}`
    (the held-out accuracy before training at step 0, and after it at its last step, with their binomial
    standard errors). Returns `path`, or None
    when matplotlib is not installed (the JSON is written either way)."""
    with open(os.path.splitext(path)[0] + ".json", "w", encoding="utf-8") as f:
        json.dump({"runs": runs}, f, indent=2)
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, (top, bottom) = plt.subplots(2, 1, figsize=FIGURE_INCHES, dpi=DPI, sharex=True)
    for i, run in enumerate(runs):
        shade = 1.0 - 0.5 * i / max(1, len(runs) - 1)  # seeds in shades of each panel's colour
        label = f"seed {run['seed']}"
        if run["reward"]:
            steps, values = zip(*run["reward"], strict=True)
            top.plot(
                steps, values, color=REWARD_COLOR, alpha=shade, linewidth=1.5, marker="o", ms=3, label=label
            )
        if run["accuracy"]:
            steps, values, errors = zip(*run["accuracy"], strict=True)
            percent = [100 * v for v in values]
            bars = [100 * e for e in errors]
            # Points and their error bars only: a line between two evaluations would read as measured.
            bottom.errorbar(
                steps,
                percent,
                yerr=bars,
                fmt="o",
                linestyle="none",
                color=ACCURACY_COLOR,
                alpha=shade,
                capsize=4,
            )
    top.set_ylabel("training reward (mean per step)")
    top.legend(loc="lower right", fontsize="small")
    bottom.set_ylabel("held-out strict accuracy (%, ± SE)")
    bottom.set_xlabel("optimizer step")
    for axes in (top, bottom):
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
