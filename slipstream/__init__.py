"""Slipstream: fully asynchronous, streaming reinforcement learning for LLM post-training.

Package map (imports flow one way; see docs/architecture.md):
  queue/       TransferQueue: wire types, codec, server, client
  rollouter/   inference servers (embedded, vLLM, SGLang), clients, balancer, the rollouter
  agents/      agent loops, tools, rewards, data
  trainer/     model engines (FSDP2, Megatron), RL algorithms, the trainer loop
  weightsync/  the checkpoint engine that pushes versioned weights to the servers
  pipeline.py  the single controller; cli.py the `slipstream` command
"""

__version__ = "0.1.0"
