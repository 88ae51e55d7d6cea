"""Lockstep generation: batches whose membership does not depend on time.

A policy decodes the requests that wait together, and on CPU (and GPU) a row's float results
depend on its batch: a matrix multiply of 1, 3 or 8 rows rounds differently, and left-padding
to a longer neighbour changes the attention sums in the last digits. Which requests wait
together normally depends on when tool calls return, so two runs with the same seed sample
the same tokens but record log-probs (and train weights) that differ by ~1e-6.

:class:`Lockstep` stands between the engine's episodes and the policy. Every episode in
play is counted (:meth:`enter` / :meth:`leave`); a generation request waits until every
counted episode is waiting too, and then the whole wave goes to the policy at once, sorted by
each request's seed (a function of the task, the generation path and the turn). Each wave is
therefore the set of episodes still playing after the previous one, in a fixed order, however
long each tool call took, so the policy sees the same batches in every run and a killed run
resumes bit for bit.

The price: a turn waits for the slowest sibling's tool call before anyone decodes again.

>>> import asyncio
>>> from treerl.agents.policy import GenerationRequest, SamplingParams
>>> class Echo:
...     def __init__(self): self.batches = []
...     async def agenerate(self, request):
...         self.batches.append(request.seed)
...         return request.seed
>>> async def main():
...     policy = Echo()
...     gate = Lockstep(policy)
...     gate.enter(3)
...     async def episode(seed, delay):
...         await asyncio.sleep(delay)  # a tool call of some length
...         try:
...             return await gate.agenerate(GenerationRequest([1], SamplingParams(), seed=seed))
...         finally:
...             gate.leave()
...     results = await asyncio.gather(episode(30, 0.02), episode(10, 0.0), episode(20, 0.01))
...     return results, policy.batches
>>> asyncio.run(main())
([30, 10, 20], [10, 20, 30])
"""

from __future__ import annotations

import asyncio
from typing import Any

from treerl.agents.policy import Generation, GenerationRequest, Policy

__all__ = ["Lockstep"]


class Lockstep:
    """Holds generation requests until every episode in play waits, then releases them in seed order."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.active = 0
        self.waves = 0
        self._waiting: list[tuple[GenerationRequest, asyncio.Future]] = []

    def enter(self, n: int = 1) -> None:
        """``n`` more episodes are in play: waves wait for them."""
        self.active += n

    def leave(self, n: int = 1) -> None:
        """``n`` episodes ended (or will never start): waves no longer wait for them."""
        self.active -= n
        if self.active < 0:
            raise RuntimeError("Lockstep.leave() without a matching enter(): an episode was counted twice.")
        self._release()

    async def agenerate(self, request: GenerationRequest) -> Generation:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((request, future))
        self._release()
        return await future

    def _release(self) -> None:
        if not self._waiting or len(self._waiting) < self.active:
            return
        wave = sorted(self._waiting, key=lambda item: _order(item[0]))
        self._waiting = []
        self.waves += 1
        loop = asyncio.get_running_loop()
        # Tasks start in creation order, so the policy's batcher receives the wave sorted, all
        # in one tick, before its drain runs: the batches are the same in every run.
        for request, future in wave:
            task = loop.create_task(self.policy.agenerate(request))
            task.add_done_callback(lambda t, f=future: _settle(f, t))


def _order(request: GenerationRequest) -> tuple[bool, int, list[int]]:
    # The engine seeds every request from (run seed, task, generation path, turn): unique and
    # the same in every run. Unseeded requests (none from the engine) fall back to their tokens.
    return request.seed is None, request.seed or 0, list(request.prompt_ids)


def _settle(future: asyncio.Future, task: asyncio.Task[Any]) -> None:
    if future.done():  # the waiting episode was cancelled (a timeout): nothing to deliver
        return
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())
