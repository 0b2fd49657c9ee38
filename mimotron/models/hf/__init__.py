"""Hugging Face checkpoints as mimotron modules: configs, weight names, sharded loading.

Each family module holds our own ``nn.Module`` that computes exactly what the
``transformers`` implementation of the same config computes, with layers keyed by global
index (pipeline-splittable) and names the TP plans know. Only local folders are read
(``config.json`` + safetensors); nothing is downloaded. Language models:
:mod:`mimotron.models.hf.llama` (Llama, Qwen2, Qwen3); encoders:
:mod:`mimotron.models.hf.clip` (CLIP, SigLIP vision towers) and
:mod:`mimotron.models.hf.whisper` (Whisper encoder).
"""

from mimotron.models.hf.folder import hf_folder, read_hf_config, tensor_files
from mimotron.models.hf.llama import (
    SUPPORTED_MODEL_TYPES,
    LlamaFamilySpec,
    build_hf_language_model,
    check_llama_folder,
    load_llama_weights,
)
from mimotron.models.hf.llama_names import hf_to_ours, ours_to_hf

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "LlamaFamilySpec",
    "build_hf_language_model",
    "check_llama_folder",
    "hf_folder",
    "hf_to_ours",
    "load_llama_weights",
    "ours_to_hf",
    "read_hf_config",
    "tensor_files",
]
