"""SwitchBack int8 linears: the autograd layers and model swap (switchback), their primitives as
torch custom ops (custom_ops) dispatched to Triton kernels (kernels) or plain PyTorch (torch_path).
Imports only errors, the linear-kind table (config.linear_kinds) and the model contract
(models.contract) from bigclip; triton only when a kernel runs.
"""
