"""Inference servers and clients, the load balancer and the rollouter (design.md §1, §3)."""
