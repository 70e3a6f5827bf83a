"""FLUX.1 text-to-image."""
