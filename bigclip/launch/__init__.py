"""`bigclip slurm`: sbatch scripts rendered from training flags, one srun task per rank or one
torchrun per node, with the signal and requeue protocol of train/preemption.py.
An offline tool: imports cli_args, config and errors, and plan (lazily: the planned checkpoint
time); nothing in training imports it.
"""
