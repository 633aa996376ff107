"""fp8 linears: torchao's float8 training applied to the blocks' linears (float8), the
`fp8-*` linear kinds of config/linear_kinds.py.
Imports only errors and the model contract from bigclip; torchao only when a model is converted (an optional extra,
`bigclip[fp8]`).
"""
