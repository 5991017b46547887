"""The checkpoint engine: bucketed, pipelined weight pushes from trainer to inference servers."""
