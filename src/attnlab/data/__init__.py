"""Datasets, tokenizers and synthetic tasks."""
