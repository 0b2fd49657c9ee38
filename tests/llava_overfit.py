"""The shrunk LLaVA demo run that the generation and workflow tests overfit: one rank, the
demo's assets (``mimotron.demo.llava_assets``, :data:`NUM_SAMPLES` samples), a constant
learning rate and one checkpoint at the end of :data:`NUM_ITERS` iterations.
"""

from __future__ import annotations

from pathlib import Path

NUM_ITERS = 50
NUM_SAMPLES = 8  # train_fraction 0.75: samples 0, 2, 3, 4, 5, 7 train


def overfit_toml(root: Path, assets: Path) -> Path:
    """The demo config, shrunk: one rank, 6 training samples, one checkpoint at the end."""
    path = root / "overfit.toml"
    path.write_text(f"""
name = "generate_overfit"
[modules.vision]
kind = "vit"
hf_path = "{assets / 'models' / 'vision'}"
vision_feature_layer = -1
[modules.audio]
kind = "audio"
hf_path = "{assets / 'models' / 'audio'}"
downsample_factor = 16
[modules.language]
kind = "language"
hf_path = "{assets / 'models' / 'language'}"
[data]
dataset = "llava"
path = "{assets / 'data' / 'data.jsonl'}"
tokenizer = "{assets / 'tokenizer'}"
seq_length = 56
train_fraction = 0.75
[train]
iters = {NUM_ITERS}
global_batch_size = 6
micro_batch_size = 6
seed = 1
precision = "fp32"
[optimizer]
lr = 3e-3
min_lr = 3e-3
weight_decay = 0.0
[scheduler]
warmup_iters = 5
decay_style = "constant"
[eval]
interval = 1000
[checkpoint]
interval = {NUM_ITERS}
[log]
dir = "{root / 'run'}"
interval = {NUM_ITERS}
progress = false
""")
    return path
