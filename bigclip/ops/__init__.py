"""Numerical building blocks: contrastive losses (loss/) and int8 linears (int8/).
Each works on tensors and, for the loss, a process group; neither knows models or engines.
May import config and errors only.
"""
