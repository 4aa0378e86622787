"""Seeing attention: heatmaps (matplotlib), self-contained HTML views, and the same views inline in a
notebook for any model, called as bertviz's (:func:`head_view`, :func:`model_view`, :func:`neuron_view`)."""
from attnlab.viz.cli import save_pngs
from attnlab.viz.extract import AttentionRecord, extract_attention, extract_from_path, pool_attention
from attnlab.viz.heatmap import save_heatmap
from attnlab.viz.html import render_html, save_html
from attnlab.viz.image import ImageAttentionView, attention_rollout, image_view
from attnlab.viz.neuron import neuron_view
from attnlab.viz.notebook import AttentionView, head_view, model_view

__all__ = ["AttentionRecord", "AttentionView", "ImageAttentionView", "attention_rollout", "extract_attention",
           "extract_from_path", "head_view", "image_view", "model_view", "neuron_view", "pool_attention", "render_html",
           "save_html", "save_heatmap", "save_pngs"]
