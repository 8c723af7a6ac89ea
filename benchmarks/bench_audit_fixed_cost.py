"""The audit's fixed cost: what a tiny model's audit and CastwiseCallback's start-up cost.

    python benchmarks/bench_audit_fixed_cost.py [--rounds 7] [--profile]

- cold: a fresh process imports castwise and audits a tiny MLP once (``import torch`` not
  counted: the user's script pays it anyway; the fake-tensor mode's own import of torch._dynamo
  is counted, which a Lightning process has already paid: Lightning imports it); fresh processes
  read castwise's byte code from a cache, as an installed castwise does;
- warm: the same audit repeated in one process, the median (targets: <= 0.2 s on an idle
  machine);
- callback: on a tiny LightningModule, time from ``trainer.fit()`` to the first training step
  with and without ``CastwiseCallback``, each measured in a fresh process (what a training run's
  start pays; target: the callback adds <= 1 s).

``--profile`` prints the warm audit's cProfile (top functions by cumulative time). The load
average is printed before and after: the machine may be shared.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

_COLD = """
import time, warnings
warnings.filterwarnings("ignore")
import torch
from torch import nn
t = time.perf_counter()
import castwise
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
castwise.audit(model, torch.randn(2, 8), policy="bf16-mixed", device="cuda")
print(time.perf_counter() - t)
"""

_FIT = """
import time, warnings, sys
warnings.filterwarnings("ignore")
import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, idx):
        return self.net(batch[0]).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Stop(pl.Callback):
    at = None

    def on_train_batch_start(self, trainer, *args):
        if self.at is None:
            self.at = time.perf_counter()


stop = Stop()
callbacks = [stop]
if sys.argv[1] == "1":
    from castwise.lightning import CastwiseCallback

    callbacks.append(CastwiseCallback())
trainer = pl.Trainer(
    precision="bf16-mixed", accelerator="cpu", max_steps=1, callbacks=callbacks, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
)
data = DataLoader(TensorDataset(torch.randn(4, 16)), batch_size=2)
start = time.perf_counter()
trainer.fit(Tiny(), data)
print(stop.at - start)
"""


_PYCACHE = os.path.join(tempfile.gettempdir(), "castwise-bench-pycache")


def _fresh(code: str, *args: str) -> float:
    # byte-code cached as an install has it (here in a temporary prefix, never in the tree), even
    # where the environment turns writing it off
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPYCACHEPREFIX": _PYCACHE}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _warm(rounds: int, profile: bool) -> list[float]:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from torch import nn

    import castwise

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(2, 8)
    castwise.audit(model, x, policy="bf16-mixed", device="cuda")  # warm-up: imports, rule discovery
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        castwise.audit(model, x, policy="bf16-mixed", device="cuda")
        times.append(time.perf_counter() - start)
    if profile:
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            castwise.audit(model, x, policy="bf16-mixed", device="cuda")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    return times


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 7
    load_before = os.getloadavg()
    _fresh(_COLD)  # fills the byte-code cache
    cold = _fresh(_COLD)
    warm = _warm(rounds, "--profile" in sys.argv)
    without, with_cb = [], []
    for _ in range(2):  # fresh processes, interleaved
        without.append(_fresh(_FIT, "0"))
        with_cb.append(_fresh(_FIT, "1"))
    load_after = os.getloadavg()
    print(f"cold: import castwise + first tiny audit in a fresh process: {cold:.2f}s")
    print(
        f"warm: tiny audit median of {rounds}: {statistics.median(warm):.3f}s (target <= 0.2s), best {min(warm):.3f}s"
    )
    b, c = statistics.median(without), statistics.median(with_cb)
    print(f"tiny Lightning fit start to first step: without {b:.2f}s, with CastwiseCallback {c:.2f}s")
    print(f"added by the callback: {c - b:.2f}s (target <= 1s)")
    print(f"load average: {load_before[0]:.2f} before, {load_after[0]:.2f} after ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
