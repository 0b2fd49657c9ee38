"""What the launcher tests share: the configs they launch, a tiny run, a clean environment.

They start real ``mimotron train`` launchers in subprocesses (from the repository root,
:data:`ROOT`), so the environment must not carry a launcher's variables or an injected
fault of the pytest process itself (:func:`launch_env`).
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.common import SMALL_MODEL

ROOT = Path(__file__).resolve().parents[1]
COLOCATED = str(ROOT / "configs" / "digits_colocated.toml")  # all modules DP 2 on 2 ranks
TINY = [
    *SMALL_MODEL,
    "eval.iters=1", "log.interval=1",
]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                 "MASTER_PORT", "MIMOTRON_FAIL_AT_ITER", "MIMOTRON_FAIL_RANK",
                 "MIMOTRON_FAIL_SIGNAL", "MIMOTRON_FAILURE_DIR")


def launch_env(**extra: str) -> dict[str, str]:
    """This process's environment without :data:`LAUNCHER_VARS`, one thread, and ``extra``."""
    out = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    out.update(OMP_NUM_THREADS="1", **extra)
    return out


def run_args(log_dir: Path) -> list[str]:
    """``mimotron train`` arguments of a two-iteration colocated run that checkpoints at
    its end, logging into ``log_dir``."""
    return [COLOCATED, *TINY, "train.iters=2", "checkpoint.interval=2", f"log.dir={log_dir}"]
