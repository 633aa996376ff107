"""The sbatch script template rendered by `bigclip slurm` (placeholders: {{NAME}}).

Kept as Python text rather than a package data file: it is rendered, never run, as is. Every
rendered script passes shellcheck (tests/test_slurm.py) and runs under a real Slurm in the tests
(tests/test_slurm_cluster.py). Why each line is there is said in the script itself, since that is
what users read; docs/scale-and-slurm.md has the table of which signal comes from where.
"""

HEADER = """\
#!/bin/bash
# {{TITLE}}
# Rendered by: bigclip slurm {{COMMAND}}
# Re-render instead of editing by hand; `bigclip plan` with the same training flags shows its memory,
# speed and length. It runs in its --chdir below: every path in it is absolute, and TRAIN_ARGS gives
# every training option, so it trains the same from wherever it is submitted and whatever bigclip's
# defaults become.
# Requeue cap: {{MAX_REQUEUES}} ({{MAX_REQUEUES_WHY}}).
#SBATCH --job-name={{JOB_NAME}}
#SBATCH --nodes={{NODES}}
#SBATCH --ntasks-per-node={{TASKS_PER_NODE}}
{{RESOURCES}}#SBATCH --time={{TIME}}
{{EXCLUSIVE}}#SBATCH --requeue
#SBATCH --signal=USR1@{{SIGNAL_SECONDS}}
#SBATCH --open-mode=append
#SBATCH --output={{OUTPUT}}
#SBATCH --chdir={{CHDIR}}
{{EXTRA_SBATCH}}"""

