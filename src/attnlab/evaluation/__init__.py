"""Evaluation: metrics (perplexity, accuracy, BLEU/chrF via sacreBLEU, ROUGE via rouge-score, calibration)
and attention analysis (per-head entropy, distance, sinks, redundancy, head pruning)."""
from attnlab.evaluation.metrics import (MetricScore, accuracy, bleu, calibration_bins, chrf,
                                        expected_calibration_error, perplexity, reliability_diagram, rouge)
from attnlab.evaluation.analysis import AttentionAnalysis, analyze, head_mask, plot_analysis, prune_heads

__all__ = ["MetricScore", "accuracy", "bleu", "calibration_bins", "chrf", "expected_calibration_error", "perplexity",
           "reliability_diagram", "rouge", "AttentionAnalysis", "analyze", "head_mask", "plot_analysis", "prune_heads"]
