"""Wan2.1 text-to-video."""
