"""The ``transformers`` engine: a Hugging Face causal LM with continuous batching, in the worker process.

:mod:`~daskgen.engines.transformers.engine` is the engine, :mod:`~daskgen.engines.transformers.args`
its options, :mod:`~daskgen.engines.transformers.sampler` the seeded sampler and
:mod:`~daskgen.engines.transformers.backend` the model and manager loading.  Importing this
package does not import torch or transformers.
"""

from daskgen.engines.transformers.args import TransformersArgs
from daskgen.engines.transformers.engine import TransformersEngine

__all__ = ["TransformersArgs", "TransformersEngine"]
