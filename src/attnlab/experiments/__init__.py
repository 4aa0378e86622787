"""Runnable experiments: the demo and the classic questions about attention, measured."""
