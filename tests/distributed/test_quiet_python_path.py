"""A user's own script -- a plain LightningModule, torch's SGD, ``Trainer(strategy=MGPUStrategy(...))`` -- in a fresh
interpreter prints no warning the package causes or can avoid, and imports no library of a feature it did not ask
for (torchao is fp8's)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

from lightning_mgpu.testing import free_port

#: The user's script: 2 CPU processes (Lightning re-runs it for rank 1), ZeRO-3 (DeepSpeed's gathers and
#: reduce-scatters, its optimizer check), torch's SGD (not on DeepSpeed's list of tested optimizers).
SCRIPT = textwrap.dedent("""
    import sys
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_mgpu import MGPUStrategy


    class Plain(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, _index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    if __name__ == "__main__":
        torch.manual_seed(0)
        data = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=4)
        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=3, strategy=MGPUStrategy(zero_stage=3),
                            logger=False, enable_checkpointing=False)
        trainer.fit(Plain(), data)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "torchao" or m.startswith("lightning_mgpu.fp8"))
        print(f"steps {trainer.global_step} loaded {loaded}")
""")


def test_plain_module_prints_no_warning(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "DS_ACCELERATOR")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    run = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert output.count("steps 3 loaded []") == 2, output[-3000:]  # both ranks trained; neither imported torchao
    # a line as Python's warnings print them (FILE.py:LINE: ...), or one naming itself a warning (DeepSpeed's logger
    # prints "[WARNING]"): lightning_mgpu.harmless_warnings filters a few, saying why
    warned = [line for line in output.splitlines() if re.search(r"\.py:\d+: |warn|deprecat", line, re.I)]
    assert warned == [], warned
