"""Run by tests/test_hardening.py: ``treerl learn`` that stops for good while writing one checkpoint.

The checkpoint of step ``--hold-step`` is written for real into ``step-K.tmp`` (weights and
optimizer state); before its last files, this program prints ``HOLDING`` and sleeps, so that
the test can SIGKILL it there, as a machine or a scheduler would at any moment.

    python tests/programs/kill_during_checkpoint.py --hold-step 2 learn --output-dir runs/x ...
"""

import sys
import time

import torch

from treerl.cli import main

if __name__ == "__main__":
    hold_step = int(sys.argv[sys.argv.index("--hold-step") + 1])
    argv = [a for i, a in enumerate(sys.argv[1:], 1) if "--hold-step" not in (a, sys.argv[i - 1])]
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        if str(f).endswith(f"step-{hold_step}.tmp/optimizer.pt"):
            print("HOLDING", flush=True)
            time.sleep(3600)

    torch.save = save  # checkpoints.py calls torch.save by attribute, so this is the one it gets
    sys.exit(main(argv))
