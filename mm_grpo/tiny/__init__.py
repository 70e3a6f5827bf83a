"""What the tiny pipelines of every family share, knowing no family: the tiny T5 / umT5 text side
(`text.py`: the caption corpus, T5's layout shrunk, T5 tokenizers learnt here so nothing is
downloaded) and the pipeline folders (`pipeline.py`: seeded component weights, the atomic writer).
Each family's tiny builders (mm_grpo/families/<name>/tiny*.py) stand on these."""
