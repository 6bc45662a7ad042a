"""Which worker failure the local backend reports when several ranks end at once."""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from kubetune.backends.local import root_failure


def _failure(rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="/nonexistent")
    failure.timestamp = timestamp  # as if read from the rank's error file
    return failure


@pytest.mark.parametrize(("failures", "expected"), [
    # rank 1 SIGKILLed (OOM killer): rank 0's gloo error was recorded earlier, then the agent's
    # teardown SIGTERMed it: rank 1 is the cause (the CI failure this test pins).
    ({1: (-signal.SIGKILL, 200), 0: (-signal.SIGTERM, 100)}, (1, -signal.SIGKILL)),
    ({1: (-signal.SIGKILL, 200), 0: (1, 100)}, (1, -signal.SIGKILL)),
    ({0: (-signal.SIGSEGV, 300), 1: (-signal.SIGKILL, 200)}, (0, -signal.SIGSEGV)),
    # Python errors in both: the earlier one caused the other's collective error.
    ({0: (1, 200), 1: (1, 100)}, (1, 1)),
    # a user error beside the teardown SIGTERM of its peer
    ({1: (2, 200), 0: (-signal.SIGTERM, 100)}, (1, 2)),
    # only teardown signals: the earliest
    ({0: (-signal.SIGTERM, 200), 1: (-signal.SIGTERM, 100)}, (1, -signal.SIGTERM)),
    ({3: (143, 100)}, (3, 143)),
])
def test_root_failure_prefers_the_cause_over_its_consequences(failures, expected):
    rank, failure = root_failure({r: _failure(r, code, ts) for r, (code, ts) in failures.items()})
    assert (rank, failure.exitcode) == expected
