"""Session set-up shared by every test module.

Multi-rank tests fork their ranks from this process, so whatever is imported or cached
here is inherited for free. Without it every forked rank pays, on its own, for importing
loading the digits, for torch's lazily imported optimizer/compiler
modules (first ``AdamW``), and for DTensor's first dispatch — seconds per rank.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mimotron.forked_ranks import NCCL_CHECK_ENV


def warm_up_imports() -> None:
    """Import and cache, once in the parent, what every forked rank would load itself.

    the digits array (the demo data), torch's lazily imported optimizer
    machinery (``torch._dynamo``, pulled in by the first ``AdamW``), and DTensor.
    """
    import torch.distributed.tensor  # noqa: F401

    from mimotron.data.digits import load_digit_images

    load_digit_images()
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    torch.optim.AdamW([p]).step()


@pytest.fixture(scope="session", autouse=True)
def _warm_imports() -> None:
    torch.set_num_threads(1)
    warm_up_imports()


@pytest.fixture(scope="session", autouse=True)
def _nccl_rules() -> None:
    """Every multi-rank run of the suite is replayed under NCCL's rules after it passes
    on gloo (``mimotron.commcheck``): a deadlock fails the test that ran it."""
    os.environ.setdefault(NCCL_CHECK_ENV, "1")


@pytest.fixture(scope="session", autouse=True)
def _wandb_offline() -> None:
    """A run with ``log.wandb`` writes its wandb run locally: no test reaches a server."""
    os.environ["WANDB_MODE"] = "offline"


@pytest.fixture(autouse=True)
def _no_leaked_process_group() -> None:
    """A test that trained in this process leaves no default group for later forks."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# The files that take longest (seconds of a 3-worker run on 2 cores, 2026-12-06), started
# first: with a whole file per worker (``--dist loadfile``) a long file started last
# keeps one worker busy while the others have finished. A scheduling hint only: a file
# missing here runs after these, in collection order.
LONGEST_FIRST = (
    "test_faults_process.py", "test_dry_run.py", "test_parity.py",
    "test_colocated_pipeline.py", "test_memory_peak.py", "test_recompute.py",
    "test_qwen_vl_engine.py", "test_balance.py", "test_native_estimate.py",
    "test_launch.py", "test_fsdp.py", "test_native_video.py", "test_lora.py",
    "test_checkpoint.py", "test_interleaved_parity.py", "test_moe_parity.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the files of :data:`LONGEST_FIRST` first, in its order (the order in which
    pytest-xdist hands files to workers); every other file keeps its place after them."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
