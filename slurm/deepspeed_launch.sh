#!/bin/bash
# ViT-bigG-14 with DeepSpeed ZeRO-3 through DeepSpeed's own launcher (pdsh over ssh), the
# alternative to the srun scripts beside this file for clusters where nodes reach each other by
# passwordless ssh. Run it on the first node of an allocation (salloc -N 128 --gpus-per-node 8, or
# from a batch script), or set HOSTFILE to a hostfile like hostfile.example:
#     bash slurm/deepspeed_launch.sh
# Preemption: SLURM's signals reach srun job steps, not processes started over ssh, and DeepSpeed's
# launcher treats SIGUSR1 as fatal; with this launcher a run resumes from its last periodic
# checkpoint (--resume latest) when restarted. Use the sbatch scripts for preemptible queues.
set -euo pipefail

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
if [[ -z "${HOSTFILE:-}" ]]; then
    HOSTFILE="hostfile.$SLURM_JOB_ID"
    scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\$/ slots=$GPUS_PER_NODE/" > "$HOSTFILE"
fi
NUM_NODES=$(grep -cv '^\s*\(#\|$\)' "$HOSTFILE")
MASTER_ADDR=$(grep -v '^\s*\(#\|$\)' "$HOSTFILE" | head -n 1 | cut -d' ' -f1)

DS_ARGS=(
    --hostfile "$HOSTFILE" --num_nodes "$NUM_NODES" --num_gpus "$GPUS_PER_NODE"
    --master_addr "$MASTER_ADDR" --master_port 29500
)
# The same training flags as slurm/vit_bigg_zero3_128x8.sbatch (replace YOUR-BUCKET).
TRAIN_ARGS=(
    --model ViT-bigG-14 --grad-checkpointing
    --train-data 's3://YOUR-BUCKET/laion2b/{000000..099999}.tar'
    --train-num-samples 100000000 --dataset-resampled --workers 8 --batch-size 160
    --lr 0.001 --beta2 0.95 --epochs 390 --grad-clip-norm 1.0
    --local-loss --gather-with-grad --loss-chunk-size 1024
    --engine deepspeed --deepspeed-config ds_configs/zero3_vit_bigg.json
    --checkpoint-dir "s3://YOUR-BUCKET/bigclip/vit-bigg-zero3-$((NUM_NODES * GPUS_PER_NODE))/checkpoints"
    --save-every-n-steps 500 --async-save --remote-keep-last 3 --resume latest
    --name "ViT-bigG-14-deepspeed-$((NUM_NODES * GPUS_PER_NODE))gpu"
    --log-every-n-steps 50 --remote-sync s3://YOUR-BUCKET/bigclip/logs
)
# DeepSpeed's launcher takes --module (it rejects -m); it passes --local_rank, which bigclip accepts.
exec deepspeed "${DS_ARGS[@]}" --module bigclip.train "${TRAIN_ARGS[@]}"
