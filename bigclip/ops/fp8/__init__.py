"""fp8 linears: torchao's float8 training applied to the towers' linears (float8).
Imports torchao only when a model is converted: it is an optional extra (`bigclip[fp8]`).
"""
