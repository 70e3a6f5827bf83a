"""JSON files read with one-line errors that name the file (configs, checkpoint indexes)."""
import json
import os


def load_json(path: str, what: str):
    """The parsed file; FileNotFoundError / ValueError naming `what` and `path` otherwise."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} not found: {path}")
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{what} {path} is not valid JSON: {e}") from None
