"""What every family's planner shares (`mm-grpo plan`: per-rank memory and seconds per iteration of a
layout): the shared formulas (formulas.py), devices, the rewards' sizes and flags. Each
family's own formulas and time calibration are its `plan.py` and `calibration.py` (mm_grpo/families/<name>/)."""
