"""File-system helpers every floor may use: atomic writes (temporary path, then rename), run locks, JSON files."""
