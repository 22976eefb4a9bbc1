"""The ``openai`` engine: generation through an SGLang-native or OpenAI-compatible HTTP server.

:mod:`~daskgen.engines.openai.engine` is the engine (registered as ``openai``),
:mod:`~daskgen.engines.openai.args` its options, :mod:`~daskgen.engines.openai.protocol` the wire
protocols (SGLang native, OpenAI completions and chat), :mod:`~daskgen.engines.openai.vllm_protocol`
vLLM's token-exact one, :mod:`~daskgen.engines.openai.client` the HTTP client and
:mod:`~daskgen.engines.openai.server` the managed SGLang server.
"""

from daskgen.engines.openai.args import OpenAIArgs
from daskgen.engines.openai.engine import OpenAIEngine

__all__ = ["OpenAIArgs", "OpenAIEngine"]
