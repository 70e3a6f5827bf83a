"""bench/compositional_breakdown.py runs the demo's evaluation on the shipped pipeline and prints
the breakdown of `mm_grpo.rewards.compositional.breakdown`."""
import re

from bench.compositional_breakdown import EXAMPLES, main
from mm_grpo.rewards import compositional
from mm_grpo.rewards.compositional import breakdown
from tests.fixtures import parallel_1proc  # noqa: F401  (tears down the parallel state that main sets up)


def test_breakdown_of_the_shipped_pipeline(tmp_path, capsys, monkeypatch, parallel_1proc):
    for name in ("PIPELINE_DIR", "PROMPT_FILE", "EVAL_PROMPT_FILE"):  # main sets them; restored afterwards
        monkeypatch.setenv(name, f"{EXAMPLES}/tiny_shapes")
    seen = {}

    def spy(images, prompts):
        seen.update(images=images, prompts=prompts, result=breakdown(images, prompts))
        return seen["result"]

    monkeypatch.setattr(compositional, "breakdown", spy)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle above a blue square\ntwo green triangles\n")
    main(["--prompts", str(prompts)])
    out = capsys.readouterr().out
    assert "8 images of" in out  # 2 prompts x 4 fixed noises
    assert seen["images"].shape == (8, 3, 64, 64)
    assert seen["prompts"] == ["a red circle above a blue square"] * 4 + ["two green triangles"] * 4
    printed = {name: (float(rate), int(n)) for name, rate, n in
               re.findall(r"^  (.+?)\s+([01]\.\d{3})  \(of (\d+)\)$", out, re.M)}
    assert printed == {name: (round(rate, 3), n) for name, (rate, n) in seen["result"].items()}
    assert printed["atom: relation"][1] == printed["accuracy: count"][1] == 4
