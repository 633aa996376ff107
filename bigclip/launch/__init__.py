"""`bigclip slurm`: sbatch scripts rendered from training flags, one srun task per GPU or one
torchrun per node, with the requeue protocol of train/preemption.py.
An offline tool: imports only cli_args, config and errors; nothing in training imports it.
"""
