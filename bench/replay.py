"""Record the engine calls an SDK rollout makes, and replay them directly (the P1/P2 baseline).

The baseline for loop overhead is "the same engine calls made directly": every episode's calls in
order, episodes concurrently, through the same HTTP client, with no env, template, parser or
ledger work in between. Replayed calls pin ``max_new_tokens`` to the recorded output length with
``ignore_eos`` so the engine does exactly the same work as in the SDK run.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from agentrl.engines.base import Engine, GenerateOutput, SamplingParams
from agentrl.engines.http import SGLangEngine


class RecordingEngine(Engine):
    """Wraps an engine and records (input_ids, output length) per episode key."""

    def __init__(self, inner: Engine):
        self.inner = inner
        self.calls: dict[str, list[tuple[list[int], int]]] = defaultdict(list)

    async def generate(self, input_ids, sampling_params, *, key=None) -> GenerateOutput:
        out = await self.inner.generate(input_ids, sampling_params, key=key)
        self.calls[key or "?"].append((list(input_ids), len(out.output_ids)))
        return out

    async def health(self) -> bool:
        return await self.inner.health()


async def replay(url: str, calls: dict[str, list[tuple[list[int], int]]], concurrency: int) -> float:
    """Seconds to replay ``calls`` against ``url``: episodes concurrent, each episode's calls in order."""
    engine = SGLangEngine(url)
    sem = asyncio.Semaphore(concurrency)

    async def episode(seq: list[tuple[list[int], int]]) -> None:
        async with sem:
            for ids, n in seq:
                sp = SamplingParams(max_new_tokens=max(n, 1), temperature=1.0)
                payload_sp = sp.to_json() | {"ignore_eos": True}
                resp = await engine._client.post("/generate", json={"input_ids": ids, "sampling_params": payload_sp,
                                                                    "return_logprob": True})
                GenerateOutput.from_sglang(resp.json())

    t = time.perf_counter()
    await asyncio.gather(*(episode(s) for s in calls.values()))
    dt = time.perf_counter() - t
    await engine.close()
    return dt
