#!/bin/bash
# Train through DeepSpeed's own launcher, with the training flags given to this script:
#     bash slurm/deepspeed_launch.sh --engine deepspeed --deepspeed-config ds_configs/zero3.json \
#         --model ViT-L-14 --train-data 's3://b/laion/{00000..41455}.tar' [any `bigclip train` flag]
# One node (no HOSTFILE, and SLURM_JOB_NUM_NODES unset or 1): the launcher starts the ranks on this
# machine, no ssh involved. Several nodes: run it on the first node of an allocation (salloc -N 4)
# and it writes a hostfile from SLURM_JOB_NODELIST, or set HOSTFILE (see hostfile.example); the
# launcher then starts the other nodes' ranks over passwordless ssh (pdsh).
# Environment: GPUS_PER_NODE (default 8), MASTER_PORT (default 29500).
# Preemption: processes started over ssh are outside SLURM's job steps, so SLURM's warning signal
# does not reach them, and DeepSpeed's launcher treats SIGUSR1 as fatal; with this launcher a run
# resumes from its last periodic checkpoint (--resume latest, added here) when restarted. Use the
# sbatch scripts from `bigclip slurm` for preemptible queues.
set -euo pipefail

if (( $# == 0 )); then
    echo "usage: bash slurm/deepspeed_launch.sh [bigclip train flags], e.g. --engine deepspeed" \
        "--deepspeed-config ds_configs/zero3.json --model ViT-L-14 --train-data 'PATTERN'" >&2
    exit 2
fi
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DS_ARGS=(--num_gpus "$GPUS_PER_NODE" --master_port "${MASTER_PORT:-29500}")
if [[ -z "${HOSTFILE:-}" && "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]]; then
    HOSTFILE="hostfile.$SLURM_JOB_ID"
    scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\$/ slots=$GPUS_PER_NODE/" > "$HOSTFILE"
fi
if [[ -n "${HOSTFILE:-}" ]]; then
    NUM_NODES=$(grep -cv '^\s*\(#\|$\)' "$HOSTFILE")
    MASTER_ADDR=$(grep -v '^\s*\(#\|$\)' "$HOSTFILE" | head -n 1 | cut -d' ' -f1)
    DS_ARGS=(--hostfile "$HOSTFILE" --num_nodes "$NUM_NODES" --master_addr "$MASTER_ADDR" "${DS_ARGS[@]}")
fi
# DeepSpeed's launcher takes --module (it rejects -m); it passes --local_rank, which bigclip accepts.
# Flags given to this script come after --resume latest, so a --resume of their own wins.
exec deepspeed "${DS_ARGS[@]}" --module bigclip.train --resume latest "$@"
