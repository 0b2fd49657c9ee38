"""The fake-device dry run: one rank of a layout, real modules, real steps, no device.

:func:`dry_run` proves on a CPU-only machine that a rank's training step keeps every
tensor on its accelerator. For one rank of the layout it

1. initialises the ``fake`` process-group backend (no peers; every collective and
   point-to-point transfer returns at once, data untouched) for the layout's world size;
2. runs the library's own set-up, :func:`~mimotron.training.loop.setup_mimo`, with the
   runtime device set to the stand-in accelerator (:func:`mimotron.runtime.
   fake_accelerator`: ``meta`` on a CPU-only build, where ``FakeTensorMode`` cannot run
   ops on fake ``cuda`` tensors). Modules are built and initialised on the host as in a
   real run and moved to the device, which on ``meta`` keeps shapes only;
3. under ``FakeTensorMode`` and the :class:`~mimotron.dryrun.tracker.DeviceTracker`,
   runs real training steps (:func:`~mimotron.training.step.train_step`: forward,
   backward, gradient finalisation, optimizer step), one evaluation step and the
   checkpoint state dict. Micro-batches come from the run's own data iterators, on the
   host, as in training; the step moves them.

Any op that mixes devices raises :class:`~mimotron.dryrun.tracker.DeviceMixError`
naming each operand's origin. Host reads are stood in and counted per step
(:class:`StepReport`).

DTensor prices redistributions by devices per host, which the ``meta`` device has no
module for; the dry run answers 1 for it (:func:`_meta_mesh`). Hugging Face weights are
not read (:func:`_without_hf_weights`); nothing else is patched.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _disable_current_modes

from mimotron.checkpoint.state import build_save_state
from mimotron.config.schema import MimoConfig
from mimotron.data import build_datasets
from mimotron.data.llava import LlavaTask
from mimotron.data.run_data import build_tokenizer
from mimotron.dryrun.tracker import DataKey, DeviceTracker, PeerData, Wire
from mimotron.parallel.layout import Layout, check_layout
from mimotron.pipeline.actions import pipeline_positions
from mimotron.runtime import Runtime, fake_accelerator, fake_backend, forget_dtensor_plans
from mimotron.training import model_setup
from mimotron.training.data_provider import Microbatch
from mimotron.training.evaluate import evaluate as run_evaluation
from mimotron.training.language_step import LanguageStep, default_forward_step
from mimotron.training.loop import setup_mimo, train_steps, valid_steps
from mimotron.training.step import build_step_run, module_parts, train_step


@dataclass
class StepReport:
    """What one dry-run phase (a training step, evaluation) did on the host.

    Attributes:
        host_reads: device-to-host reads of computed values, by name (a
            :mod:`mimotron.host_sync` name, or ``unnamed at <file:line>``); each is one
            sync on an accelerator, stood in by a fixed value here.
        data_syncs: data-dependent ops on device copies of host data (boolean indexing,
            ``nonzero``, counts read back), by site: answered from the host values, and
            each a sync on an accelerator too.
        host_tensors: host tensors of more than one element the phase created, by op
            and site (a factory call without ``device=``).
    """

    host_reads: dict[str, int] = field(default_factory=dict)
    data_syncs: dict[str, int] = field(default_factory=dict)
    host_tensors: dict[str, int] = field(default_factory=dict)

    @property
    def num_host_reads(self) -> int:
        """Reads of computed values (``host_reads``), all names together."""
        return sum(self.host_reads.values())

    @property
    def num_syncs(self) -> int:
        """Every device-to-host sync: reads of computed values and of host data."""
        return self.num_host_reads + sum(self.data_syncs.values())


@dataclass
class DryRunReport:
    """The result of :func:`dry_run` for one rank."""

    rank: int
    world_size: int
    device: str
    modules: list[str]
    steps: list[StepReport]
    evaluation: StepReport | None
    checkpoint_devices: dict[str, int]
    """Tensors of the checkpoint state dict, by device type."""
    loss_dicts: list[dict[str, float]]
    """Each step's ``loss_dict`` (built from stand-in values: shapes, not numbers)."""

    def format(self) -> str:
        """A few lines for ``mimotron plan --dry-run``."""
        lines = [f"dry run of rank {self.rank} of {self.world_size} on fake {self.device}: "
                 f"modules {', '.join(self.modules) or '(none)'}: no device mix"]
        phases = [(f"step {i + 1}", s) for i, s in enumerate(self.steps)]
        if self.evaluation is not None:
            phases.append(("evaluation", self.evaluation))
        for label, rep in phases:
            lines.append(f"  {label}: {rep.num_syncs} host syncs ({rep.num_host_reads} reads "
                         f"of computed values, {rep.num_syncs - rep.num_host_reads} of data)")
            lines += [f"    {n} x {what}" for what, n in sorted(rep.host_reads.items())]
            lines += [f"    {n} x data: {what}" for what, n in sorted(rep.data_syncs.items())]
            lines += [f"    {n} x host tensor: {what}"
                      for what, n in sorted(rep.host_tensors.items())]
        lines.append(f"  checkpoint state dict tensors by device: {self.checkpoint_devices}")
        return "\n".join(lines)


