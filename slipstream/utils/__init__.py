"""Small utilities shared by every role."""
