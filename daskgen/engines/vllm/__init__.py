"""The ``vllm`` engine: one in-process vLLM ``AsyncLLM`` per Dask worker.

:mod:`~daskgen.engines.vllm.engine` is the engine, :mod:`~daskgen.engines.vllm.args` its
arguments and CPU defaults, :mod:`~daskgen.engines.vllm.mapping` vLLM's request and output
format.  Importing this package does not import vllm.
"""

from daskgen.engines.vllm.engine import VLLMEngine

__all__ = ["VLLMEngine"]
