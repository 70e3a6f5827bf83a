"""Checkpoint converters behind the `mm-convert` command (MindSpeed-MM style)."""
from converters.flux import FluxConverter

__all__ = ["FluxConverter"]
