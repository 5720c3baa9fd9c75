"""The trainer: `python -m train` (see docs/training.md)."""
