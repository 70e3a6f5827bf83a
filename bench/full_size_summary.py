"""The tables of issue 48 from `bench/full_size.sh`'s folder: the per-call anchors (anchors.json), the
eager and the compiled GRPO iteration (grpo.json, grpo_compiled.json), each figure beside what it is
compared with; a figure whose step did not write it reads "not measured".

    python -m bench.full_size_summary runs/full_size          # prints, and writes runs/full_size/summary.md

Reads JSON only (no torch), so it runs in a second after the measurements, or on any machine later.
"""
import json
import math
import sys
from pathlib import Path

ROWS = (("diffusers_bf16", "diffusers `FluxTransformer2DModel`, bf16 weights, eager"),
        ("mm_grpo_base", "mm-grpo eager, the frozen bf16 base alone (diffusers' work)"),
        ("mm_grpo", "mm-grpo eager, as the trainer runs it under --bf16 (LoRA, frozen bf16 base)"),
        ("mm_grpo_compiled", "mm-grpo compiled blocks"),
        ("diffusers_bf16_compiled", "diffusers bf16, `compile_repeated_blocks`"))
COLUMNS = (("forward", "no-grad forward"), ("forward_backward", "forward + backward to the input, recompute"))
MISSING = "not measured"


def load(folder: Path, name: str):
    path = folder / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def seconds_cell(anchors: dict, row: str, column: str) -> str:
    s = anchors.get("seconds", {}).get(row, {}).get(column)
    if s is None:
        return MISSING
    cell = f"{s:.3f} s"
    base = anchors["seconds"].get("diffusers_bf16", {}).get(column)
    if row != "diffusers_bf16" and base:
        cell += f" ({s / base:.2f}x)"
    mfu = anchors.get("mfu", {}).get(row, {}).get(column)
    if mfu:
        cell += f", {mfu:.1%} MFU"
    return cell


def anchors_table(anchors) -> list:
    if not anchors:
        return ["Per-call anchors: " + MISSING + " (no anchors.json)."]
    call = anchors["call"]
    lines = [f"One transformer call at {call['batch']} x {call['height']} px ({call['image_tokens']} image + "
             f"{call['text_tokens']} text tokens), median of {anchors['calls']} after {anchors['warmup']} warm-up "
             f"(for the compiled rows, the call that compiles), one process, {anchors['device_name']} (torch "
             f"{anchors['torch']}, diffusers {anchors['diffusers']}, megatron-core {anchors['megatron_core']}); "
             "ratios against diffusers' eager bf16 call:", "",
             "| | " + " | ".join(title for _, title in COLUMNS) + " |", "|---|---|---|"]
    for row, title in ROWS:
        lines.append(f"| {title} | " + " | ".join(seconds_cell(anchors, row, c) for c, _ in COLUMNS) + " |")
    lines.append("")
    for key, ratio in anchors.get("ratios", {}).items():
        lines.append(f"- {key}: " + ", ".join(f"{c} {ratio[c]:.3f}x" for c, _ in COLUMNS if c in ratio))
    for row in ("mm_grpo_compiled", "diffusers_bf16_compiled"):
        first = anchors.get("calls_s", {}).get(row, {})
        if first:
            lines.append(f"- {row} first calls (compiling): " + ", ".join(
                f"{c} {first[c]['warmup'][0]:.1f} s" for c, _ in COLUMNS if c in first and first[c]["warmup"]))
    if anchors.get("compile"):
        lines.append(f"- compiled how: {json.dumps(anchors['compile'])}")
    peaks = anchors.get("peak_gib", {})
    if peaks:
        lines.append("- peak memory allocated (GiB): " + "; ".join(
            f"{row} " + "/".join(f"{v:.1f}" for v in cols.values()) for row, cols in peaks.items()))
    numerics = anchors.get("bf16_velocity", {})
    if numerics:
        lines.append(f"- bf16 velocity against an fp32 forward of the same weights ({anchors.get('numerics_batch')} "
                     f"samples at {call['height']} px), relative L2: " + ", ".join(
                         f"{k} {v['rel_l2']:.2e} (max |err| / max |v| {v['max_abs_over_max']:.2e}, finite "
                         f"{v['finite']})" for k, v in numerics.items()))
    if anchors.get("errors"):
        lines.append(f"- errors: {json.dumps(anchors['errors'])}")
    return lines


