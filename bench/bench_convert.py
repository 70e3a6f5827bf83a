"""Benchmark mm-convert on a synthetic checkpoint with FLUX.1 widths (D = 3072) and a few blocks.

Builds a diffusers transformer folder of random weights, then times, each in its own
process, a plain copy of its bytes (`cp -r`), `hf_to_mm`, `resplit` and `mm_to_hf`. Reports the
conversion time (as the converter prints it, without Python's start-up), throughput, the
ratio to the copy, and the process's peak RSS against the largest tensor and against a
process that only imports the converter. Checks the round trip is bit-exact, then deletes
everything it wrote.

    python bench/bench_convert.py                      # 1 double + 2 single blocks, bf16: 1.3 GB
    python bench/bench_convert.py --double 2 --single 4 --tp 4 --pp-layers "[3,3]"
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from converters.diffusers_io import write_diffusers_folder  # noqa: E402
from mm_grpo.families.flux.checkpoint.reader import expected_full_shapes  # noqa: E402
from mm_grpo.families.flux.transformer.config import FluxConfig  # noqa: E402
from mm_grpo.families.flux.transformer.hf_weights import expected_hf_shapes, open_diffusers_weights  # noqa: E402

GB = 1e9


def build_source(folder, config, dtype):
    """A diffusers folder of random weights, written one tensor at a time."""
    metas = {n: torch.empty(s, dtype=dtype, device="meta") for n, s in expected_hf_shapes(config).items()}
    tensors = ((n, torch.empty(m.shape, dtype=dtype).normal_(0, 0.02)) for n, m in metas.items())
    hf_config = {"_class_name": "FluxTransformer2DModel", **config.to_diffusers_config()}
    os.makedirs(folder)
    write_diffusers_folder(folder, hf_config, metas, tensors, max_shard_size="2GB")
    return sum(m.nbytes for m in metas.values())


def run_child(args):
    """Run a command; (stdout, wall seconds, peak RSS bytes of exactly that process, from wait4)."""
    os.sync()  # start every step without a backlog of dirty pages from the previous one
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=err,
                                env=dict(os.environ, PYTHONWARNINGS="ignore"))
        out = proc.stdout.read().decode()
        _, status, usage = os.wait4(proc.pid, 0)  # not proc.wait(): wait4 also returns the child's rusage
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            err.seek(0)
            raise RuntimeError(f"{' '.join(args)} exited with {proc.returncode}:\n{err.read().decode()[-3000:]}")
    return out, time.perf_counter() - start, usage.ru_maxrss * 1024  # Linux reports KiB


def convert(command, source, target, *extra):
    """(wall s, CPU s) as the converter reports them (no interpreter start-up), and peak RSS."""
    out, _, rss = run_child([sys.executable, "-m", "converters.convert_cli", "FluxConverter", command,
                             "--cfg.source_path", source, "--cfg.target_path", target, *extra])
    wall, cpu = map(float, re.search(r"wrote .* in ([0-9.]+) s \(CPU ([0-9.]+) s\)", out).groups())
    return wall, cpu, rss


def bit_exact(a, b):
    wa, wb = open_diffusers_weights(a, backend="pread"), open_diffusers_weights(b, backend="pread")
    return set(wa) == set(wb) and all(torch.equal(wa[n], wb[n]) for n in wa)


def report(args, config, total, largest, rss_import, rows, exact):
    print(f"synthetic FLUX.1-width checkpoint: D = {config.hidden_size}, {args.double} double + {args.single} "
          f"single blocks, {args.dtype}, {total / GB:.2f} GB, largest tensor {largest / 1e6:.0f} MB; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"peak RSS of a process that only imports the converter: {rss_import / 1e6:.0f} MB")
    print(f"{'step':<42}{'wall s':>8}{'CPU s':>8}{'GB/s':>7}{'x copy':>8}{'peak RSS MB':>12}{'- import':>10}"
          f"{'/ largest':>10}")
    copy_wall = rows[0][1]
    for name, wall, cpu, rss in rows:
        memory = ("", "", "") if rss is None else (
            f"{rss / 1e6:.0f}", f"{(rss - rss_import) / 1e6:.0f}", f"{(rss - rss_import) / largest:.1f}")
        cpu = "" if cpu is None else f"{cpu:.2f}"
        print(f"{name:<42}{wall:>8.2f}{cpu:>8}{total / GB / wall:>7.2f}{wall / copy_wall:>8.1f}"
              f"{memory[0]:>12}{memory[1]:>10}{memory[2]:>10}")
    print(f"round trip hf -> mm -> hf bit-exact: {exact}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--double", type=int, default=1, help="double-stream blocks")
    p.add_argument("--single", type=int, default=2, help="single-stream blocks")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--tp", type=int, default=2, help="hf_to_mm TP size")
    p.add_argument("--pp-layers", default="[1,2]", help="hf_to_mm pp_layers")
    p.add_argument("--resplit-tp", type=int, default=4)
    p.add_argument("--resplit-pp-layers", default="[2,1]")
    p.add_argument("--workdir", default=None, help="where to write (default: a new temp folder, deleted at the end)")
    args = p.parse_args()

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    config = FluxConfig.preset("flux-dev").replace(num_layers=args.double, num_single_layers=args.single)
    work = tempfile.mkdtemp(prefix="bench_convert-", dir=args.workdir)
    try:
        src, mm, mm2, hf, copy = (os.path.join(work, n) for n in ("src", "mm", "mm2", "hf", "copy"))
        total = build_source(src, config, dtype)
        largest = max(torch.Size(s).numel() for s in [*expected_hf_shapes(config).values(),
                                                     *expected_full_shapes(config).values()]) * dtype.itemsize
        _, _, rss_import = run_child([sys.executable, "-c", "import converters.flux"])
        # cp in its own process too: every step then starts the same way (after a sync, in a new process)
        rows = [("plain copy (cp -r)", run_child(["cp", "-r", src, copy])[1], None, None)]
        shutil.rmtree(copy)
        rows.append((f"hf_to_mm (TP {args.tp}, pp_layers {args.pp_layers})", *convert(
            "hf_to_mm", src, mm, "--cfg.target_parallel_config.tp_size", str(args.tp),
            "--cfg.target_parallel_config.pp_layers", args.pp_layers)))
        rows.append((f"resplit (-> TP {args.resplit_tp}, pp_layers {args.resplit_pp_layers})", *convert(
            "resplit", mm, mm2, "--cfg.target_parallel_config.tp_size", str(args.resplit_tp),
            "--cfg.target_parallel_config.pp_layers", args.resplit_pp_layers)))
        shutil.rmtree(mm2)
        rows.append(("mm_to_hf", *convert("mm_to_hf", mm, hf, "--cfg.max_shard_size", "1GB")))
        exact = bit_exact(src, hf)
        report(args, config, total, largest, rss_import, rows, exact)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
