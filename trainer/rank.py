"""`python -m trainer.rank config.json [--resume FILE | --warm FILE [--warm-optimizer]]`: one rank (not 0) of a
data-parallel run that rank 0 started (`trainer.distributed.local_ranks`).

It joins the group its environment describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: rank 0's
store; `trainer.distributed.join_parent`), trains the
config from the same start as rank 0 (a checkpoint file, read with `weights_only`), takes rank 0's verdict at every
evaluation, writes no checkpoint and talks to no driver. Its last line on stdout is its result as JSON (status,
steps), which rank 0 reads back.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path

from trainer.checkpoint import WarmStart, load_checkpoint
from trainer.config import TrainingConfig
from trainer.distributed import (
    DEFAULT_TIMEOUT_S,
    LOST_EXIT,
    collective_failed,
    die_with_parent,
    exit_process,
    join_parent,
)
from trainer.loop import NullReporter, train
from trainer.precision import resolve_device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.rank", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="the TrainingConfig as JSON")
    parser.add_argument("--resume", type=Path, help="continue from this checkpoint")
    parser.add_argument("--warm", type=Path, help="start from this checkpoint's weights")
    parser.add_argument("--warm-optimizer", action="store_true", help="and from its optimizer state")
    args = parser.parse_args(argv)
    die_with_parent()
    config = TrainingConfig.from_dict(json.loads(args.config.read_text()))
    resume = load_checkpoint(args.resume) if args.resume else None
    warm = WarmStart(load_checkpoint(args.warm), optimizer=args.warm_optimizer) if args.warm else None
    ranks = join_parent(float(os.environ.get("SWEEP_RANK_TIMEOUT_S", DEFAULT_TIMEOUT_S)),
                        device_type=resolve_device(config.device).type)
    try:
        result = train(config, reporter=NullReporter(), resume=resume, warm_start=warm, ranks=ranks)
    except Exception as exc:
        ranks.close()
        if not collective_failed(exc):
            raise
        traceback.print_exc()  # a peer died or did not answer (rank 0 busy past the timeout): the group's fault
        return LOST_EXIT
    except BaseException:
        ranks.close()
        raise
    print(json.dumps({"rank": ranks.rank, "status": result.status, "steps": result.steps}), flush=True)
    ranks.finish()
    return 0


if __name__ == "__main__":
    exit_process(main())  # the result is on stdout: past the interpreter's shutdown, where gloo may abort
