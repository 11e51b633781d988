"""``python -m tests.helpers.stopped_run train ...``: the kit's command, stopped right after epoch 2's checkpoint (Stop
in both notebooks, both nodes lost, a spot instance taken): a module, so that the test fork server starts it (a
``python -c`` would import torch afresh)."""
import sys

from ddp_utils import checkpoint
from ddp_utils.tools import cli

real = checkpoint.save_state


def save_state(paths, loop):
    real(paths, loop)
    if loop.epoch == 1:
        raise KeyboardInterrupt


if __name__ == "__main__":
    checkpoint.save_state = save_state
    sys.exit(cli.main(sys.argv[1:]))
