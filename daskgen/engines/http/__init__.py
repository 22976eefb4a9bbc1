"""The ``openai`` engine: generation through an SGLang-native or OpenAI-compatible HTTP server.

:mod:`~daskgen.engines.http.engine` is the engine (registered as ``openai``),
:mod:`~daskgen.engines.http.args` its options, :mod:`~daskgen.engines.http.protocol` the wire
protocols (SGLang native, OpenAI completions and chat), :mod:`~daskgen.engines.http.vllm_protocol`
vLLM's token-exact one, :mod:`~daskgen.engines.http.client` the HTTP client and
:mod:`~daskgen.engines.http.server` the managed SGLang server.
"""

from daskgen.engines.http.args import OpenAIArgs
from daskgen.engines.http.engine import OpenAIEngine

__all__ = ["OpenAIArgs", "OpenAIEngine"]
