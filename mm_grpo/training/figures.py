"""Figures of a training run (matplotlib, no display): the reward curve and a before/after grid.

Both are written to a temporary file and renamed, so a reader never sees half a PNG.
"""
import os
from typing import Dict, List, Optional

import torch


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    os.replace(tmp, path)
    return path


def reward_curve(history: List[Dict], evaluations: Dict[int, Dict[str, float]], path: str,
                 train_key: str = "reward/mean", eval_keys: Optional[List[str]] = None, smooth: int = 10):
    """Training reward per iteration (raw and a running mean over `smooth` iterations) and the
    held-out evaluations {iteration: stats} as markers."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    values = [(i + 1, h[train_key]) for i, h in enumerate(history) if train_key in h]
    if values:
        its, ys = zip(*values)
        ax.plot(its, ys, color="tab:blue", alpha=0.3, lw=1, label=f"train {train_key}")
        window = [sum(ys[max(0, k - smooth + 1):k + 1]) / len(ys[max(0, k - smooth + 1):k + 1]) for k in range(len(ys))]
        ax.plot(its, window, color="tab:blue", lw=2, label=f"train, mean of {smooth}")
    keys = eval_keys or sorted({k for s in evaluations.values() for k in s if k.startswith("eval/")})
    drawn = []
    for key, color in zip(keys, ("tab:red", "tab:green", "tab:purple", "tab:orange")):
        points = sorted((it, s[key]) for it, s in evaluations.items() if key in s)
        if points and points not in drawn:  # with one reward, eval/reward_mean repeats it
            drawn.append(points)
            ax.plot(*zip(*points), "o--", color=color, label=f"held-out {key[5:]}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


def before_after_grid(prompts: List[str], before: torch.Tensor, after: torch.Tensor, path: str,
                      before_ok: Optional[torch.Tensor] = None, after_ok: Optional[torch.Tensor] = None,
                      columns: int = 8, labels=("before", "after")):
    """One column per prompt (its first sample): the prompt, the image before training (top)
    and after (bottom), framed green / red where `*_ok` says the prompt was met / missed."""
    plt = _pyplot()
    first_sample = {}
    for i, prompt in enumerate(prompts):
        first_sample.setdefault(prompt, i)
    first = list(first_sample.values())[:columns]
    n = len(first)
    fig, axes = plt.subplots(2, n, figsize=(1.6 * n, 3.6), squeeze=False)
    for j, k in enumerate(first):
        for row, (images, ok, label) in enumerate(((before, before_ok, labels[0]), (after, after_ok, labels[1]))):
            ax = axes[row][j]
            ax.imshow(images[k].permute(1, 2, 0).clamp(0, 1).numpy(), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if ok is not None:
                for spine in ax.spines.values():
                    spine.set_edgecolor("tab:green" if ok[k] > 0.5 else "tab:red")
                    spine.set_linewidth(3)
            if j == 0:
                ax.set_ylabel(label)
        axes[0][j].set_title(_wrap(prompts[k]), fontsize=7)
    return _save(fig, path)


def _wrap(text, width=18):
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join(lines + [line])