def dry_run(cfg: MimoConfig, ranks: Sequence[int] | None = None, *, steps: int = 2,
            evaluate: bool = True, checkpoint: bool = True,
            observers: Mapping[int, StepObserver] | None = None,
            device: torch.device | None = None) -> list[DryRunReport]:
    """Run ranks of ``cfg``'s layout on a fake accelerator, one after the other.

    Ranks run in pipeline order (encoders before the language model, stage by stage),
    each with its own fake default process group, created and destroyed here (so none
    may exist). What a rank receives (a shape header, rows broadcast by its TP leader)
    is what a rank run before it sent (:class:`~mimotron.dryrun.tracker.Wire`); a rank
    that reads a message from a rank not in ``ranks`` fails, naming it.

    Args:
        cfg: the run config (not modified; checkpoints are neither loaded nor saved).
        ranks: the global ranks to run (None: every rank of the layout).
        steps: training steps per rank (two: the second sees the optimizer state).
        evaluate: run one evaluation step after the training steps.
        checkpoint: build the checkpoint state dict at the end.
        observers: per rank, a memory observer entered around its set-up and each
            training step (:class:`~mimotron.dryrun.memory_peak.PeakObserver`).
        device: the fake device the ranks compute on (``None``: the accelerator,
            :func:`~mimotron.runtime.fake_accelerator`). ``cpu`` runs fake CPU tensors,
            which autocast and SDPA's fused kernels treat as real ones (for memory
            measurement on a CPU-only build); device mixes cannot be seen then.

    Returns:
        One report per rank, in the order run.

    Raises:
        ValueError: a rank outside the layout, or a default process group exists.
        DeviceMixError: an op mixed devices (the message names the operands' origins).
        DryRunError: the step did something the dry run cannot stand in for.
    """
    cfg = copy.deepcopy(cfg)
    cfg.checkpoint.load = "none"  # a dry run never reads weights
    layout = check_layout(cfg)
    world = layout.world_size
    chosen = list(range(world)) if ranks is None else list(ranks)
    bad = [r for r in chosen if not 0 <= r < world]
    if bad:
        raise ValueError(f"ranks={bad!r} are invalid: the layout has ranks 0..{world - 1}")
    if dist.is_initialized():
        raise ValueError("dry_run needs no default process group (it creates a fake one)")
    positions = pipeline_positions(layout)

    def order(rank: int) -> tuple[int, int]:
        # A rank's latest position: a colocated rank holding a language stage runs
        # after the stages before it (its encoders all stand at position 0).
        return (max(positions[(r.module, r.pp)].index for r in layout.roles(rank)), rank)

    wire, peers = Wire(), PeerBatches(cfg, layout)  # shared by the ranks run in turn
    observers = observers or {}
    device = device or fake_accelerator()
    return [_run_one(cfg, rank, world, (wire, peers), steps, evaluate, checkpoint,
                     observers.get(rank), device)
            for rank in sorted(set(chosen), key=order)]


