"""One node of a multi-node DeepSpeed launch under Slurm: `deepspeed --no_ssh` with this node's rank.

    srun --ntasks-per-node=1 python -m bigclip.launch.deepspeed_node --no_ssh --hostfile=H \\
        --master_addr=A --master_port=P --module bigclip.train [training flags]

runs DeepSpeed's runner (`deepspeed`, deepspeed.launcher.runner) with the arguments given and
`--node_rank=$SLURM_NODEID`; it starts deepspeed.launcher.launch, which starts this node's ranks
with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* set.

Why not just `deepspeed` under srun: Slurm signals every process of a job step (SIGTERM on
preemption, SIGUSR1 before the time limit), the launchers included. SIGUSR1 kills both DeepSpeed
processes (no handler), so does SIGTERM the runner (it traps it only for pdsh), and
deepspeed.launcher.launch answers SIGTERM by terminating every rank and SIGKILLing them 30 s
later, whatever their checkpoint needs (DeepSpeed 0.18.3 to 0.19.8 alike). Either way the ranks
die inside their preemption checkpoint: srun ends the step once its task, the runner, is gone.
So both signals are blocked here, before exec: the launchers inherit the mask and never act on
them, and the ranks, which get the signals from Slurm directly, unblock them first thing
(bigclip/train/signals.py), checkpoint, and exit 85; the launchers then exit with that code.
SIGINT (Ctrl-C on srun) is left to DeepSpeed. Standard library only: it runs before anything
heavy is imported.
"""

from __future__ import annotations

import os
import signal
import sys

HELD = (signal.SIGTERM, signal.SIGUSR1)  # what Slurm sends to ask for a checkpoint


def runner_argv(argv: list[str], *, env: dict[str, str]) -> list[str]:
    """The `deepspeed` command line for this node: its arguments plus --node_rank from SLURM_NODEID."""
    node = env.get("SLURM_NODEID", "")
    if not node.isdigit():
        raise SystemExit(
            "bigclip.launch.deepspeed_node: SLURM_NODEID is not set: run it under srun, one task per node "
            "(the script from `bigclip slurm --launcher deepspeed` does)"
        )
    if any(a == "--node_rank" or a.startswith("--node_rank=") for a in argv):
        raise SystemExit("bigclip.launch.deepspeed_node: give no --node_rank; it is this node's SLURM_NODEID")
    return [sys.executable, "-u", "-m", "deepspeed.launcher.runner", f"--node_rank={node}", *argv]


def main(argv: list[str]) -> None:
    command = runner_argv(argv, env=dict(os.environ))
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD)  # kept across exec, and by every child process
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
