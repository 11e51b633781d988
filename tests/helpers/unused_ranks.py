"""A rank of ``python -m ddp_utils train`` whose model has a parameter that no forward uses.

    python -m tests.helpers.unused_ranks TRAIN-FLAGS...

Registers the architecture ``spare_convnet`` (the kit's convnet and ``spare``, a Linear no forward uses) and runs
the kit's command line with the flags given (``--arch spare_convnet`` among them); exits with its exit code.
"""
from __future__ import annotations

import sys

from torch import nn

from ddp_utils import nets
from ddp_utils.architectures import ARCHITECTURES, Architecture
from ddp_utils.tools.cli import main


class SpareConvnet(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        self.net = nets.convnet(num_classes)
        self.spare = nn.Linear(4, 4)   # never used: its gradient stays None on every rank

    def forward(self, x):
        return self.net(x)


ARCHITECTURES["spare_convnet"] = Architecture(lambda classes, size: SpareConvnet(classes), "convnet and an unused "
                                              "Linear", default_size=32)

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