def _run_one(cfg: MimoConfig, rank: int, world: int, shared: tuple[Wire, PeerBatches],
             steps: int, evaluate: bool, checkpoint: bool, observer: StepObserver | None,
             device: torch.device) -> DryRunReport:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    forget_dtensor_plans()  # an earlier dry run's plans hold its destroyed groups
    dist.init_process_group(fake_backend(), store=FakeStore(), rank=rank, world_size=world)
    try:
        return _run_rank(cfg, Runtime(rank, world, rank, device, "fake"), shared,
                         steps, evaluate, checkpoint, observer)
    finally:
        gc.collect()  # the rank's model and meshes (reference cycles) go before its group
        dist.destroy_process_group()


def _run_rank(cfg: MimoConfig, runtime: Runtime, shared: tuple[Wire, PeerBatches],
              steps: int, evaluate: bool, checkpoint: bool,
              observer: StepObserver | None = None) -> DryRunReport:
    wire, peers = shared
    watch = observer or _NoObserver()
    with _meta_mesh(), _without_hf_weights():
        with watch.setup():
            run = setup_mimo(cfg, runtime)
        tracker = DeviceTracker(runtime.device, wire)
        _name_parameters(tracker, run.model)
        language = LanguageStep(default_forward_step)
        step_run = build_step_run(run.model, run.optimizer, run.schedulers, run.global_state,
                                  run.infra, run.communicator, language)
        reports, losses = [], []
        # One fake mode for the run (its tensors live across phases); host data is
        # collated outside it, as the loader does, so batches arrive as real host tensors.
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        for s in range(steps):
            batches = _named(tracker, next(run.train_data_iterator), "step")
            tracker.peers = peers.train(s)
            tracker.reset_counts()
            with fake, tracker, watch.step(run.model, torch_optimizers(run.optimizer)):
                loss, *_ = train_step(step_run, batches)
            losses.append(loss)
            reports.append(_snapshot(tracker))
        evaluation = None
        if evaluate and run.valid_data_iterator is not None:
            valid = [_named(tracker, mbs, "evaluation")
                     for mbs in itertools.islice(run.valid_data_iterator(), 1)]
            tracker.peers = peers.evaluation()
            tracker.reset_counts()
            with fake, tracker:
                run_evaluation(language, iter(valid), run.model, run.communicator, run.infra,
                               cfg.train.precision, runtime.device,
                               encoder_batching=cfg.train.encoder_batching)
            evaluation = _snapshot(tracker)
        devices: dict[str, int] = {}
        if checkpoint:
            with fake, tracker:
                state = build_save_state(run.model, run.optimizer, run.schedulers,
                                         run.global_state, run.infra)
            devices = _devices(state)
    if run.data_reader is not None:
        run.data_reader.close()
    return DryRunReport(runtime.rank, runtime.world_size, str(runtime.device),
                        sorted(module_parts(run.model)), reports, evaluation, devices,
                        losses)


