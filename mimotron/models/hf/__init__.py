"""Hugging Face checkpoints as mimotron modules: configs, weight names, sharded loading.

Each family module holds our own ``nn.Module`` that computes exactly what the
``transformers`` implementation of the same config computes, with layers keyed by global
index (pipeline-splittable) and names the TP plans know. Only local folders are read
(``config.json`` + safetensors); nothing is downloaded. Language models:
:mod:`mimotron.models.hf.llama` (Llama, Qwen2, Qwen3); encoders:
:mod:`mimotron.models.hf.clip` (CLIP, SigLIP vision towers) and
:mod:`mimotron.models.hf.whisper` (Whisper encoder). All families share one folder
reader (:mod:`mimotron.models.hf.folder`) and one name map, checker, sharded reader and
export path (:mod:`mimotron.models.hf.weights`); each family only states its
:class:`~mimotron.models.hf.weights.WeightMap`. A run config reaches them through
``modules.<m>.hf_path``: :mod:`mimotron.models.hf.resolve` reads a module's family and
sizes at config validation, :mod:`mimotron.models.build` builds and loads it, and
:mod:`mimotron.models.hf.vocab` fills embedding rows past the checkpoint's vocabulary.
"""

from mimotron.models.hf.folder import hf_folder, read_hf_config, tensor_files
from mimotron.models.hf.llama import (
    LLAMA_WEIGHTS,
    SUPPORTED_MODEL_TYPES,
    LlamaFamilySpec,
    build_hf_language_model,
    check_llama_folder,
    load_llama_weights,
)
from mimotron.models.hf.weights import WeightMap, load_hf_weights, to_hf_tensors

__all__ = [
    "LLAMA_WEIGHTS",
    "SUPPORTED_MODEL_TYPES",
    "LlamaFamilySpec",
    "build_hf_language_model",
    "check_llama_folder",
    "hf_folder",
    "load_llama_weights",
    "read_hf_config",
    "load_hf_weights",
    "tensor_files",
    "to_hf_tensors",
    "WeightMap",
]
