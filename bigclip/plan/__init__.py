"""`bigclip plan`: per-GPU memory, FLOPs, step time and checkpoint traffic of a run, from formulas
(spec, model_state, memory, report) and from a fake-process-group dry run of the real engines.
An offline tool: may import anything below cli; nothing in training imports it.
"""
