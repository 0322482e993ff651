"""Record the engine calls an SDK rollout makes, and replay them directly (the P1/P2 baseline).

The baseline for loop overhead is "the same engine calls made directly": every episode's calls in
order, episodes concurrently, through the same HTTP client, with no env, template, parser or
ledger work in between. Each call is replayed with its recorded ``input_ids`` and sampling
params. The engine returns the same tokens again, so it does the same work
(the same prefix-cache hits included): each recorded call carries a ``sampling_seed``, and
:func:`replay` counts the calls whose output still differed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass

import aiohttp

from agentrl.engines.base import Engine, GenerateOutput
from agentrl.engines.http import SGLangEngine


@dataclass
class Call:
    input_ids: list[int]
    sampling: dict
    output_ids: list[int]


class RecordingEngine(Engine):
    """Wraps an engine and records every call per episode key.

    Each call gets its own ``sampling_seed`` (the embedded engine then draws from a per-request
    RNG), so replaying it returns the same tokens and the engine repeats exactly the same work.
    """

    def __init__(self, inner: Engine):
        self.inner = inner
        self.calls: dict[str, list[Call]] = defaultdict(list)
        self._seed = 0

    async def generate(self, input_ids, sampling_params, *, key=None) -> GenerateOutput:
        self._seed += 1
        sampling_params = dataclasses.replace(sampling_params, sampling_seed=self._seed)
        out = await self.inner.generate(input_ids, sampling_params, key=key)
        self.calls[key or "?"].append(Call(list(input_ids), sampling_params.to_json(), list(out.output_ids)))
        return out

    async def health(self) -> bool:
        return await self.inner.health()


async def replay(url: str, calls: dict[str, list[Call]], concurrency: int) -> tuple[float, int, int]:
    """Replay ``calls`` against ``url`` (episodes concurrent, calls in order).

    Returns (seconds, outputs that differed from the recording, output tokens generated).
    """
    engine = SGLangEngine(url)
    sem = asyncio.Semaphore(concurrency)
    differing = tokens = 0

    async def episode(seq: list[Call]) -> None:
        nonlocal differing, tokens
        async with sem:
            for c in seq:
                payload = {"input_ids": c.input_ids, "sampling_params": c.sampling, "return_logprob": True}
                body = await _post(engine, url + "/generate", payload)
                out_ids = GenerateOutput.from_sglang(body).output_ids
                differing += out_ids != c.output_ids
                tokens += len(out_ids)

    t = time.perf_counter()
    await asyncio.gather(*(episode(s) for s in calls.values()))
    dt = time.perf_counter() - t
    await engine.close()
    return dt, differing, tokens


async def _post(engine: SGLangEngine, url: str, payload: dict) -> dict:
    """One replayed call, resent when the server closed a pooled keep-alive connection as it was reused (aiohttp's
    ``ServerDisconnectedError`` / ``ClientOSError``): the SDK's client retries those too, so the baseline does."""
    for attempt in range(4):
        try:
            async with engine.session.post(url, json=payload) as resp:
                return await resp.json()
        except aiohttp.ClientConnectionError:
            if attempt == 3:
                raise
    raise AssertionError("unreachable")
