"""Agent loops, tools, reward functions and prompt data; imports no other role (design.md §2).

data.py        verl-format parquet/jsonl datasets, checked at load time; the resumable PromptSource
datagen.py     `slipstream data make`: verifiable synthetic datasets (arithmetic, countdown)
protocol.py    what an agent loop needs from an inference server (token ids in, token ids out)
base.py        the AgentLoop interface and its output; registry.py maps `agent.name` to a loop
single_turn.py, tool_agent.py   the loops; chat.py renders template tokens; tool_parser.py reads calls
external.py    the loop that runs users' own agent harnesses through gateway/ (an OpenAI-compatible endpoint
               per episode that records exact tokens); examples/ holds a harness built on the openai client
tools/         python (sandboxed) and calculator; rewards/  reward functions and their process pool
"""
