"""The generator's side of a weight broadcast, alone: join the pair, receive what is announced, save it.

Run by ``tests/test_weight_broadcast.py`` as ``python weight_receiver.py PORT PREFIX DEVICE OUT_DIR``;
announcements come on stdin, one JSON line each ``[version, layout, bucket_bytes]`` (the pipe
message of :mod:`treerl.learners.async_generator`), and each version is saved as
``OUT_DIR/v{version}.safetensors``. An empty line ends it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import save_file

from treerl.learners.weight_broadcast import GroupAddress, WeightGroup


def main(port: str, prefix: str, device: str, out_dir: str) -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    group = WeightGroup(GroupAddress(int(port), prefix, backend, 60.0), rank=1, device=device)
    for line in sys.stdin:
        if not line.strip():
            break
        version, layout, bucket_bytes = json.loads(line)
        layout = [(name, tuple(shape), dtype) for name, shape, dtype in layout]
        state = group.receive(layout, version, bucket_bytes)
        # Saved as received: views into the buckets, copied out so each tensor owns its storage.
        save_file({k: v.cpu().clone() for k, v in state.items()}, str(Path(out_dir) / f"v{version}.safetensors"))
        print(version, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
