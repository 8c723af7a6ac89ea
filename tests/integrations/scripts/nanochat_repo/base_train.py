"""nanochat's base_train, tiny: the device chosen by the script, the dtype by nanochat.common."""

import sys

import torch
from nanochat import common
from nanochat.gpt import GPT

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = GPT(planted="--planted" in sys.argv).to(device)
idx = torch.randint(0, 16, (2, 6), device=device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
print("device", device, "cuda available in the script", torch.cuda.is_available())
for step in range(2):
    loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    print("step", step, "compute", common.COMPUTE_DTYPE, "loss", round(loss.item(), 3))