BODY = """
set -uo pipefail

# Preemption. SLURM sends SIGUSR1 to every task {{SIGNAL_SECONDS}} s before the time limit (--signal
# above), SIGTERM to the tasks when it preempts the job (then waits the partition's GraceTime), and
# SIGTERM to every process of the job when it requeues or cancels it (then waits KillWait). The
# ranks finish their step, commit a checkpoint (the async upload included), rank 0 writes the
# requeue marker ($REQUEUE_MARKER below), and they exit with 85; this script then requeues the job,
# once, and the rerun resumes with --resume latest at that step. After {{MAX_REQUEUES}} requeues (SLURM_RESTART_COUNT)
# it stops requeueing and says so: a job that asks again at every run would otherwise cycle for ever.
# Planned checkpoint time: {{CHECKPOINT_SECONDS}} s; GraceTime and KillWait must leave at least that.
# This shell gets signals too (a B: signal, scancel --batch or --full, a requeue, a cancel). It must
# not die of them (SLURM would end the job step under the ranks' checkpoint): it passes them on to
# the ranks, as SIGUSR1 through the launcher, and keeps waiting.
LAUNCHER_PID="" LAUNCHED=0 EARLY_SIGNAL=""
# shellcheck disable=SC2329  # called by the traps
forward() {
    if [[ -z "$LAUNCHER_PID" ]]; then  # before the launch: nothing to checkpoint yet; after: nothing left
        (( LAUNCHED )) || EARLY_SIGNAL=$1
        return
    fi
    echo "bigclip sbatch: $1 received; asking the ranks to checkpoint and stop"
    kill -s USR1 "$LAUNCHER_PID" 2>/dev/null || true
}
trap 'forward SIGTERM' TERM
trap 'forward SIGUSR1' USR1

# Requeue once, and only if nobody else did: SLURM itself requeues a job preempted past its grace
# time or hit by `scontrol requeue` (its Restarts count is then ahead of ours), and a cancelled job
# must stay cancelled (SLURM would requeue even that).
job_field() {
    scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | sed -n "s/.* $1=\\([^ ]*\\).*/\\1/p"
}
requeued_already() {
    local restarts
    restarts=$(job_field Restarts)
    (( ${restarts:-0} > ${SLURM_RESTART_COUNT:-0} ))
}
# Cancelled (scancel): ending for no time limit, and not requeued by SLURM.
job_cancelled() {
    case "$(job_field JobState)" in CANCELLED|COMPLETING) ;; *) return 1 ;; esac
    [[ "$(job_field Reason)" != TimeLimit ]] && ! requeued_already
}
STOP_ANNOUNCED=0
announce_stop() {  # once: as soon as the marker is there, and again after the launcher only if not
    (( STOP_ANNOUNCED )) && return
    STOP_ANNOUNCED=1
    echo "bigclip sbatch: the ranks stopped and asked for a requeue ($(cat "$REQUEUE_MARKER" 2>/dev/null))"
}
MAX_REQUEUES={{MAX_REQUEUES}}
requeue_once() {
    local state reason
    state=$(job_field JobState) reason=$(job_field Reason)
    if requeued_already; then
        echo "bigclip sbatch: SLURM has requeued this job already (preemption, scontrol requeue or a node failure); it resumes from the last checkpoint"
    elif (( ${SLURM_RESTART_COUNT:-0} >= MAX_REQUEUES )); then
        echo "bigclip sbatch: not requeueing: this job has been requeued ${SLURM_RESTART_COUNT:-0} times, the cap (--max-requeues $MAX_REQUEUES); resubmit this script to resume from the last checkpoint"
    elif [[ "$state" == RUNNING || "$reason" == TimeLimit ]]; then
        # The requeue makes SLURM end this job at once, SIGTERM to scontrol included: it ignores it.
        if (trap '' TERM; scontrol requeue "$SLURM_JOB_ID") || requeued_already; then
            echo "bigclip sbatch: requeued job $SLURM_JOB_ID; it resumes from the last checkpoint"
        else
            echo "bigclip sbatch: scontrol requeue failed; resubmit this script to resume from the last checkpoint"
        fi
    else
        echo "bigclip sbatch: the job is ending (${state:-unknown}, reason ${reason:-none}: cancelled), so it is not requeued; resubmit this script to resume from the last checkpoint"
    fi
}

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
# Open files: each rank keeps a socket per peer its gloo collectives reach, and the rank hosting the
# rendezvous store two per rank; a rank refuses to start below what the world needs. Raise the soft
# limit to the hard one (often 1024 and far more): srun passes this shell's limit on to every task.
ulimit -Sn "$(ulimit -Hn)" 2>/dev/null || true

# Rendezvous on the first node of the allocation; a port derived from the job id keeps two jobs
# sharing a node apart.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT

RUN_DIR="{{LOGS}}/{{NAME}}"
# This job's marker (a requeued job keeps its id): a second job given the same --name, which the
# run's lock refuses, neither removes the first's marker nor requeues itself on it.
REQUEUE_MARKER="$RUN_DIR/requeue-$SLURM_JOB_ID.json"
mkdir -p "$RUN_DIR/flight_recorder"
rm -f "$REQUEUE_MARKER"

TRAIN_ARGS=(
{{TRAIN_ARGS}}
)

echo "bigclip sbatch: job $SLURM_JOB_ID, restart ${SLURM_RESTART_COUNT:-0}, {{WORLD}} ranks on $SLURM_JOB_NUM_NODES nodes"
if [[ -n "$EARLY_SIGNAL" ]]; then
    echo "bigclip sbatch: $EARLY_SIGNAL before the ranks started: nothing to checkpoint"
    requeue_once
    exit 0
fi
{{LAUNCH}} &
LAUNCHER_PID=$! LAUNCHED=1
# Wait until the launcher is really gone (`wait` returns early whenever a trapped signal arrives),
# but not forever once a rank has written the requeue marker (its checkpoint is committed, or its
# watchdog named hung ranks): srun waits for the tasks of a node that stopped answering until
# SLURM declares it down (SlurmdTimeout, 300 s by default). {{LAUNCHER_GRACE}} s after the marker, requeue without it.
MARKED_AT="" status=""
while kill -0 "$LAUNCHER_PID" 2>/dev/null; do
    if [[ -f "$REQUEUE_MARKER" && -z "$MARKED_AT" ]]; then
        MARKED_AT=$SECONDS
        announce_stop
        # A job cancelled, or requeued by SLURM, ends here, its ranks' stop said: srun can wait for
        # the step's teardown until KillWait runs out, when SLURM SIGKILLs this shell before it could
        # say so. (The marker is written once the checkpoint is committed: nothing is cut short.)
        if job_cancelled || requeued_already; then requeue_once; exit 0; fi
    fi
    if [[ -n "$MARKED_AT" ]] && (( SECONDS - MARKED_AT >= {{LAUNCHER_GRACE}} )); then
        echo "bigclip sbatch: the launcher still runs {{LAUNCHER_GRACE}} s after the requeue marker (a node that stopped answering?); not waiting for it"
        # Stop it for good: left behind, srun gives up on the lost node's tasks later and then
        # cancels its step by id, which the rerun of this job reuses (it would kill the rerun).
        kill -s KILL "$LAUNCHER_PID" 2>/dev/null || true
        status=85
        break
    fi
    sleep 1 & wait $!
done
if [[ -z "$status" ]]; then wait "$LAUNCHER_PID"; status=$?; fi
LAUNCHER_PID=""

# The marker, not the exit code, says "checkpoint committed, requeue me": torchrun exits 1 when its
# ranks exit 85, and a rank ended by the step watchdog (a hung peer) writes it too.
if [[ -f "$REQUEUE_MARKER" || $status -eq 85 ]]; then
    announce_stop
    requeue_once
    exit 0
fi
exit "$status"
"""

