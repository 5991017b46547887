"""The trainer: model engines, RL algorithms and the training loop (design.md §3)."""
