"""The CPU demo's training compute against the earlier default's, measured side by side.

    python -m bench.demo_compute [--rounds 3 --iters 8 --json out.json]

Runs `bash examples/flux/grpo_flux.sh` as shipped (no accelerator) in two settings, taking turns
round by round on the same machine: the earlier default (200 iterations at micro-batch 8, 16
prompts x G 8) and the shipped default (the script's own ITERS, MBS and G). Both do the same
per-iteration work, 128 images through 16 ODE steps, a quarter of the steps trained, the EMA's and
the reference's forwards; the micro-batch only changes how many rows go through one forward, G how
the 128 images are grouped. Seconds per
iteration = rollout + reward + train as the trainer logs them (EMA update and logging excluded,
the same in both), median over each launch's iterations after the first and over rounds.
Compute = iterations x seconds per iteration; the figure is the shipped default's over the
earlier default's. docs/demo.md.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "flux" / "grpo_flux.sh"
EARLIER_DEFAULT = {"ITERS": 200, "MBS": 8, "G": 8}  # the demo's setting before the micro-batch, iterations, G changed
PHASES = ("time_rollout", "time_reward", "time_train")
SETTINGS = tuple(EARLIER_DEFAULT)  # the script's variables a setting fixes


def shipped_default():
    """ITERS, MBS and G as the script's CPU branch sets them."""
    text = SCRIPT.read_text()
    return {name: int(re.search(rf'{name}="\${{{name}:-(\d+)}}"', text).group(1)) for name in SETTINGS}


def iteration_seconds(log: Path):
    """Rollout + reward + train of each logged training iteration."""
    out = []
    for line in log.read_text().splitlines():
        values = dict(re.findall(r"(time_\w+) ([0-9.eE+-]+)", line))
        if all(p in values for p in PHASES):
            out.append(sum(float(values[p]) for p in PHASES))
    return out


def launch(setting: dict, iters: int, run_dir: Path, port: int):
    env = dict(os.environ, **{k: str(v) for k, v in setting.items()})
    env.update(ITERS=str(iters), LOG_INTERVAL="1", EVAL_SAMPLES="1",
               EVAL_INTERVAL=str(iters), IMAGE_INTERVAL=str(iters), SAVE_INTERVAL=str(iters + 1),
               RUN_DIR=str(run_dir), MASTER_PORT=str(port), MM_GRPO_DEVICE="cpu")
    env.pop("PIPELINE_DIR", None)
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:]
        sys.exit(f"demo_compute: grpo_flux.sh {setting} exited {done.returncode}: {''.join(last)}")
    seconds = iteration_seconds(run_dir / "train.log")
    if len(seconds) != iters:
        sys.exit(f"demo_compute: {run_dir / 'train.log'} logged {len(seconds)} of {iters} iterations")
    return seconds[1:]  # the first warms up


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="launches of each setting, taking turns")
    p.add_argument("--iters", type=int, default=8, help="iterations per launch (the first is not counted)")
    p.add_argument("--port", type=int, default=29650)
    p.add_argument("--json", default=None, help="write the figures here too")
    args = p.parse_args(argv)
    if args.iters < 2:
        sys.exit("demo_compute: --iters must be >= 2 (the first iteration is not counted)")
    settings = {"earlier default": EARLIER_DEFAULT, "shipped default": shipped_default()}
    seconds = {name: [] for name in settings}
    with tempfile.TemporaryDirectory(prefix="demo_compute_") as tmp:
        for r in range(args.rounds):
            for name, s in settings.items():
                run_dir = Path(tmp) / f"{name.replace(' ', '_')}_{r}"
                seconds[name] += launch(s, args.iters, run_dir, args.port)
                print(f"round {r + 1}/{args.rounds} {name}: {statistics.median(seconds[name]):.3f} s per iteration "
                      "so far", flush=True)
    rows = {}
    for name, s in settings.items():
        median = statistics.median(seconds[name])
        rows[name] = dict(s, seconds_per_iteration=median, quartiles=statistics.quantiles(seconds[name], n=4),
                          iterations_timed=len(seconds[name]), compute_s=s["ITERS"] * median)
    ratio = rows["shipped default"]["compute_s"] / rows["earlier default"]["compute_s"]
    print(f"{'setting':16s} {'ITERS':>5s} {'MBS':>4s} {'G':>3s} {'s/iteration [quartiles]':>28s} {'compute, s':>10s}")
    for name, row in rows.items():
        q = row["quartiles"]
        print(f"{name:16s} {row['ITERS']:5d} {row['MBS']:4d} {row['G']:3d} {row['seconds_per_iteration']:11.3f} "
              f"[{q[0]:.3f}, {q[2]:.3f}] {row['compute_s']:10.0f}")
    print(f"compute ratio, shipped / earlier default = {ratio:.3f} "
          f"({args.rounds} rounds x {args.iters - 1} timed iterations per setting, taking turns)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(settings=rows, ratio=ratio), indent=2))


if __name__ == "__main__":
    main()
