"""A no-op SGLang-compatible engine for measuring loop capacity (P2, P11): answers /generate at once.

Each reply is a fixed short turn ending with the end-of-turn token, with log-probs, in SGLang's
exact response shape; ``GET /count`` says how many ``/generate`` requests it answered. It is a raw
ASGI app under uvicorn, run in its own process so the client being measured does not share its
interpreter. Not a test double: nothing in tests uses it.
"""

from __future__ import annotations

import argparse
import json

import uvicorn


def make_app(turn_ids: list[int]):
    body = json.dumps(
        {
            "text": "ok",
            "output_ids": turn_ids,
            "meta_info": {
                "id": "noop",
                "finish_reason": {"type": "stop", "matched": turn_ids[-1]},
                "prompt_tokens": 0,
                "completion_tokens": len(turn_ids),
                "cached_tokens": 0,
                "weight_version": "default",
                "output_token_logprobs": [[-0.5, t, None] for t in turn_ids],
            },
        }
    ).encode()

    served = {"generate": 0}

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        more = True
        while more:
            msg = await receive()
            more = msg.get("more_body", False)
        if scope["path"] == "/count":  # how many /generate requests this engine answered (P11's balance)
            payload = json.dumps(served).encode()
        elif scope["path"] == "/health":
            payload = b""
        else:
            served["generate"] += scope["path"] == "/generate"
            payload = body
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    return app


def wait_healthy(url: str, attempts: int = 100) -> None:
    """Wait until the engine at ``url`` answers ``/health`` (about 10 s at most)."""
    import time

    import httpx

    for _ in range(attempts):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"the no-op engine at {url} did not answer /health")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--turn-ids", required=True, help="comma-separated output ids (last = end-of-turn token)")
    a = p.parse_args()
    ids = [int(x) for x in a.turn_ids.split(",")]
    uvicorn.run(make_app(ids), host="127.0.0.1", port=a.port, log_level="warning", access_log=False)
