"""The ``openai`` engine under its registered name; it lives in :mod:`daskgen.engines.http`."""

from daskgen.engines.http import OpenAIArgs, OpenAIEngine

__all__ = ["OpenAIArgs", "OpenAIEngine"]
