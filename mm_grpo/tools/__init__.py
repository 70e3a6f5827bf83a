"""Command-line tools above the library: the tiny demo models and data, text and feature precomputation."""
