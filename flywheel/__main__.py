"""`python -m flywheel ...` is the `flywheel` command; torchrun launches it this way:

    torchrun --nproc-per-node 4 -m flywheel train --config configs/train.toml --set dist.dp_shard=4
"""

import sys

from flywheel.cli import main

if __name__ == "__main__":  # not on import (tests walk every module)
    sys.exit(main())
