"""Planning a run before it launches: what it needs from its GPUs."""
