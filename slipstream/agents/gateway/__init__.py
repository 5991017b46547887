"""The OpenAI-compatible gateway that lets users' own agent harnesses drive the policy (server.py), the
per-episode record of what the model saw and sampled (session.py) and chat-template rendering (render.py)."""

from slipstream.agents.gateway.server import Gateway, GatewayError
from slipstream.agents.gateway.session import Session

__all__ = ["Gateway", "GatewayError", "Session"]
