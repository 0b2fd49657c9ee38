"""Launching: a failing rank ends the whole job, named as the root cause; two torchrun
"nodes" train together.

The tests start real launchers in subprocesses (the only way to test them), with tiny
models and a few iterations. The subprocess timeouts are hang guards, not speed checks.
Failures are injected with ``MIMOTRON_FAIL_AT_ITER``/``MIMOTRON_FAIL_RANK`` (and
``MIMOTRON_FAIL_SIGNAL``); whichever rank exits first, the verdict must name the failing
rank and call its blocked peer collateral.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.common import DIGITS
from tests.launching import COLOCATED, ROOT, TINY, launch_env

COLLATERAL = r"rank 0 (failed as a consequence: peer lost|stopped as a consequence)"


def test_a_rank_failing_mid_step_ends_the_job_non_zero_with_its_traceback(tmp_path):
    # Rank 1 raises while fetching iteration 2's data (inside train_step_mimo); rank 0 is
    # then blocked on it in a collective.
    proc = subprocess.run(
        [sys.executable, "-m", "mimotron", "train", COLOCATED, *TINY, "train.iters=5",
         "train.pg_timeout_s=60", f"log.dir={tmp_path}"],
        cwd=ROOT, env=launch_env(MIMOTRON_FAIL_AT_ITER="2", MIMOTRON_FAIL_RANK="1"),
        capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "mimotron train: rank 1 failed: InjectedFault: rank 1: injected failure at " \
           "iteration 2 (MIMOTRON_FAIL_AT_ITER=2)" in out
    assert "Traceback (most recent call last)" in out and "in inject_fault" in out
    # The launcher's verdict names rank 1, never rank 0 (blocked on it, so collateral).
    verdict = re.search(r"mimotron train: rank \d failed \(.*", out)
    assert verdict is not None, out[-4000:]
    assert verdict[0].startswith("mimotron train: rank 1 failed (exit code 1): InjectedFault: "
                                 "rank 1: injected failure"), verdict[0]
    assert re.search(COLLATERAL, verdict[0]), verdict[0]
    iterations = [json.loads(x)["iteration"] for x in
                  (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert iterations == [1]


def test_a_rank_killed_by_a_signal_is_named_as_the_root_cause(tmp_path):
    # Rank 1 SIGKILLs itself at iteration 2: it reports nothing; rank 0 loses its peer.
    proc = subprocess.run(
        [sys.executable, "-m", "mimotron", "train", COLOCATED, *TINY, "train.iters=5",
         "train.pg_timeout_s=60", f"log.dir={tmp_path}"],
        cwd=ROOT, env=launch_env(MIMOTRON_FAIL_AT_ITER="2", MIMOTRON_FAIL_RANK="1",
                           MIMOTRON_FAIL_SIGNAL="SIGKILL"),
        capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    verdict = re.search(r"mimotron train: rank \d failed \(.*", out)
    assert verdict is not None, out[-4000:]
    assert verdict[0].startswith("mimotron train: rank 1 failed (killed by signal SIGKILL; "
                                 "out of memory?"), verdict[0]
    assert re.search(COLLATERAL, verdict[0]), verdict[0]


def test_two_torchrun_nodes_train_a_heterogeneous_layout(tmp_path):
    # vision | audio | language (DP 2): 4 ranks, 2 per "node", modules split across nodes.
    layout = ["modules.vision.parallel.data=1", "modules.vision.parallel.rank_offset=0",
              "modules.audio.parallel.data=1", "modules.audio.parallel.rank_offset=1",
              "modules.language.parallel.data=2", "modules.language.parallel.rank_offset=2"]
    # Rendezvous on a file (c10d backend, file store): no port to pick and hand over.
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
         "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={tmp_path}/rdzv",
         "--rdzv-conf=store_type=file",
         "--rdzv-id=mimotron-two-nodes", "--max-restarts=0", "--local-addr=127.0.0.1",
         "-m", "mimotron", "train", DIGITS, *TINY, *layout, "train.iters=3",
         "train.pg_timeout_s=120", f"log.dir={tmp_path}"],
        cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for node, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"node {node}:\n{out[-4000:]}"
    text = "".join(outputs)
    assert text.count("placement: non-colocated, world size 4") == 1
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2, 3]
    assert len(records[0]["peak_memory_bytes_per_rank"]) == 4
    assert any("eval_accuracy" in r for r in records)


# Modules (and their submodules) the launcher must not import. It does read a Hugging
# Face folder's config.json (the family and sizes are checked at config load), so
# mimotron.models.hf.{folder,specs,config_check,resolve} and mimotron.config.moe_options
# are its business; the modules that build models (nn code, DTensor behind it) are not.
_FORBIDDEN = ("torch.distributed.tensor", "torch.distributed.checkpoint",
              "mimotron.models.mimo", "mimotron.models.moe", "mimotron.models.hf.llama",
              "mimotron.models.hf.clip", "mimotron.models.hf.whisper",
              "mimotron.models.hf.layers", "mimotron.models.hf.weights")
# What ``mimotron train`` runs before it starts the ranks, in a fresh interpreter.
_LAUNCHER_PATH = f"""
import sys
from mimotron.cli.train import run_train  # noqa: F401 - the module the launcher runs
from mimotron.cli.launch import Launcher  # noqa: F401
from mimotron.cli.lines import whole_lines  # noqa: F401
from mimotron.checkpoint import CheckpointError, read_latest  # noqa: F401
from mimotron.checkpoint.signals import read_stop_record  # noqa: F401
from mimotron.config import load_config
from mimotron.data.run_data import check_data
from mimotron.parallel.layout import check_layout
from mimotron.run_dir import prepare_run_dir
cfg = load_config(sys.argv[1], sys.argv[2:])
check_layout(cfg)
check_data(cfg)
prepare_run_dir(cfg)
import torch.distributed  # the launcher's TCPStore
print(sorted(m for m in sys.modules
             if any(m == f or m.startswith(f + ".") for f in {_FORBIDDEN!r})))
"""


def test_the_launcher_imports_no_dtensor_dcp_or_model(tmp_path):
    # The launcher's checks run before any rank starts, so every import they pay for
    # delays every launch; DTensor, DCP and the models are the ranks' business only.
    proc = subprocess.run([sys.executable, "-c", _LAUNCHER_PATH, COLOCATED, *TINY,
                           f"log.dir={tmp_path}"], cwd=ROOT, env=launch_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "[]", proc.stdout
