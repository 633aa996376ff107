"""The sbatch script template rendered by `bigclip slurm` (placeholders: {{NAME}}).

Kept as Python text rather than a package data file: it is rendered, never run, as is. Every
rendered script passes shellcheck (tests/test_slurm.py). Why each line is there is said in the
script itself, since that is what users read.
"""

HEADER = """\
#!/bin/bash
# {{TITLE}}
# Rendered by: bigclip slurm {{COMMAND}}
# Re-render instead of editing by hand. Submit with sbatch from the bigclip checkout (paths are
# relative to it); `bigclip plan` with the same training flags shows its memory and speed.
#SBATCH --job-name={{JOB_NAME}}
#SBATCH --nodes={{NODES}}
#SBATCH --ntasks-per-node={{TASKS_PER_NODE}}
#SBATCH --gpus-per-node={{GPUS_PER_NODE}}
#SBATCH --cpus-per-task={{CPUS_PER_TASK}}
#SBATCH --time={{TIME}}
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --signal=USR1@{{SIGNAL_SECONDS}}
#SBATCH --open-mode=append
#SBATCH --output={{OUTPUT}}
{{EXTRA_SBATCH}}"""

BODY = """
set -uo pipefail

# Preemption. SLURM sends SIGUSR1 to every task {{SIGNAL_SECONDS}} s before the time limit
# (--signal above) and SIGTERM when it preempts the job. bigclip finishes the step, commits a
# checkpoint (the async upload included), rank 0 writes $RUN_DIR/requeue.json, and the ranks exit
# with 85. This shell then requeues the job; the rerun resumes with --resume latest at that step.
# SIGTERM also reaches this shell: trap it, or the shell would die at once and SLURM would end the
# job step while the ranks are still writing their checkpoint.
trap 'echo "bigclip sbatch: SIGTERM; waiting for the ranks to checkpoint"' TERM

# NCCL / PyTorch settings, each documented in slurm/README.md. Cluster-specific ones (network
# interface, InfiniBand HCAs, AWS EFA) are left to the site: uncomment what yours documents.
export NCCL_DEBUG=WARN
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3
export TORCH_NCCL_DUMP_ON_TIMEOUT=1
export TORCH_FR_BUFFER_SIZE=20000
export TORCH_FR_DUMP_TEMP_FILE="{{LOGS}}/{{NAME}}/flight_recorder/rank_"
export OMP_NUM_THREADS={{OMP_THREADS}}
# export NCCL_SOCKET_IFNAME=ib0         # the interface NCCL's bootstrap uses
# export NCCL_IB_HCA=mlx5               # InfiniBand adapters to use
# export FI_PROVIDER=efa                # AWS EFA (p4d/p5), with the aws-ofi-nccl plugin
{{ENV_SETUP}}
# Rendezvous on the first node of the allocation; a port derived from the job id keeps two jobs
# sharing a node apart.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT

RUN_DIR="{{LOGS}}/{{NAME}}"
REQUEUE_MARKER="$RUN_DIR/requeue.json"
mkdir -p "$RUN_DIR/flight_recorder"
rm -f "$REQUEUE_MARKER"

TRAIN_ARGS=(
{{TRAIN_ARGS}}
)

echo "bigclip sbatch: job $SLURM_JOB_ID, restart ${SLURM_RESTART_COUNT:-0}, {{WORLD}} ranks on $SLURM_JOB_NUM_NODES nodes"
{{LAUNCH}}
status=$?

if [[ -f "$REQUEUE_MARKER" || $status -eq 85 ]]; then
    echo "bigclip sbatch: preempted after a committed checkpoint ($(cat "$REQUEUE_MARKER" 2>/dev/null)); requeueing"
    scontrol requeue "$SLURM_JOB_ID" || echo "bigclip sbatch: scontrol requeue failed; resubmit this script to resume"
    exit 0
fi
exit "$status"
"""

SRUN_LAUNCH = """\
# One task per GPU: srun sets SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, which bigclip reads.
# --kill-on-bad-exit stops the other ranks when one fails, instead of leaving them in a collective
# until the NCCL timeout; on preemption the ranks meet after the checkpoint, so nothing is cut short.
srun --kill-on-bad-exit=1 {{PYTHON}} -u -m bigclip.train "${TRAIN_ARGS[@]}\""""

TORCHRUN_LAUNCH = """\
# One torchrun per node (it starts {{GPUS_PER_NODE}} ranks) with the c10d rendezvous on the first node.
# torchrun forwards SIGUSR1 only when asked to (--signals-to-handle) and then exits 1 itself;
# the requeue marker written by rank 0 is what this script trusts. `--` keeps torchrun from
# reading bigclip's --logs as an abbreviation of its own --logs-specs.
srun --kill-on-bad-exit=1 --ntasks-per-node=1 {{PYTHON}} -m torch.distributed.run \\
    --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={{GPUS_PER_NODE}} \\
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \\
    --max-restarts=0 --signals-to-handle=SIGTERM,SIGINT,SIGUSR1 \\
    -m bigclip.train -- "${TRAIN_ARGS[@]}\""""


def fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    if "{{" in text:
        raise ValueError(f"unfilled placeholder in the sbatch template near: {text[text.index('{{') :][:40]}")
    return text
