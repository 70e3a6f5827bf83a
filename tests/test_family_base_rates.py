"""bench/family_base_rates.py samples the shipped pipeline per prompt and prints each family's
accuracy from the compositional reward's scores."""
import re

from bench.family_base_rates import EXAMPLES, family_key, main
from mm_grpo.data.shapes import PromptSpec
from mm_grpo.rewards import compositional
from tests.fixtures import parallel_1proc  # noqa: F401  (tears down the parallel state that main sets up)


def test_family_keys():
    keys = [family_key(PromptSpec.parse(c)) for c in ("a red circle", "three blue squares", "a red circle and a "
                                                      "blue square", "a red circle to the left of a blue square")]
    assert keys == ["single", "count 3", "pair", "relation left of"]


def test_table_of_the_shipped_pipeline(tmp_path, capsys, monkeypatch, parallel_1proc):
    for name in ("PIPELINE_DIR", "PROMPT_FILE", "EVAL_PROMPT_FILE"):  # main sets them; restored afterwards
        monkeypatch.setenv(name, f"{EXAMPLES}/tiny_shapes")
    calls = []

    def spy(images, prompts):
        calls.append((list(prompts), compositional.Scores(*real(images, prompts))))
        return calls[-1][1]

    real = compositional.score
    monkeypatch.setattr(compositional, "score", spy)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle and a blue square\nthree green triangles\na yellow square and a red circle\n")
    main(["--noises", "2", "--no-singles", "--prompts", str(prompts)])
    out = capsys.readouterr().out
    seen, scores = calls[-1]  # the bench's own call (the evaluation's reward scores too)
    assert seen == [p for p in prompts.read_text().splitlines() for _ in range(2)]  # prompt-major, 2 noises
    rows = {m[0]: m[1:] for m in re.findall(r"^\| (\w[\w ]*?) \| p\.txt \| (\d+) \| (\d+) \| ([\d.]+) \|", out, re.M)}
    acc = scores.accuracy.tolist()
    assert rows["pair"] == ("2", "4", f"{sum(acc[0:2] + acc[4:6]) / 4:.3f}")
    assert rows["count 3"] == ("1", "2", f"{sum(acc[2:4]) / 2:.3f}")
