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

from mimotron.testing import NCCL_CHECK_ENV, warm_up_imports


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
