"""Seeing attention: heatmaps (matplotlib) and self-contained HTML views."""
