"""Hugging Face checkpoints as mimotron modules: configs, weight names, sharded loading.

Each family module holds our own ``nn.Module`` that computes exactly what the
``transformers`` implementation of the same config computes, with layers keyed by global
index (pipeline-splittable) and names the TP plans know. Only local folders are read
(``config.json`` + safetensors); nothing is downloaded. Language models:
:mod:`mimotron.models.hf.llama` (Llama, Qwen2, Qwen3); encoders:
:mod:`mimotron.models.hf.clip` (CLIP, SigLIP vision towers) and
:mod:`mimotron.models.hf.whisper` (Whisper encoder). All families share one folder
reader (:mod:`mimotron.config.hf_folder`) and one name map, checker, sharded reader and
export path (:mod:`mimotron.models.hf.weights`); each family only states its
:class:`~mimotron.models.hf.weights.WeightMap`. A run config reaches them through
``modules.<m>.hf_path``: :mod:`mimotron.config.hf_resolve` reads a module's family and
sizes at config validation (through the model-free readers of
:mod:`mimotron.config.hf_specs`), :mod:`mimotron.models.build` builds and loads it, and
:mod:`mimotron.models.hf.vocab` fills embedding rows past the checkpoint's vocabulary.

This package imports none of its submodules: config validation runs in the launcher of
``mimotron train``, which reads config.json but must not pay for the models (and DTensor
behind them). Import what you need from the submodule that defines it.
"""
