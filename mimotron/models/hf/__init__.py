"""Hugging Face model families rebuilt as mimotron modules, and their weight loading.

Each family module (``clip``, ``whisper``, ...) holds our own ``nn.Module`` that computes
exactly what the ``transformers`` implementation of the same config computes, with
layers keyed by global index (pipeline-splittable) and names the TP plans know.
"""
