"""One rank of ``kubetune eval --procs N`` (started by torch's elastic launcher, as torchrun starts one):
joins the process group, evaluates its share, and rank 0 writes the results where it is told.

    python -m kubetune.evaluation.worker PARAMS.json     (RANK, WORLD_SIZE, MASTER_ADDR, ... from the launcher)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # before the imports below (torch: seconds), as kubetune.pod.worker does
    from kubetune.lifetime import PARENT_PID_ENV, die_with_parent

    die_with_parent(int(os.environ.get(PARENT_PID_ENV, 0)) or None)  # a killed `kubetune eval` takes its ranks

from kubetune import distributed  # noqa: E402
from kubetune.errors import USER_ERROR_EXIT, KubetuneError  # noqa: E402
from kubetune.evaluation.harness import evaluate  # noqa: E402


def main(argv: list[str]) -> int:
    import torch

    params = json.loads(Path(argv[0]).read_text())
    out = Path(params.pop("out"))
    env = distributed.read_env()
    device = torch.device("cuda", env.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # the cores shared out, as `kubetune run` does
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, env.local_world_size)))
    distributed.setup(env, device)
    try:
        results = evaluate(**params, rank=env.rank, world_size=env.world_size)
    except KubetuneError as e:
        print(f"[rank {env.rank}] error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    finally:
        distributed.teardown()
    if env.rank == 0:
        tmp = out.with_suffix(".partial")
        tmp.write_text(json.dumps(results, default=str))
        tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
