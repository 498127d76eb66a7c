"""Run metrics: JSONL always, TensorBoard and W&B when installed and asked for, and a reward-curve
PNG at the end. The progress bar is the node daemon's, drawn from the JSONL (`miles.console`).

Design decisions:
- JSONL is the source of truth (`metrics.jsonl`, one object per step or eval, each with `step`,
  `version` and `time_s`); the other sinks are optional mirrors that never fail the run: a sink
  that cannot start is reported once and skipped.
- The PNG is drawn from the JSONL, so it can be redrawn later (`python -m miles.rl.logger RUN_DIR`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: str | Path, cfg, total_steps: int, run_name: str = "miles",
                 resume: bool = False):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cfg, self.t0 = cfg, time.monotonic()
        self.path = self.dir / "metrics.jsonl"
        self.file = open(self.path, "a" if resume else "w") if cfg.jsonl else None
        self.tb = self.wandb = None
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.dir / "tensorboard"))
            except Exception as e:
                print(f"[logger] tensorboard unavailable ({e}); skipping it", flush=True)
        if cfg.wandb:
            try:
                import wandb
                self.wandb = wandb.init(project=cfg.wandb_project, name=run_name, dir=str(self.dir))
            except Exception as e:
                print(f"[logger] wandb unavailable ({e}); skipping it", flush=True)

    def log(self, kind: str, step: int, metrics: dict, **extra) -> None:
        record = {"kind": kind, "step": step, "time_s": round(time.monotonic() - self.t0, 3),
                  **extra, **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}}
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.tb is not None:
            for k, v in numeric.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log({**numeric, "step": step})

    def close(self, plot: bool = True) -> Path | None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        return plot_rewards(self.dir) if plot else None


def plot_rewards(run_dir: str | Path) -> Path | None:
    """reward_curve.png: the sampled training reward of each step and the held-out evaluations
    (pass@1, or the mean reward where an evaluation has none), labelled with how they sampled."""
    run_dir = Path(run_dir)
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    train = [(r["step"], r["rollout/reward"]) for r in rows if r["kind"] == "train" and "rollout/reward" in r]
    key = "eval/pass@1" if any("eval/pass@1" in r for r in rows if r["kind"] == "eval") else "eval/reward"
    evals = [(r["step"], r[key]) for r in rows if r["kind"] == "eval" and key in r]
    if not train and not evals:
        return None
    held_out = f"held-out {key.removeprefix('eval/')} ({_eval_sampling(run_dir)})"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train batch reward (kept groups, sampled)", alpha=0.7)
    if evals:
        ax.plot(*zip(*evals), "o-", label=held_out, linewidth=2)
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(run_dir.name)
    out = run_dir / "reward_curve.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _eval_sampling(run_dir: Path) -> str:
    """How the evaluations sampled, from the run's resolved recipe ("greedy", "T=1.0, 4 per prompt")."""
    resolved = sorted(run_dir.glob("recipe.resolved*.json"))
    if not resolved:
        return "eval"
    cfg = json.loads(resolved[0].read_text()).get("eval", {})
    temperature, n = cfg.get("temperature", 0.0), cfg.get("samples_per_prompt", 1)
    return "greedy" if not temperature else f"T={temperature:g}, {n} per prompt"


if __name__ == "__main__":
    print(plot_rewards(sys.argv[1]))
