"""Sockets and open files (issue 37, goal 6): gloo connects lazily in a real 4-rank world set up as
srun starts bigclip, with an async save's collectives on a background thread beside the training's,
each on its group; what every process holds stays within what the open-file preflight asks; the
preflight raises the soft limit to the hard one before judging; and the rendered sbatch script
raises it for the launcher. benchmarks/scale_sockets.py measures 4-32 ranks and extrapolates."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from support.socket_probe import probe

from bigclip.launch.slurm import main as slurm_main
from bigclip.train.preflight import FD_BASE, open_files_needed

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4


@pytest.mark.dist
def test_gloo_connects_lazily_and_two_threads_collectives_stay_on_their_groups() -> None:
    ranks = probe(WORLD, lazy=True)
    full_mesh = 2 * WORLD  # a socket per peer and a listener, in each of the two gloo groups
    for rank, counts in ranks.items():
        assert counts["lazy"] == "1", "init_distributed sets TORCH_GLOO_LAZY_INIT=1"
        assert counts["collectives_ok"] and counts["committed"], (rank, counts)
        assert counts["rounds_beside_upload"] >= 3  # the main thread all-reduced while the save ran
        if rank:  # nobody connected before a collective needed it: the two groups' listeners, the store
            assert counts["init"] < full_mesh, (rank, counts)
        need = sum(open_files_needed(WORLD, hosts_store=True, gloo_world=True, lazy=True).values())
        assert counts["open_files"] <= need, (rank, counts, need)
    # rank 0 hosts the store (a connection per rank for the group, one for the heartbeats) and
    # gathers the checkpoint's plans from every rank: more sockets than any other, and within the
    # preflight's count of them
    sockets = open_files_needed(WORLD, hosts_store=True, gloo_world=True, lazy=True)
    assert max(c["checkpoint"] for r, c in ranks.items() if r) < ranks[0]["checkpoint"]
    assert ranks[0]["checkpoint"] <= sum(sockets.values()) - FD_BASE + 8  # + listeners, its own clients


LIMITS = """
import resource, sys
from bigclip.config import EngineConfig
from bigclip.train.preflight import check_open_files
for case in sys.argv[1:]:  # hard limits in decreasing order: lowering one takes no privilege
    soft, hard, world = map(int, case.split(","))
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        check_open_files(EngineConfig(), world_size=world)
        print("ok", *resource.getrlimit(resource.RLIMIT_NOFILE))
    except Exception as e:
        print("refused", *resource.getrlimit(resource.RLIMIT_NOFILE), e)
"""


def test_the_preflight_raises_the_soft_limit_to_the_hard_one_then_refuses_below_the_need() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = sum(open_files_needed(1024, hosts_store=True, gloo_world=True, lazy=True).values())
    if hard < need:
        pytest.skip(f"this machine's hard open-file limit ({hard}) is below the {need} the test raises to")
    cases = [f"256,{need},1024", "2048,4096,8", "1024,1024,1024"]
    done = subprocess.run([sys.executable, "-c", LIMITS, *cases], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    raised, enough, refused = (done.stdout.splitlines() + [done.stderr[-2000:]] * 3)[:3]
    assert raised == f"ok {need} {need}"  # raised to the hard limit, as launchers do
    assert enough == "ok 2048 4096"  # enough already: left as it was
    assert refused.startswith(f"refused 1024 1024 the open-file limit (ulimit -n) is 1024, hard limit 1024: a "
                              f"1024-rank run needs up to {need} per process"), refused  # fmt: skip
    assert f"`ulimit -n {need}` in the job script" in refused


STAND_IN_SRUN = """#!/bin/sh
# The launcher's part: report the open-file limits it was started with.
echo "launcher limits: $(ulimit -Sn) $(ulimit -Hn)"
"""


def test_the_rendered_sbatch_raises_the_soft_limit_for_the_launcher(tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    assert slurm_main(["--nodes", "2", "--gpus-per-node", "8", "--model", "tiny", "--train-data", "/d/{0..3}.tar",
                       "--logs", str(tmp_path / "logs"), "--name", "job", "-o", str(script)]) == 0  # fmt: skip
    text = script.read_text()
    assert 0 < text.index('ulimit -Sn "$(ulimit -Hn)"') < text.index("\nsrun ")  # before the launch
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in (("srun", STAND_IN_SRUN), ("scontrol", "#!/bin/sh\necho 127.0.0.1\n")):
        (bin_dir / tool).write_text(body)
        (bin_dir / tool).chmod(0o755)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard)

    def lowered() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))

    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "node[0-1]"}  # fmt: skip
    done = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, preexec_fn=lowered, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert f"launcher limits: {hard} {hard}" in done.stdout, done.stdout + done.stderr
