"""The embedded inference server: engine.py (continuous batching with versioned weights), sampling.py
(per-request warpers), app.py (SGLang-native HTTP routes), openai_api.py (OpenAI routes), schemas.py
(request bodies). `slipstream serve` (rollouter/serve.py) runs it."""

from slipstream.rollouter.embedded.engine import EmbeddedEngine, EngineUnavailable, RequestError

__all__ = ["EmbeddedEngine", "EngineUnavailable", "RequestError"]
