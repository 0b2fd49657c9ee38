"""The run config's sections: one dataclass per TOML table, every field documented.

Each field carries an attribute docstring (a string literal right after it, as in
torchtitan's ``JobConfig``): what it means, its unit, the valid values and how it
interacts with other keys. :mod:`mimotron.config.docs` reads these docstrings to render
docs/configuration.md's configuration table, so they are the one source of the config docs. Fields
with a fixed set of values are typed ``Literal[...]``; the parser
(:func:`mimotron.config.config_from_dict`) rejects any other value, and the tuples
``PRECISIONS``, ``DECAY_STYLES``, ... are derived from those types. The whole run,
:class:`MimoConfig` (the whole run) is here too, so the models can type their arguments
without importing the loader. Loading lives in :mod:`mimotron.config` (which re-exports
every name here) and every check in :mod:`mimotron.config.validation`, above both this module
and the models.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from mimotron.config.lora import LoraConfig
from mimotron.config.run_tables import CheckpointConfig, EvalConfig, LogConfig, ProfileConfig

EncoderKind = Literal["vit", "audio"]
LanguageKind = Literal["language"]
ModuleKind = Literal[EncoderKind, LanguageKind]
Precision = Literal["fp32", "bf16", "fp16"]
DecayStyle = Literal["cosine", "linear", "constant"]
WeightDecayStyle = Literal["constant", "linear", "cosine"]
OptimizerName = Literal["adamw", "adam", "sgd"]
DatasetName = Literal["digits", "mock", "llava"]
Schedule = Literal["1f1b", "no_pipelining"]
FeatureSelectStrategy = Literal["default", "full"]
DownsampleMode = Literal["avg", "stack"]
RouterScore = Literal["softmax", "sigmoid"]
Recompute = Literal["none", "selective", "full"]
FreezePart = Literal["encoder"]
"""The part of a module ``modules.<m>.freeze`` may name besides ``true`` / ``false``."""

ENCODER_KINDS: tuple[str, ...] = get_args(EncoderKind)
LANGUAGE_KINDS: tuple[str, ...] = get_args(LanguageKind)
MODULE_KINDS: tuple[str, ...] = get_args(ModuleKind)
PRECISIONS: tuple[str, ...] = get_args(Precision)
DECAY_STYLES: tuple[str, ...] = get_args(DecayStyle)
WEIGHT_DECAY_STYLES: tuple[str, ...] = get_args(WeightDecayStyle)
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
DATASETS: tuple[str, ...] = get_args(DatasetName)
SCHEDULES: tuple[str, ...] = get_args(Schedule)
RECOMPUTE_MODES: tuple[str, ...] = get_args(Recompute)
FREEZE_PARTS: tuple[str, ...] = get_args(FreezePart)
CHAT_TEMPLATES: tuple[str, ...] = ("chatml", "llama3", "vicuna")
"""Built-in templates ``data.chat_template`` may name (``mimotron/data/chat_templates.py``)."""


@dataclass
class ParallelConfig:
    """Parallel degrees of one module; its ranks are ``[rank_offset, rank_offset+size)``."""

    tensor: int = 1
    """Tensor-parallel degree (>= 1); must divide the module's heads and hidden size."""
    pipeline: int = 1
    """Pipeline-parallel degree (>= 1, at most num_layers).

    Stages split the layers as ``layers_per_stage`` says, else evenly. In a colocated
    layout only the language model may be pipelined (without context parallelism,
    interleaving or ``data.balance_encoders``): every rank runs the encoders on the
    step's micro-batches, then its language stage, then the encoders' backward.
    """
    data: int = 1
    """Data-parallel degree (>= 1); must divide train.micro_batch_size.

    Each replica takes a contiguous slice of every micro-batch. The DP degrees of
    connected modules must divide one another.
    """
    context: int = 1
    """Context-parallel degree of the language model (>= 1; encoders use 1).

    Each CP rank holds seq_length / context positions (a head and a tail chunk, causal
    load balancing); data.seq_length must be a multiple of 2 x context. Colocated and
    non-colocated layouts; dense models only (built-in or a Llama / Qwen2 / Qwen3
    hf_path), not with MoE (num_experts or an MoE hf_path).
    """
    expert: int = 1
    """Expert-parallel degree (>= 1); expert x expert_tensor x pipeline must divide the
    module's ranks.
    """
    expert_tensor: int = 1
    """Expert tensor-parallel degree (>= 1); see ``expert``."""
    rank_offset: int = 0
    """First global rank of the module's block (>= 0).

    Blocks either all coincide (colocated) or are disjoint and tile ``[0, world)``.
    """
    sequence_parallel: bool = False
    """Sequence parallelism (language model only, needs tensor > 1 and data.seq_length
    divisible by tensor): norm regions hold seq / tensor positions per rank. Dense
    models only (built-in or hf_path), not with MoE.
    """
    shard_optimizer: bool = False
    """ZeRO-1: shard the module's optimizer state over its DP group.

    No effect with one DP replica. With tensor > 1 each TP rank shards its own
    parameter shards over its DP group; routed experts (expert, expert_tensor) shard
    their local shards over expt_dp. Per rank under precision fp32: fp32 weights and
    gradients of its shards, Adam state divided by the DP degree (4 + 4 + 8/d bytes per
    parameter). Under bf16 / fp16, as Megatron-Core's distributed optimizer: the
    module's weights are held in 16 bits, gradients accumulate in an fp32 buffer, and
    each rank keeps fp32 master copies of its rows with their Adam state
    (2 + 4 + 12/d bytes); checkpoints store the fp32 masters as the weights.
    """
    fsdp: bool = False
    """FSDP2: shard the module's parameters, gradients and optimizer state over its DP
    group with torch's ``fully_shard`` (each transformer block and each other child a
    unit; with tensor > 1 on a 2-D (dp, tp) mesh; on pipeline stages too).

    For modules whose weights do not fit a rank. No effect with one DP replica; not with
    shard_optimizer, context or sequence parallelism, MoE, freeze, or tied embeddings.
    """
    virtual_pipeline: int = 1
    """Model chunks per pipeline rank (>= 1; > 1 = interleaved 1F1B, needs pipeline > 1).

    The layers are cut into pipeline x virtual_pipeline contiguous chunks and rank r
    holds chunks r, r + pipeline, ... (Megatron's virtual pipeline stages): a smaller
    pipeline bubble for more transfers. Needs the step's micro-batches to be a multiple
    of pipeline, a non-colocated layout and a balanced split (no layers_per_stage);
    not with a Hugging Face MoE model (hf_path).
    """
    layers_per_stage: list[int] = field(default_factory=list)
    """Explicit layers per pipeline stage, e.g. ``[1, 3]``; empty = balanced split.

    When set: one positive count per pipeline stage, summing to num_layers.
    """

    @property
    def size(self) -> int:
        """Number of ranks the module occupies."""
        return self.tensor * self.context * self.data * self.pipeline


