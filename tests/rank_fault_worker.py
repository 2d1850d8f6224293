"""Run under torchrun by tests/test_distributed.py: `gpt2train train ARGS...` in which rank 1 dies (SIGKILL) or
hangs when it is about to train step STEP; the other rank must say so in one line and exit. With `signal`,
rank 0 gets a SIGINT and rank 1 a SIGTERM then: both must save that step and exit alike.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/rank_fault_worker.py kill|hang|signal STEP \
        --config tiny.toml --out RUN_DIR
"""

from __future__ import annotations

import os
import signal
import sys
import time

from gpt2train import cli
from gpt2train.training.loop import Trainer


def main():
    fault, at_step, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    train_step = Trainer.train_step

    def faulty_train_step(self):
        if fault == "signal" and self.state.step + 1 == at_step:
            os.kill(os.getpid(), signal.SIGTERM if self.dist.rank == 1 else signal.SIGINT)
        elif self.dist.rank == 1 and self.state.step + 1 == at_step:
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            # Hung: it never reaches the next collective. The launcher's SIGTERM (once the other rank has
            # exited) ends it at once, as it would a process stuck in C code after its SIGKILL 30 s later.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(600)
        return train_step(self)

    Trainer.train_step = faulty_train_step
    sys.exit(cli.main(["train", *argv]))


if __name__ == "__main__":
    main()
