"""``python -m zeroflow.train`` with the save of one step held in flight (test only):

    python tests/hold_in_save.py STEP MARKER RELEASE [zeroflow.train arguments...]

When the background save of checkpoint STEP has written its files and is about to write their
digests, the file MARKER is created and that save waits until the file RELEASE exists; the
training thread goes on meanwhile. A test can then kill the run, or signal it, with that save
in flight.
"""
import sys
import time
from pathlib import Path

from zeroflow.engine import checkpoint_digests


def held_write_manifest(step: int, marker: Path, release: Path):
    plain = checkpoint_digests.write_manifest

    def write_manifest(folder, *args, **kwargs):
        if Path(folder).name == str(step):
            marker.touch()
            while not release.exists():
                time.sleep(0.01)
        return plain(folder, *args, **kwargs)

    return write_manifest


if __name__ == "__main__":
    checkpoint_digests.write_manifest = held_write_manifest(
        int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
    from zeroflow.cli.train import main

    sys.exit(main(sys.argv[4:]))
