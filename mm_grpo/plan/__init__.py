"""`mm-grpo plan`: per-rank memory and seconds per iteration of a layout (see formulas.py)."""
