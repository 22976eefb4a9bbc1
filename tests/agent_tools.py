"""Tools used by the agent-loop tests (importable by worker processes as ``tests.agent_tools``)."""

import asyncio


def add(a: int, b: int) -> int:
    return a + b


def boom() -> str:
    raise ValueError("the tool broke")


async def slow() -> str:
    await asyncio.sleep(30)
    return "never"


def show(path: str, caption: str = "") -> list[dict]:
    """An image tool: the image at ``path`` as a content part (and a caption as a text part)."""
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": path}}]
    return parts + ([{"type": "text", "text": caption}] if caption else [])


def show_pillow(path: str) -> dict:
    """An image tool returning a Pillow image (saved as PNG by the worker)."""
    from PIL import Image

    return {"type": "image", "image": Image.open(path).convert("RGB")}
