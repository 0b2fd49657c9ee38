"""Text generation from a trained model: ``mimotron generate`` and its Python API.

:func:`generate` loads a run, checkpoint or export folder and answers one prompt;
:class:`Generator` keeps the model loaded for several. See
:mod:`~mimotron.generate.decode` (decoding with a KV cache), :mod:`~mimotron.generate.
prompt` (the prompt as training saw it) and :mod:`~mimotron.generate.source` (what can
be loaded).
"""

from mimotron.generate.decode import Generation, Generator, Sampling, generate
from mimotron.generate.source import LoadedModel, ModelSource, find_source, load_model

__all__ = ["Generation", "Generator", "LoadedModel", "ModelSource", "Sampling", "find_source",
           "generate", "load_model"]
