"""The embedded inference engine: continuous batching on PyTorch behind SGLang's HTTP API.

``LocalEngine`` generates in-process; ``build_app(engine)`` wraps it in a FastAPI app with SGLang's
native endpoints (``/generate``, ``/update_weights_from_disk``, ...) and the OpenAI-compatible ones;
``serve(checkpoint, port=...)`` runs that app with uvicorn (``agentrl serve``).
"""

from agentrl.engines.local.engine import EngineFault, InvalidRequestError, LocalEngine
from agentrl.engines.local.server import build_app, serve

__all__ = ["EngineFault", "InvalidRequestError", "LocalEngine", "build_app", "serve"]
