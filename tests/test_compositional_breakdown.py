"""bench/compositional_breakdown.py runs the demo's evaluation on the shipped pipeline and prints
the breakdown of `mm_grpo.rewards.compositional.breakdown`."""
import re

from bench.compositional_breakdown import EXAMPLES, main
from tests.fixtures import parallel_1proc  # noqa: F401  (tears down the parallel state that main sets up)


def test_breakdown_of_the_shipped_pipeline(tmp_path, capsys, monkeypatch, parallel_1proc):
    for name in ("PIPELINE_DIR", "PROMPT_FILE", "EVAL_PROMPT_FILE"):  # main sets them; restored afterwards
        monkeypatch.setenv(name, f"{EXAMPLES}/tiny_shapes")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle above a blue square\ntwo green triangles\n")
    main(["--prompts", str(prompts)])
    out = capsys.readouterr().out
    assert "8 images of" in out  # 2 prompts x 4 fixed noises
    rates = dict(re.findall(r"^  (.+?)\s+([01]\.\d{3})  \(of \d+\)$", out, re.M))
    assert {"atom: present", "atom: relation", "accuracy: count", "two objects: 2 named drawn"} <= set(rates)
    drawn = [float(rates[f"two objects: {n} named drawn"]) for n in range(3)]
    assert abs(sum(drawn) - 1) < 1e-9
