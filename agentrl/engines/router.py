"""Route generate calls over several engines: least outstanding requests, sticky per episode.

Sticky routing sends every turn of an episode to the engine that served its first turn, so that
engine's prefix cache already holds the conversation. When an engine fails (after its own
retries) it is put on a cooldown and the request moves to the least-loaded healthy engine; only
when every engine has failed does the caller see :class:`EngineError`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from agentrl.engines.base import Engine, EngineError, EngineRequestError, GenerateOutput, SamplingParams


async def fan_out(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """Await every call concurrently; once all have finished, raise the first error, if any.

    Unlike a plain ``asyncio.gather``, one failing engine does not leave the others' calls
    unobserved: a ``continue_generation`` still reaches every engine that can take it.
    """
    results = await asyncio.gather(*calls, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class Router(Engine):
    """An :class:`Engine` over several engines (``engines``), each tried at most once per request.

    An engine that failed is tried last until its cooldown ends, then like any other: a server
    restarted on the same URL (``SGLangEngineGroup.check_and_restart``) takes requests again.
    """

    def __init__(self, engines: Sequence[Engine], *, cooldown: float = 10.0, max_sticky_keys: int = 100_000):
        if not engines:
            raise ValueError("Router needs at least one engine")
        self.engines = list(engines)
        self.cooldown = cooldown
        self.outstanding = [0] * len(self.engines)
        self.failed_until = [0.0] * len(self.engines)
        self._sticky: dict[str, int] = {}
        self._max_sticky = max_sticky_keys
        self._context_length: int | None = None

    def _order(self, key: str | None) -> list[int]:
        now = time.monotonic()
        healthy = [i for i in range(len(self.engines)) if self.failed_until[i] <= now]
        cooling = [i for i in range(len(self.engines)) if self.failed_until[i] > now]
        healthy.sort(key=lambda i: self.outstanding[i])
        if key is not None and key in self._sticky and self._sticky[key] in healthy:
            healthy.remove(self._sticky[key])
            healthy.insert(0, self._sticky[key])
        return healthy + sorted(cooling, key=lambda i: self.failed_until[i])

    @property
    def token_exact(self) -> bool:  # type: ignore[override]
        """Token-exact only when every engine behind it is."""
        return all(e.token_exact for e in self.engines)

    @property
    def accepts_images(self) -> bool:  # type: ignore[override]
        """Takes images only when every engine behind it does."""
        return all(e.accepts_images for e in self.engines)

    async def generate(
        self, input_ids: list[int], sampling_params: SamplingParams, *, key: str | None = None
    ) -> GenerateOutput:
        return await self._route(lambda e: e.generate(input_ids, sampling_params, key=key), key)

    async def generate_turn(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        key: str | None = None,
        messages: Sequence[Mapping[str, Any]] = (),
        tools: Sequence[Mapping[str, Any]] = (),
        image_data: Sequence[str] = (),
    ) -> GenerateOutput:
        extra = {"image_data": image_data} if image_data else {}  # engines that predate images never see the key
        return await self._route(
            lambda e: e.generate_turn(input_ids, sampling_params, key=key, messages=messages, tools=tools, **extra),
            key,
        )

    async def _route(self, call: Callable[[Engine], Awaitable[GenerateOutput]], key: str | None) -> GenerateOutput:
        """``call`` on the episode's sticky engine, else the least loaded; the next one when it fails."""
        errors: list[str] = []
        for i in self._order(key):
            self.outstanding[i] += 1
            try:
                out = await call(self.engines[i])
            except EngineRequestError:
                raise  # the request itself is bad; another engine would refuse it too
            except EngineError as exc:
                self.failed_until[i] = time.monotonic() + self.cooldown
                errors.append(str(exc))
                continue
            finally:
                self.outstanding[i] -= 1
            if key is not None:
                if len(self._sticky) >= self._max_sticky:
                    self._sticky.clear()
                self._sticky[key] = i
            return out
        raise EngineError("every engine failed: " + " | ".join(errors))

    def release(self, key: str) -> None:
        """Forget an episode's sticky engine (called when the episode ends)."""
        self._sticky.pop(key, None)

    async def context_length(self) -> int | None:
        """The smallest context length among the engines that report one (asked once: every rollout reads it,
        and the engines serve one model whose length does not change)."""
        if self._context_length is None:
            known = [n for n in [await e.context_length() for e in self.engines] if n]
            self._context_length = min(known) if known else None
        return self._context_length

    async def health(self) -> bool:
        for e in self.engines:
            if await e.health():
                return True
        return False

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        for e in self.engines:
            await e.update_weights_from_disk(model_path, weight_version)

    # Weight sync by broadcast: each engine joins the group with its own rank offset, so
    # ``init_weights_update_group`` is done per engine (``DistributedTransport(router.engines)``);
    # the calls below go to every engine at once (concurrently: they all take part in one broadcast).

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[Any], shapes: list[Any], **kwargs: Any
    ) -> None:
        await asyncio.gather(
            *(e.update_weights_from_distributed(names, dtypes, shapes, **kwargs) for e in self.engines)
        )

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await asyncio.gather(*(e.destroy_weights_update_group(group_name) for e in self.engines))

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await asyncio.gather(*(e.release_memory_occupation(tags) for e in self.engines))

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await asyncio.gather(*(e.resume_memory_occupation(tags) for e in self.engines))

    # Pause around a weight update (see ``agentrl.engines.sglang.paused_for_update``): every engine at once.

    async def pause_generation(self, mode: str = "abort") -> None:
        await fan_out(e.pause_generation(mode) for e in self.engines)

    async def continue_generation(self) -> None:
        await fan_out(e.continue_generation() for e in self.engines)

    async def flush_cache(self) -> None:
        await fan_out(e.flush_cache() for e in self.engines)

    async def close(self) -> None:
        for e in self.engines:
            await e.close()
