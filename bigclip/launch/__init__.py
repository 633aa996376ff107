"""`bigclip slurm`: sbatch scripts rendered from training flags (srun or torchrun per node).
An offline tool: imports only cli_args, config and errors; nothing in training imports it.
"""
