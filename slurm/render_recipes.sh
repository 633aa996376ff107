#!/bin/bash
# Re-render the sbatch scripts checked in beside this file (tests/test_slurm.py checks that they
# match): ViT-bigG-14 on 32, 64 and 128 nodes x 8 GPUs with FSDP2 and with DeepSpeed ZeRO-3, and a
# small 1-node ViT-B-32 run. Usage, from the repository root: bash slurm/render_recipes.sh [OUT_DIR]
# The jobs run in CHDIR (#SBATCH --chdir; their logs go to CHDIR/logs): the checked-in scripts name
# a placeholder; render yours with CHDIR=/your/shared/folder (e.g. CHDIR="$PWD") and OUT_DIR.
set -euo pipefail
out="${1:-slurm}"
bigclip=("${PYTHON:-python}" -m bigclip.cli slurm --chdir "${CHDIR:-/YOUR-SHARED-FS/bigclip}")

# Data, checkpoints and logs live on S3; replace YOUR-BUCKET (and the shard list) with yours.
# 100M samples per epoch x 390 epochs = 39B samples seen, at a global batch of 160 x GPUs.
bigg=(
    --model ViT-bigG-14 --train-data 's3://YOUR-BUCKET/laion2b/{000000..099999}.tar'
    --train-num-samples 100000000 --dataset-resampled --epochs 390 --workers 8
    --batch-size 160 --precision amp_bf16 --grad-checkpointing
    --lr 1e-3 --beta2 0.95 --wd 0.2 --warmup 10000 --grad-clip-norm 1.0
    --local-loss --gather-with-grad --loss-chunk-size 1024
    --save-every-n-steps 500 --async-save --remote-keep-last 3
    --log-every-n-steps 50 --remote-sync s3://YOUR-BUCKET/bigclip/logs
)
zero3=(--engine deepspeed --deepspeed-config zero3_vit_bigg)  # the name of the config bigclip ships

for nodes in 32 64 128; do
    gpus=$((nodes * 8))
    "${bigclip[@]}" --nodes "$nodes" --gpus-per-node 8 --time 24:00:00 "${bigg[@]}" \
        --checkpoint-dir "s3://YOUR-BUCKET/bigclip/vit-bigg-fsdp-${gpus}/checkpoints" \
        -o "$out/vit_bigg_fsdp_${nodes}x8.sbatch"
    "${bigclip[@]}" --nodes "$nodes" --gpus-per-node 8 --time 24:00:00 "${bigg[@]}" "${zero3[@]}" \
        --checkpoint-dir "s3://YOUR-BUCKET/bigclip/vit-bigg-zero3-${gpus}/checkpoints" \
        -o "$out/vit_bigg_zero3_${nodes}x8.sbatch"
done

# One node, torchrun layout: ViT-B-32 at a global batch of 8 x 512.
"${bigclip[@]}" --nodes 1 --gpus-per-node 8 --launcher torchrun --time 12:00:00 \
    --model ViT-B-32 --train-data 's3://YOUR-BUCKET/laion400m/{00000..41407}.tar' \
    --train-num-samples 100000000 --dataset-resampled --epochs 32 --workers 8 --batch-size 512 \
    --precision amp_bf16 --lr 1e-3 --wd 0.2 --warmup 2000 --local-loss --gather-with-grad \
    --loss-chunk-size 1024 --save-every-n-steps 1000 --async-save \
    --checkpoint-dir s3://YOUR-BUCKET/bigclip/vit-b32-8gpu/checkpoints \
    -o "$out/vit_b32_1x8.sbatch"