def grpo_cell(result) -> dict:
    """The first size's row of a GRPO run, or {} where none was written."""
    if not result:
        return {}
    rows = [r for k, r in result.get("sizes", {}).items() if k != "out_of_memory"]
    return rows[0] if rows else {}


def fmt(value, spec: str, unit: str = "") -> str:
    return MISSING if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:{spec}}{unit}"


def ratio_range(row: dict) -> str:
    its = row.get("iterations", [])
    if not its:
        return MISSING
    return "; ".join(f"[{it.get('ratio_first_mb_min', math.nan):.6f}, {it.get('ratio_first_mb_max', math.nan):.6f}]"
                     for it in its) + " (warm-up first)"


def grpo_title(result) -> str:
    if not result:
        return "GRPO iteration:"
    size = next((k for k in result.get("sizes", {}) if k != "out_of_memory"), "")
    return (f"GRPO iteration, {result['model']}{' depth ' + str(result['depth']) if result.get('depth') else ''}, "
            f"LoRA {result['lora_rank']}, {size}, G = {result.get('num_generations')}, N = "
            f"{result.get('num_inference_steps')}, {result.get('text_tokens')} text tokens, "
            f"{result.get('device_name')} (one warm-up, then the timed iterations):")


def grpo_table(eager, compiled) -> list:
    rows = {"eager": grpo_cell(eager), "`--compile`": grpo_cell(compiled)}
    lines = [grpo_title(eager or compiled), "",
             "| | " + " | ".join(rows) + " |", "|---|---|---|"]

    def cell(r, fn):  # a step stopped mid-way has its iterations only: their ratios, no summary
        if not r or (r.get("partial") and fn is not ratio_range):
            return MISSING
        return fn(r)

    def line(title, fn):
        lines.append(f"| {title} | " + " | ".join(cell(r, fn) for r in rows.values()) + " |")

    line("iteration", lambda r: f"{r['iteration']:.1f} s (rollout {r['rollout']:.1f}, decode + reward "
                                f"{r['decode_reward']:.1f}, train {r['train']:.1f})")
    line("MFU", lambda r: fmt(r.get("mfu"), ".1%"))
    line("first iteration", lambda r: fmt(r["iterations"][0]["time_total"], ".1f", " s"))
    def peak(r):
        planned = (r.get("plan") or {}).get("peak_bytes_per_rank", math.nan) / 2**30
        return f"{r['peak_allocated_gib']:.1f} GiB (plan {fmt(planned, '.1f', ' GiB')})"
    line("peak allocated (plan)", peak)

    def plan_time(r):
        plan = r.get("plan") or {}
        planned, phases = plan.get("seconds_per_iteration"), plan.get("seconds", {})
        if planned is None:
            return MISSING
        split = (f" (rollout {phases['rollout']:.1f}, train {phases['train']:.1f})"
                 if "rollout" in phases and "train" in phases else "")
        return f"{planned:.1f} s{split}, {planned / r['iteration'] - 1:+.0%} against the measured"
    line("`mm-grpo plan`'s time", plan_time)
    line("PPO ratio, first micro-batch", ratio_range)
    line("all finite", lambda r: str(r.get("all_finite")))
    for name, r in rows.items():
        if r.get("partial"):
            lines.append(f"- {name}: stopped after {len(r['iterations'])} iteration(s): "
                         + ", ".join(f"{it['time_total']:.1f} s" for it in r["iterations"]))
    return lines


def main(argv=None):
    folder = Path((argv or sys.argv[1:] or ["runs/full_size"])[0])
    lines = ["# bench/full_size.sh: " + str(folder), ""]
    lines += anchors_table(load(folder, "anchors.json")) + [""]
    lines += grpo_table(load(folder, "grpo.json"), load(folder, "grpo_compiled.json"))
    smoke = load(folder, "smoke.json")
    lines += ["", "smoke (one block of each kind): " + (
        "ran, errors: " + json.dumps(smoke.get("errors", {})) if smoke else MISSING)]
    text = "\n".join(lines) + "\n"
    (folder / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