class StepObserver(Protocol):
    """What the dry run enters around a rank's set-up and each of its training steps: a
    memory observer (:class:`~mimotron.dryrun.memory_peak.PeakObserver`)."""

    def setup(self) -> contextlib.AbstractContextManager[None]:
        """Entered around the rank's set-up."""
        ...

    def step(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]
             ) -> contextlib.AbstractContextManager[None]:
        """Entered around one training step, inside the dry run's fake mode."""
        ...


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The ``torch.optim`` optimizers of a run's :class:`~mimotron.optim.mimo_optimizer.
    MimoOptimizer`, one per trained module."""
    infos = getattr(optimizer, "module_infos", {})
    return [i.optimizer for i in infos.values() if i.optimizer is not None]


class _NoObserver:
    """A rank without a memory observer: both phases untouched."""

    def setup(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def step(self, model: torch.nn.Module, optimizers: Any
             ) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@contextlib.contextmanager
def _meta_mesh() -> Iterator[None]:
    """DTensor's cost model asks ``torch.<device type>`` for devices per host; ``meta``
    has no such module, so the dry run answers 1 for it (and defers otherwise)."""
    from torch.distributed.device_mesh import _mesh_resources

    env = type(_mesh_resources)
    original = env.num_devices_per_host

    def per_host(device_type: str) -> int:
        return 1 if device_type == "meta" else original(device_type)

    with mock.patch.object(env, "num_devices_per_host", staticmethod(per_host)):
        yield


@contextlib.contextmanager
def _without_hf_weights() -> Iterator[None]:
    """A dry run reads no weights: an ``hf_path`` module keeps its fake device's empty
    shards (shapes only), so a folder with config.json alone is enough to dry-run it."""

    with mock.patch.object(model_setup, "load_hf_module", lambda cfg, name, part: part):
        yield


def _name_parameters(tracker: DeviceTracker, model: torch.nn.Module) -> None:
    for name, param in model.named_parameters():
        tracker.name(param, f"parameter {name}")
        if isinstance(param, DTensor):
            tracker.name(param.to_local(), f"parameter {name} (local shard)")


def _named(tracker: DeviceTracker, microbatches: list[Microbatch], phase: str
           ) -> list[Microbatch]:
    """Register each micro-batch tensor's origin (``<phase> micro-batch j, m['key']``)."""
    for j, mb in enumerate(microbatches):
        for module, batch in mb.items():
            for key, value in batch.items():
                if isinstance(value, torch.Tensor):
                    tracker.name(value, f"{phase} micro-batch {j}, {module}[{key!r}] (host)")
                    tracker.name_data(value, (j, module, key))
    return microbatches


class PeerBatches:
    """Every rank's host micro-batches of a colocated layout, built as each rank's data
    provider builds them, on demand (a dry run of one rank still gathers every rank's
    presence masks in the colocated bridge).

    Args:
        cfg: the run config.
        layout: its layout; split layouts gather no batch data across ranks (``None``
            peers: a gather assumes every member holds data like the running rank's).
    """

    def __init__(self, cfg: MimoConfig, layout: Layout) -> None:
        self.cfg, self.layout = cfg, layout
        self._tasks: tuple[Any, Any] | None = None
        self._train: dict[int, tuple[Iterator[list[Microbatch]], list[list[Microbatch]]]] = {}
        self._valid: dict[int, list[Microbatch]] = {}

    def _data(self) -> tuple[Any, Any]:
        if self._tasks is None:
            train_task, valid_task = build_datasets(self.cfg, build_tokenizer(self.cfg))
            for task in (train_task, valid_task):  # the gathers read presence masks only
                if isinstance(task, LlavaTask):
                    task.dataset.restrict_loading({"text"})
            self._tasks = train_task, valid_task
        return self._tasks

    def train(self, step: int) -> PeerData | None:
        """The peers of training step ``step`` (0-based), or ``None`` (split layouts)."""
        if not self.layout.colocated:
            return None

        def value(rank: int, key: DataKey) -> torch.Tensor | None:
            with _disable_current_modes():  # host data, built outside the fake mode
                if rank not in self._train:
                    task = self._data()[0]
                    self._train[rank] = (train_steps(self.cfg, self.layout, rank, task,
                                                     task.stream(self.cfg.train.seed), 0), [])
                source, built = self._train[rank]
                while len(built) <= step:
                    built.append(next(source))
            return _lookup(built[step], key)

        return value

    def evaluation(self) -> PeerData | None:
        """The peers of the first evaluation step, or ``None`` (split layouts)."""
        if not self.layout.colocated:
            return None

        def value(rank: int, key: DataKey) -> torch.Tensor | None:
            if rank not in self._valid:
                with _disable_current_modes():
                    steps = valid_steps(self.cfg, self.layout, rank, self._data()[1])()
                    self._valid[rank] = next(iter(steps))
            return _lookup(self._valid[rank], key)

        return value


def _lookup(microbatches: list[Microbatch], key: DataKey) -> torch.Tensor | None:
    j, module, name = key
    value = microbatches[j].get(module, {}).get(name) if j < len(microbatches) else None
    return value if isinstance(value, torch.Tensor) else None


def _snapshot(tracker: DeviceTracker) -> StepReport:
    return StepReport(dict(tracker.reads), dict(tracker.data_syncs),
                      dict(tracker.host_tensors))


def _devices(state: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in state.values():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            out[local.device.type] = out.get(local.device.type, 0) + 1
    return out
