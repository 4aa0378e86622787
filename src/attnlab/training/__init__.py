"""Training: the trainer, optimisers and schedules, losses, checkpoints, torchrun DDP, recipes.

Import the pieces from their modules (nothing here has global state):

- :mod:`~attnlab.training.trainer` — :class:`Trainer` (``fit(resume=...)``), :class:`TrainingDivergedError`;
  :mod:`~attnlab.training.config` — :class:`TrainConfig`.
- :mod:`~attnlab.training.optim` (AdamW / Adafactor with weight-decay groups),
  :mod:`~attnlab.training.schedules` (cosine, noam, constant), :mod:`~attnlab.training.losses`.
- :mod:`~attnlab.training.checkpoint` (atomic, ``weights_only`` loading), :mod:`~attnlab.training.distributed`,
  :mod:`~attnlab.training.reporting` (metrics.jsonl, metrics.json, loss.png),
  :mod:`~attnlab.training.activation_checkpointing`.
- :mod:`~attnlab.training.recipes` — ``run_recipe``, ``evaluate_checkpoint``; the ``attnlab train`` command.
"""
