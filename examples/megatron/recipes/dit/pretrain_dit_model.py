"""Pretrain a DiT with megatron-core.

torchrun --nproc-per-node N pretrain_dit_model.py --config-file conf/dit_tiny.yaml [--mock] [key=value ...]
"""

import logging
import sys

from dfm.config.cli import config_or_exit


def main(argv: list[str]) -> None:
    # Config errors (unknown keys, wrong types) exit here, before any process group starts.
    cfg, args = config_or_exit(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # it lists every parameter at INFO
    from dfm.training.pretrain import pretrain

    pretrain(cfg, mock=args.mock, explicit_keys=args.explicit_keys())


if __name__ == "__main__":  # dist_checkpointing starts worker processes: keep this guard
    main(sys.argv[1:])
