"""`bigclip plan`: per-GPU memory, FLOPs, step time and checkpoint traffic of a run, from formulas
(spec, model_state, memory, planner) and from a fake-process-group dry run of the real engines.
An offline tool: may import anything below cli; nothing in training imports it. Of models/ it
sees only the static contract (shape, families, flops), except the dry run, which builds the
real model through the training loop's own entry (models/from_config.py).
"""
