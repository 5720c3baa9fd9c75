"""The trainer: `python -m train` (see README "Training")."""