SRUN_LAUNCH = """\
# One task per rank: srun sets SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, which bigclip reads.
# --kill-on-bad-exit stops the other ranks when one fails, instead of leaving them in a collective
# until the timeout; on preemption the ranks meet after the checkpoint, so nothing is cut short.
srun --kill-on-bad-exit=1 {{PYTHON}} -u -m bigclip.train "${TRAIN_ARGS[@]}\""""

TORCHRUN_LAUNCH = """\
# One torchrun per node (it starts {{RANKS_PER_NODE}} ranks) with the c10d rendezvous on the first node.
# torchrun passes SIGUSR1 on only when asked to (--signals-to-handle), to each rank's process
# group, then SIGKILLs what is left after TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds: the planned
# checkpoint time. It exits 1 itself; the requeue marker written by rank 0 is what this script
# trusts. `--` keeps torchrun from reading bigclip's --logs as its own --logs-specs.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={{CHECKPOINT_SECONDS}}
srun --kill-on-bad-exit=1 --ntasks-per-node=1 {{PYTHON}} -m torch.distributed.run \\
    --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={{RANKS_PER_NODE}} \\
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \\
    --max-restarts=0 --signals-to-handle=SIGTERM,SIGINT,SIGUSR1 \\
    -m bigclip.train -- "${TRAIN_ARGS[@]}\""""


DEEPSPEED_LAUNCH = """\
# One DeepSpeed launcher per node in its no-ssh form (`deepspeed --no_ssh --node_rank=$SLURM_NODEID`,
# which bigclip.launch.deepspeed_node adds), each starting {{RANKS_PER_NODE}} ranks. Not `deepspeed
# --launcher slurm`: it runs `srun ... python -u SCRIPT` and drops --module, so bigclip.train would
# be taken for a file. deepspeed_node blocks SIGTERM and SIGUSR1 in the launchers (their own
# handling kills the ranks mid-checkpoint: see that module); the ranks get them from Slurm and stop
# as under srun. Every node's launcher reads the hostfile (`HOST slots=N` per node, in node-rank
# order), so it lives in the run directory.
HOSTFILE="$RUN_DIR/hostfile"
scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\\$/ slots={{RANKS_PER_NODE}}/" > "$HOSTFILE"
srun --kill-on-bad-exit=1 --ntasks-per-node=1 {{PYTHON}} -m bigclip.launch.deepspeed_node \\
    --no_ssh --hostfile="$HOSTFILE" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \\
    --module bigclip.train "${TRAIN_ARGS[@]}\""""


def fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    if "{{" in text:
        raise ValueError(f"unfilled placeholder in the sbatch template near: {text[text.index('{{') :][:40]}")
    return text