@dataclass
class OptimizerConfig:
    """Optimizer settings; every key can be overridden per module."""

    name: OptimizerName = "adamw"
    """Optimizer: ``adamw``, ``adam`` or ``sgd``."""
    lr: float = 1e-3
    """Peak learning rate (> 0), reached at the end of warm-up."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (0 <= min_lr <= lr); scheduler.min_lr overrides it."""
    weight_decay: float = 0.0
    """Weight decay (>= 0) of parameters not matched by ``no_decay``; constant unless
    scheduler.start_weight_decay / end_weight_decay are set.
    """
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam/AdamW ``(beta1, beta2)``, two numbers in [0, 1); ignored by sgd."""
    eps: float = 1e-8
    """Adam/AdamW epsilon (> 0); ignored by sgd."""
    momentum: float = 0.0
    """SGD momentum; only used when name = ``sgd``."""
    clip_grad: float = 1.0
    """Max gradient norm (>= 0; 0 = no clipping), measured as the global norm over all
    modules; a per-module value clips that module against the same global norm with its
    own threshold.
    """
    expert_lr: float | None = None
    """Peak learning rate of the routed experts of MoE layers (> 0; unset = ``lr``). The
    experts follow the module's schedule scaled by ``expert_lr / lr`` (their ``min_lr``
    too), in param groups of their own.
    """
    expert_weight_decay: float | None = None
    """Weight decay of the routed experts (>= 0; unset = ``weight_decay``); not with a
    weight-decay schedule (scheduler.start_weight_decay / end_weight_decay).
    """
    no_decay: list[str] = field(default_factory=lambda: ["norm", "bias"])
    """Parameter-name substrings whose parameters get no weight decay."""
    initial_loss_scale: float = 2.0**16
    """fp16 only: starting dynamic loss scale (> 0); each module keeps its own scaler and
    backward uses the minimum scale over the trainable modules.

    All scalers are updated from the world-wide found-inf flag, so every rank sees the
    same scales.
    """
    min_loss_scale: float = 1.0
    """fp16 only: the dynamic loss scale never drops below this."""
    loss_scale_window: int = 1000
    """fp16 only: consecutive clean steps (>= 1) before the loss scale doubles."""
    hysteresis: int = 2
    """fp16 only: non-finite steps (>= 1) tolerated before the loss scale halves."""


@dataclass
class SchedulerConfig:
    """Learning-rate schedule: linear warm-up then decay to ``optimizer.min_lr``."""

    warmup_iters: int = 0
    """Iterations of linear warm-up from 0 to optimizer.lr (>= 0, at most the decay length)."""
    decay_style: DecayStyle = "cosine"
    """Learning-rate decay after warm-up: ``cosine``, ``linear`` or ``constant``."""
    decay_iters: int = 0
    """Iteration at which the decay reaches min_lr (>= 0); 0 = train.iters."""
    min_lr: float | None = None
    """Final learning rate; unset = optimizer.min_lr. Not a per-module key."""
    start_weight_decay: float | None = None
    """Weight decay at iteration 0; unset (with end_weight_decay unset) = constant
    optimizer.weight_decay.

    If only one of start/end is set, the other is optimizer.weight_decay.
    """
    end_weight_decay: float | None = None
    """Weight decay at the end of the decay; see ``start_weight_decay``."""
    weight_decay_style: WeightDecayStyle = "constant"
    """How weight decay moves from start to end: ``constant``, ``linear`` or ``cosine``.

    Only used when start_weight_decay or end_weight_decay is set.
    """


@dataclass
class ModuleConfig:
    """One module of the model: an encoder with its projection, or the language model."""

    kind: ModuleKind = "language"
    """``vit``, ``audio`` (encoders) or ``language``; a module named ``language`` of kind
    ``language`` is required.

    At most one encoder per modality (image for vit, audio for audio).
    """
    hidden_size: int = 128
    """Transformer hidden size (>= 1, a multiple of num_heads)."""
    num_layers: int = 2
    """Transformer layers (>= 1)."""
    num_heads: int = 4
    """Attention heads (>= 1, dividing hidden_size)."""
    ffn_hidden_size: int = 0
    """SwiGLU inner width; 0 = two thirds of 4 x hidden_size, rounded up to a multiple of 8."""
    projector_hidden_size: int = 0
    """Encoders: width of the MLP projector into the language model; 0 = the language hidden
    size.
    """
    image_size: int = 8
    """vit only: image side in pixels (the digits images are 8 x 8)."""
    patch_size: int = 2
    """vit only: patch side in pixels, dividing image_size; emits (image_size /
    patch_size)^2 tokens.
    """
    in_channels: int = 1
    """vit only: image channels."""
    num_freq_bins: int = 129
    """audio only: frequency bins of the input spectrogram."""
    num_frames: int = 16
    """audio only: spectrogram frames."""
    num_audio_tokens: int = 4
    """audio only: tokens the encoder emits per sample, dividing num_frames."""
    hf_path: str = ""
    """A local Hugging Face folder (``config.json`` + safetensors) to build and load the
    module from; ``""`` = mimotron's own randomly initialised model.

    The family comes from config.json's ``model_type``: ``language`` takes Llama, Qwen2,
    Qwen3, Qwen2-MoE or Qwen3-MoE, ``vit`` CLIP or SigLIP (a vision tower or a full
    model), ``audio`` Whisper.
    The sizes (hidden_size, num_layers, num_heads, ffn_hidden_size and the input shape
    keys) are read from config.json; setting one to another value is an error. Each rank
    reads only its stage's tensors and TP slices; the projector keeps mimotron's init.
    A folder that is not there is an error before launch, never a download.
    """
    vision_feature_layer: int = -2
    """vit with hf_path only: the tower's hidden state fed to the projector, as in LLaVA
    (-1 = last layer, -2 = the one before); later layers are not built.
    """
    vision_feature_select_strategy: FeatureSelectStrategy = "default"
    """vit with hf_path only: ``default`` drops the class token (CLIP), ``full`` keeps every
    token (SigLIP, which has no class token, needs ``full``).
    """
    max_pixels: int = 0
    """vit with a Qwen2.5-VL / Qwen3-VL hf_path only: the largest image area in pixels
    (>= 0; 0 = the folder's processor max_pixels). Images keep their native resolution,
    resized by the processor to fit; each image travels in max_pixels / (patch_size x
    merge_size)^2 token slots, so this bounds memory and transfer sizes.
    """
    downsample_factor: int = 1
    """audio with hf_path only: k consecutive Whisper output frames become one token
    (>= 1, dividing max_source_positions); num_audio_tokens follows.
    """
    downsample_mode: DownsampleMode = "avg"
    """audio with hf_path only: ``avg`` averages the k frames, ``stack`` concatenates them
    (projector input k x hidden_size).
    """
    num_experts: int = 0
    """Routed experts of each mixture-of-experts layer (>= 0); 0 = a dense model (every
    other ``moe_*`` key and top_k are then ignored). Only the ``language`` module, without
    hf_path, takes experts; a Qwen2-MoE / Qwen3-MoE hf_path brings its own MoE layers
    (from config.json) and uses only moe_aux_loss_coeff and moe_z_loss_coeff.

    Routing is dropless (every token reaches its top_k experts, no capacity factor).
    """
    top_k: int = 2
    """Experts each token is routed to (1 <= top_k <= num_experts)."""
    moe_ffn_hidden_size: int = 0
    """Width of each routed expert's SwiGLU; 0 = ffn_hidden_size (or its default)."""
    num_shared_experts: int = 0
    """Always-on shared experts (>= 0), fused into one SwiGLU num_shared_experts x
    moe_ffn_hidden_size wide and added to the routed output (DeepSeek / Qwen2-MoE).
    """
    moe_shared_expert_gate: bool = False
    """Multiply the shared experts' output by sigmoid(Linear(hidden, 1)) (Qwen2-MoE);
    needs num_shared_experts >= 1.
    """
    moe_layer_freq: int | list[int] = 1
    """Which layers are MoE: 1 = every layer, N = layers whose index is a multiple of N,
    or a list of 0/1 with one entry per layer (num_layers entries).
    """
    moe_router_score: RouterScore = "softmax"
    """Router scores: ``softmax`` (Mixtral, Qwen) or ``sigmoid`` (DeepSeek-V3 style) of
    the router logits, in fp32.
    """
    moe_norm_topk_prob: bool = True
    """Renormalise each token's top_k weights to sum to one (Mixtral; Qwen3-MoE's
    norm_topk_prob); false keeps the raw scores (Qwen2-MoE).
    """
    moe_aux_loss_coeff: float = 0.01
    """Weight (>= 0) of the load-balancing loss E x sum_e f_e P_e (1 when balanced),
    computed per sample and MoE layer and weighted by the sample's loss tokens like the
    cross-entropy; logged as moe_aux_loss.
    """
    moe_z_loss_coeff: float = 0.0
    """Weight (>= 0) of the router z-loss mean(logsumexp(logits)^2); 0 = off. Logged as
    moe_z_loss when on.
    """
    freeze: bool | FreezePart = False
    """What of the module does not train: ``false`` (all of it trains), ``true`` (none of
    it: no gradients, no optimizer state, no gradient sync), or, for an encoder,
    ``"encoder"``: its tower (the vision or audio encoder) is frozen and its projector
    trains (LLaVA's stage 1, with ``modules.language.freeze = true``); a Qwen-VL tower's
    projector is its patch mergers. Something must train: a module or a projector.
    """
    recompute: Recompute = "none"
    """Activation recompute of the module's transformer layers: ``none``; ``selective``
    (a layer keeps its matmuls', SDPA's and TP reductions' outputs and runs the rest,
    norms, RoPE, activations, the context-parallel key/value gather, again in backward:
    a third less at Llama-2-7B's shape); ``full`` (a layer keeps only its input
    and runs its whole forward again in backward). Same results, less activation memory
    for more compute: docs/performance.md, "Activation recompute".
    """
    recompute_num_layers: int = 0
    """Layers recomputed (0 <= n <= num_layers): 0 = every layer the rank holds; n = the
    first n layers of each pipeline stage, of each model chunk under virtual_pipeline
    (Megatron's ``block`` method). Needs recompute other than ``none``.
    """
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The module's parallel layout (the ``[modules.<m>.parallel]`` table)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters on the module's linear layers (the ``[modules.<m>.lora]`` table;
    docs/lora.md); with ``rank > 0`` only the adapters train."""
    optimizer: dict[str, Any] = field(default_factory=dict)
    """Per-module overrides: ``[modules.<m>.optimizer]`` overrides any ``[optimizer]`` or
    ``[scheduler]`` key (except ``scheduler.min_lr``) for this module, e.g. ``lr``,
    ``warmup_iters``, ``clip_grad``.

    Keys not given fall back to the global tables. Each module gets its own optimizer
    and schedule built from the result.
    """

    @property
    def is_encoder(self) -> bool:
        """Whether the module is an encoder (any kind but ``language``)."""
        return self.kind in ENCODER_KINDS

    @property
    def is_language(self) -> bool:
        """Whether the module is a language model (``kind = "language"``)."""
        return self.kind in LANGUAGE_KINDS

    # Not config keys (no annotation: not dataclass fields), filled in with the sizes when
    # the module is resolved (mimotron.config.hf_resolve), None until then: hf_path's
    # parsed config.json as (hf_path, dict), which later checks and estimates read
    # instead of the file, and whether its vision tower has a class token (CLIP does,
    # SigLIP not).
    hf_config = None
    hf_class_token = None
    hf_native = None  # NativeVision of a Qwen-VL vision module (config/native_vision.py)

    @property
    def fully_frozen(self) -> bool:
        """Nothing of the module trains (``freeze = true``)."""
        return self.freeze is True

    @property
    def tower_frozen(self) -> bool:
        """The encoder's tower is frozen and its projector trains (``freeze = "encoder"``)."""
        return self.freeze == "encoder"

    @property
    def modality(self) -> str | None:
        """Input modality an encoder consumes (``image`` or ``audio``)."""
        return {"vit": "image", "audio": "audio"}.get(self.kind)

    @property
    def num_output_tokens(self) -> int:
        """Embeddings an encoder emits per sample (placeholders in the text)."""
        if self.kind == "vit" and self.hf_native is not None:
            return int(self.hf_native.max_tokens)  # token slots per image
        if self.kind == "vit":
            patches = (self.image_size // self.patch_size) ** 2
            if self.hf_path and self.vision_feature_select_strategy == "full":
                assert self.hf_class_token is not None, \
                    "a Hugging Face module is resolved (mimotron.config.validation) before use"
                return patches + int(self.hf_class_token)
            return patches
        if self.kind == "audio":
            return self.num_audio_tokens
        return 0


@dataclass
class DataConfig:
    """The training data: which task, how long a sample is, how it is split and mixed."""

    dataset: DatasetName = "digits"
    """``digits`` (sklearn digits images + synthesised DTMF audio), ``mock`` (random
    tensors for tests) or ``llava`` (a LLaVA-format JSON / JSONL file or WebDataset tar
    shards: ``path``, ``tokenizer``).
    """
    seq_length: int = 64
    """Tokens per sample, placeholders included; too small for the prompt and answer is an error."""
    train_fraction: float = 0.8
    """Share of the items in the train split, in (0, 1); the rest is validation.

    Both splits must be non-empty (digits: 0.8 gives 1438 / 359 images). With
    ``valid_path`` set, ``path`` trains in full: the only value is 1.0, its default then.
    """
    p_image: float = 0.3
    """Digits: weight of image-only samples (the four ``p_*`` weights are normalised; >= 0,
    positive sum).
    """
    p_audio: float = 0.2
    """Digits: weight of audio-only samples."""
    p_both: float = 0.4
    """Digits: weight of image + audio samples."""
    p_text: float = 0.1
    """Digits: weight of text-only samples."""
    image_shift: int = 1
    """Digits: largest random image shift in pixels (>= 0), train split only; 0 disables it."""
    mock_num_samples: int = 256
    """Mock: samples in the dataset (>= 2), split by train_fraction."""
    path: str = ""
    """LLaVA: the JSON list or JSONL file of samples, or tar shards in the WebDataset layout
    (a folder of ``*.tar``, one ``.tar``, a glob or a ``shard-{000000..000009}.tar`` range;
    each sample a ``<key>.json`` conversation with its ``<key>.jpg``/``.png``/``.wav``
    members); required with ``dataset = "llava"``.
    """
    valid_path: str = ""
    """LLaVA: a separate validation file (the same format and checks as ``path``); empty =
    validation is the ``train_fraction`` split of ``path``. Its media paths are relative to
    ``root``, or to its own folder when ``root`` is empty.
    """
    root: str = ""
    """LLaVA: folder the image/audio paths are relative to; empty = the folder of ``path``."""
    allow_outside_root: bool = False
    """LLaVA: accept image/audio paths that resolve outside ``root`` (``..``, absolute
    paths, symlinks out of it); when false such a sample is a bad sample.
    """
    tokenizer: str = ""
    """LLaVA: a local Hugging Face tokenizer folder with a chat template; empty = the
    language model's folder (``modules.language.hf_path``), one of the two is required
    with ``dataset = "llava"``. ``<image>`` / ``<audio>`` placeholders are added if missing.
    """
    chat_template: str = ""
    """LLaVA: the chat template conversations are rendered with: empty = the tokenizer's
    own; ``chatml``, ``llama3`` or ``vicuna`` (built in); or a ``.jinja`` file's path.

    The built-ins: ``chatml`` (Qwen2's ChatML, with its default system message),
    ``llama3`` (Llama 3 Instruct's headers and ``<|eot_id|>``) or ``vicuna`` (LLaVA-1.5's
    ``USER: ... ASSISTANT: ...</s>`` format, each reply ended by the tokenizer's eos
    token). The template replaces the tokenizer's own (a base model's tokenizer may have
    none) and is written with the exported tokenizer. A built-in's control tokens must be
    special tokens of the tokenizer.
    """
    skip_bad_samples: bool = False
    """LLaVA: leave bad samples out (counted in the banner and ``skipped_samples`` of the
    metrics) instead of stopping with an error naming the first one.
    """
    num_workers: int = 0
    """Background threads that load training samples ahead of the step (>= 0); 0 loads
    them in the step. The sample order does not depend on it.
    """
    system_prompt: str = ""
    """LLaVA: a system message put first in conversations that have none; empty = none."""
    ignore_keys: list[str] = field(default_factory=list)
    """LLaVA: keys of a sample (or of a conversation turn) that the loader does not read
    and that are accepted anyway (e.g. ``["video", "weight"]``); any other such key makes
    the sample bad, so nothing in the data is dropped silently. The keys read (``id``,
    ``image``, ``audio``, ``conversations`` and a turn's ``from``, ``value``; in the
    ``messages`` layout ``images``, ``audios``, ``messages`` and a turn's ``role``,
    ``content``) cannot be listed.
    """
    allow_large_vocab: bool = False
    """LLaVA: accept a tokenizer whose vocabulary makes the language model's embedding and
    output head more than 100 times the rest of the model and over 100 M parameters
    (refused otherwise, naming the sizes: usually a wrong tokenizer folder).
    """
    index_dir: str = ""
    """LLaVA: folder of the sample indexes (each data file's checked samples: addresses,
    token counts, skipped samples), built once per run before training and reused by
    later runs over the same unchanged file and settings; empty = ``<log.dir>/data_index``.
    Must be shared by all ranks' nodes.
    """
    packing: bool = False
    """Pack several training samples into each row of ``seq_length`` (consecutive samples
    while they fit; a row holds each sample's images and tones); attention stays within
    each sample and positions restart per sample. A global batch is then
    ``global_batch_size`` rows. With ``dataset = "llava"`` the rows are decided from the
    token counts recorded when the file is checked, so every rank packs the same rows.
    Not with an MoE language model (its aux loss is per row).
    """
    balance_tokens: bool = False
    """Deal each global batch's samples (packed rows with ``packing``) to the language
    model's DP replicas and micro-batches by their real tokens, longest first to the
    replica with the fewest so far, instead of in stream order: even tokens per replica
    per step, the same assignment on a resume, the same loss (normalised over the
    global batch's tokens). Every rank then reads the whole global batch. Not with an
    MoE language model (its aux loss is per micro-batch).
    """
    balance_encoders: bool = False
    """Deal each micro-batch's media items (images, videos, spectrograms) to each
    encoder's DP replicas by cost (tokens, plus tokens squared per frame for a
    native-resolution tower), whatever sample they belong to, largest first to the
    replica with the least work so far in the step; the bridge brings each item's rows
    back to the language replica of its sample. Every rank then reads whole
    micro-batches. In a colocated layout pair it with ``train.encoder_batching`` (the
    bridge is a collective per micro-batch; batched, a rank encodes its items of the
    whole step at once). Not into a context-parallel language model.
    """
    max_images_per_sample: int = 1
    """LLaVA: the most images a sample may hold (>= 1); a sample's ``image`` list then
    pairs its k-th path with the k-th ``<image>`` of the conversation. A sample with more
    is a bad sample naming this key. Above 1 every batch carries ``K`` image slots per
    row (images of fixed-size towers only; tar shards keep one image per sample).
    """


@dataclass
class TrainConfig:
    """The training loop: length, batch sizes, seed, precision, schedule, stop rules."""

    iters: int = 100
    """Training iterations (optimizer steps, >= 1)."""
    global_batch_size: int = 32
    """Samples per iteration, a multiple of micro_batch_size; num_microbatches = global / micro."""
    micro_batch_size: int = 8
    """Samples per micro-batch over the whole run (the GLOBAL micro-batch), divisible by
    every module's data degree.

    Each DP replica of a module takes a contiguous micro_batch_size / data slice.
    """
    seed: int = 1234
    """Run seed: parameter init and data (sample content and order)."""
    precision: Precision = "fp32"
    """``fp32``, ``bf16`` or ``fp16``: autocast compute; master weights and optimizer state
    stay fp32.

    Under bf16/fp16 the residual stream, the norms' outputs and the language model's
    pipeline stage links are 16-bit too (see fp32_residual_connection), and each weight
    is cast to 16 bits once per step, not once per micro-batch. fp16 adds dynamic loss
    scaling (the optimizer's loss-scale keys).
    """
    fp32_residual_connection: bool = False
    """bf16/fp16 only: keep the residual stream (and the language model's stage links) in
    fp32, as Megatron's option of the same name; 2 more bytes per hidden value and token
    that a layer keeps for backward. No effect under fp32.
    """
    schedule: Schedule = "1f1b"
    """Pipeline schedule: ``1f1b`` or ``no_pipelining`` (each micro-batch's backward before
    the next forward).
    """
    exit_interval: int = 0
    """Stop (after saving a checkpoint) when the iteration is a multiple of this (>= 0); 0 = off."""
    exit_duration_mins: float = 0.0
    """Stop (after saving a checkpoint) once this many minutes have passed; 0 = off."""
    max_skipped: int = 10
    """Stop after this many consecutive skipped (non-finite) steps (>= 1)."""
    pg_timeout_s: float = 300.0
    """Process-group timeout in seconds (> 0): no rank waits forever on a dead peer."""
    grad_bucket_mb: float = 32.0
    """Upper bound (MiB, > 0) of one data-parallel gradient all-reduce (ZeRO-1: of one
    reduce-scatter and parameter all-gather); consecutive parameters of one dtype share a
    bucket, a larger parameter gets its own.
    """
    overlap_grad_reduce: bool = False
    """Start each gradient bucket's data-parallel all-reduce (ZeRO-1 modules: its
    reduce-scatter) during the last micro-batch's backward, as soon as the bucket is
    complete (in a fixed order on every rank); bit-identical results. Buckets with
    TP-partial (sequence-parallel norm) gradients and expert all-reduce buckets (not
    ZeRO-1) wait for the end of the backward; frozen modules are never reduced.
    """
    overlap_param_gather: bool = False
    """ZeRO-1 modules only launch their parameter all-gather after the optimizer step; it
    lands when the module next runs a forward (or a save, eval or the loop's end reads the
    weights), so it overlaps what comes before: bit-identical results.
    """
    encoder_batching: bool = False
    """Colocated layouts only: each encoder runs the step's micro-batches in one forward
    (concatenated along the batch) and one backward after the last micro-batch's; the
    language model still runs micro-batch by micro-batch. Fewer, larger encoder kernels;
    results equal to rounding; the encoders' activations of every micro-batch are held at
    once (``mimotron plan`` shows it). Refused with a non-colocated layout and with
    fp16 (the one encoder backward would sum the step's gradient in fp16 and overflow).
    """
    frozen_ahead: bool = True
    """Split layouts: a wholly frozen encoder (``freeze = true``) runs every
    micro-batch's forward without autograd, one after another, sending each output when
    done, instead of waiting in 1F1B for gradients it does not use; the language model
    sends it none. The same results; its ranks hold their outputs of the whole step until
    the step's sends complete (``mimotron plan`` counts them). Not with interleaving
    (``virtual_pipeline > 1``) on it or the language model. Colocated layouts run a frozen
    encoder's step ahead with ``encoder_batching`` or a pipelined language model.
    """
    overwrite: bool = False
    """Allow a fresh start over a previous run: its files are moved aside, not clobbered.

    A run starts fresh with checkpoint.load = ``none``, or ``auto`` finding no checkpoint.
    If log.dir then holds a non-empty metrics.jsonl, or checkpoint.dir holds ``latest``
    or ``iter_*`` folders, the run is refused before launch unless this is true; then
    metrics.jsonl, tensorboard/, profile/ and the checkpoints are moved into
    ``<log.dir>/previous-<time>/`` (checkpoints outside log.dir: into
    ``<checkpoint.dir>/previous-<time>/``) and the move is printed.
    """


@dataclass
class MimoConfig:
    """The whole run: model modules with their layouts, data, training, logging."""

    name: str = "mimotron"
    """Run name; outputs go to ``runs/<name>/`` unless log.dir is set."""
    hf_path: str = ""
    """One local Hugging Face vision-language folder (``model_type`` ``llava``) to split
    into modules: ``modules.vision`` (kind ``vit``: the vision tower and its projector)
    and ``modules.language`` (kind ``language``), each loaded from it and laid out by its
    own ``[modules.<m>.parallel]`` table; ``""`` = modules name their own folders.
    """
    modules: dict[str, ModuleConfig] = field(default_factory=dict)
    """The model's modules, one ``[modules.<m>]`` table each, in merge order; ``language``
    is required.
    """
    data: DataConfig = field(default_factory=DataConfig)
    """The ``[data]`` table."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The ``[train]`` table."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The ``[optimizer]`` table (defaults for every module)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """The ``[scheduler]`` table (defaults for every module)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The ``[eval]`` table."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """The ``[checkpoint]`` table."""
    log: LogConfig = field(default_factory=LogConfig)
    """The ``[log]`` table."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """The ``[profile]`` table."""

    # ---- derived values -------------------------------------------------------------
    @property
    def encoder_names(self) -> list[str]:
        """Encoder modules in config order (the order embeddings are merged)."""
        return [n for n, m in self.modules.items() if m.is_encoder]

    @property
    def num_microbatches(self) -> int:
        return self.train.global_batch_size // self.train.micro_batch_size

    @property
    def log_dir(self) -> Path:
        return Path(self.log.dir or f"runs/{self.name}")

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.log_dir / "checkpoints"

    def effective_optimizer(self, module: str) -> OptimizerConfig:
        """``[optimizer]`` with the module's overrides applied."""
        keys = {f.name for f in dataclasses.fields(OptimizerConfig)}
        over = {k: v for k, v in self.modules[module].optimizer.items() if k in keys}
        return dataclasses.replace(self.optimizer, **copy.deepcopy(over))

    def effective_scheduler(self, module: str) -> SchedulerConfig:
        """``[scheduler]`` with the module's overrides applied."""
        keys = {f.name for f in dataclasses.fields(SchedulerConfig)} - {"min_lr"}
        over = {k: v for k, v in self.modules[module].optimizer.items() if k in keys}
        return dataclasses.replace(self.scheduler, **over)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def default_ffn_hidden_size(hidden_size: int, multiple_of: int = 8) -> int:
    """SwiGLU width for ``ffn_hidden_size = 0``: two thirds of ``4 * hidden``, rounded up.

    SwiGLU has three matrices instead of two, so ``8/3 * hidden`` keeps the parameter count
    of a ``4 * hidden`` GELU MLP. Rounding to a multiple of 8 keeps the width divisible by
    every tensor-parallel degree up to 8.

    Args:
        hidden_size: model width.
        multiple_of: the width is rounded up to a multiple of this.

    Returns:
        The feed-forward width.
    """
    width = int(math.ceil(8 * hidden_size / 3))
    return multiple_of * ((width + multiple_of - 1) // multiple_of)
