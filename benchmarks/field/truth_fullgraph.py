"""The truth of a fullgraph=True compile that the audit reports as failing (HF GPT-2): the user's
real compile on this CPU, with Inductor (Dynamo's error comes before any backend runs)."""

import torch
import transformers

cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
m = transformers.AutoModelForCausalLM.from_config(cfg)
ids = torch.randint(0, 128, (2, 16))
try:
    torch.compile(m, fullgraph=True)(input_ids=ids, labels=ids)
    print("fullgraph: ok")
except Exception as exc:
    print("fullgraph:", type(exc).__name__, str(exc).splitlines()[0][:200])
