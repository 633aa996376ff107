"""The training loop and what it does around the steps: set-up, one step, checkpoint policy,
preemption, evaluation, metrics, and the remote backup (remote sync, backup set-up and checks). `python -m bigclip.train` runs it.
May import engines, data, checkpoint, weights, storage, ops, models, config, distributed, errors;
never registry, plan, launch or demo (tests/test_layout.py checks it).
"""
