"""Bad input that only shows at scale, refused before any expensive work: an open-file limit below
what a 1024-rank world needs (a rank started with a hard limit of 1024, as many clusters set it).
A checkpoint folder that is not shared across nodes is refused on the real two-node Slurm
(tests/test_slurm_two_nodes.py): one machine cannot give two ranks one path on two disks without
mount namespaces, which is that cluster's set-up."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.bad_input import TORCH_FIRST_S, Case, check

# A process whose hard open-file limit is 1024, running `python -m bigclip ...` (the -c program's
# arguments follow it, as the module's would).
LOW_LIMIT = (
    "import resource, runpy; resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)); "
    "runpy.run_module('bigclip', run_name='__main__', alter_sys=True)"
)
# Rank 0 of 1024 as srun starts it, with what the sbatch script exports (MASTER_ADDR, MASTER_PORT).
RANK_0_OF_1024 = {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "SLURM_PROCID": "0", "SLURM_NTASKS": "1024",
                  "SLURM_LOCALID": "0", "TORCHELASTIC_USE_AGENT_STORE": None, "TORCH_GLOO_LAZY_INIT": None,
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
TRAIN = (
    "train",
    "--model",
    "tiny",
    "--train-data",
    "/data/{00000..00003}.tar",
    "--logs",
    "logs",
    "--name",
    "run",
)

CASES = [
    Case("open-files-below-the-world", ("-c", LOW_LIMIT, *TRAIN), env=RANK_0_OF_1024,
         says=("the open-file limit (ulimit -n) is 1024, hard limit 1024: a 1024-rank run needs up to",
               "`ulimit -n ", "in the job script"), max_s=TORCH_FIRST_S),  # gloo's needs depend on torch
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_scale_input(case: Case, tmp_path: Path) -> None:
    check(case, cwd=tmp_path)
