"""Model families: one package each (wan/, flux/), above the GRPO core and the shared floors, below
the trainers that build runs from them."""
