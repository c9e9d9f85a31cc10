"""A torchrun rank (`python -m phase1a.train.rank SETTINGS.json`): the settings the launcher wrote into the run's
directory (phase1a/train/runner.py), trained as one process of the group (phase1a/train/distributed.py)."""
from __future__ import annotations

import socket
import sys
from pathlib import Path

from phase1a.train import distributed
from phase1a.train.loop import train
from phase1a.train.settings import TrainSettings

ENTRY = ["-m", "phase1a.train.rank"]  # what torchrun runs on every rank: this module's __main__


def rank_settings(path: Path) -> TrainSettings:
    """A rank's settings, written by the launcher into the run's directory: a node that cannot see it does not
    share the launching host's filesystem."""
    if not path.is_file():
        raise FileNotFoundError(f"{socket.gethostname()}: {path} is not here: training on several nodes needs the "
                                "run's work_dir and cache_dir on a filesystem every node mounts at the same path")
    return TrainSettings.model_validate_json(path.read_text())


if __name__ == "__main__":  # a torchrun rank: python -m phase1a.train.rank SETTINGS.json
    distributed.run_rank(lambda: train(rank_settings(Path(sys.argv[1]))))
