"""OpenCLIP-compatible CLIP models: plain nn.Modules (clip.py), OpenCLIP's JSON configs and weight
names (named_configs.py), `create_model` (factory.py), OpenCLIP's pretrained tags
(pretrained_tags.py) and `hf-hub:ORG/REPO` files through the Hugging Face cache (hf_hub.py).
No distributed code. What engines and the linear kinds may use of a model is the model contract
(contract.py): they import nothing else of this package. A run reaches its model through the model
family its --model name belongs to (families.py), which checks its flags, builds it
(`build_model(cfg)` in from_config.py calls the family's builder and swaps the linear kind) and
names its tokenizer; the planner and consolidation use the family's static half, without torch:
its `ModelShape` (shape.py) and the FLOP count derived from it (flops.py).
May import config, errors and ops (int8/fp8 swaps); never engines, data or train.

The package imports nothing itself: the flag checks import its torch-free modules (shape,
families, named_configs) without importing torch.
"""
