"""Demos that run through the same code as a real job (``make demo-llava``)."""
