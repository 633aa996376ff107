"""The trainer (trainer.py: set-up, the loop, one step, saving and stopping, top to bottom), its
door (entry.py: the flags and the machine checked once) and what the loop calls: the checkpoint
policy, preemption, evaluation, metrics, and the remote backup. `python -m bigclip.train` runs it.
May import engines, data, checkpoint, weights, storage, ops, models, config, distributed, errors;
never registry, plan, launch or demo (tests/test_layout.py checks it).
"""
