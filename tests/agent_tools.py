"""Tools used by the agent-loop tests (importable by worker processes as ``tests.agent_tools``)."""

import asyncio


def add(a: int, b: int) -> int:
    return a + b


def boom() -> str:
    raise ValueError("the tool broke")


async def slow() -> str:
    await asyncio.sleep(30)
    return "never"
