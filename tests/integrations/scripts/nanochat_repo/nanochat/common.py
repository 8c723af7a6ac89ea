"""nanochat's way (nanochat/common.py): the compute dtype is chosen when this module is imported."""

import torch

COMPUTE_DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32
