"""Seeing attention: heatmaps (matplotlib) and self-contained HTML views."""
from attnlab.viz.cli import save_pngs
from attnlab.viz.extract import AttentionRecord, extract_attention, extract_from_path, pool_attention
from attnlab.viz.heatmap import save_heatmap
from attnlab.viz.html import render_html, save_html

__all__ = ["AttentionRecord", "extract_attention", "extract_from_path", "pool_attention",
           "render_html", "save_html", "save_heatmap", "save_pngs"]
