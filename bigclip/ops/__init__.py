"""Numerical building blocks: contrastive losses and int8 linears."""
