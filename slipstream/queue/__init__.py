"""TransferQueue: producers put whole groups, consumers lease and ack them (design.md §3)."""
