"""How `make test` hands test files to its pytest-xdist workers (tests/conftest.py installs it).

xdist's `--dist loadfile`: one test file is one unit of work, so a module's expensive fixtures are
built once, in one worker. Two changes:

- The files that run a real Slurm cluster are one unit together: their daemons, ports and network
  namespaces cannot coexist.
- With three workers or more, the first takes that unit alone and then stops. The cluster's jobs
  spend most of their time waiting on the scheduler, a watchdog or a requeue, so the worker that
  drives them leaves the cores to the two that run everything else; with two workers it takes
  other files after the unit, as xdist would.
"""

from __future__ import annotations

from conftest import CLUSTER_MODULES
from xdist.scheduler import LoadFileScheduling

CLUSTER_UNIT = "real-slurm"
OWN_WORKER_FROM = 3  # workers: fewer, and the cluster's worker takes other files too


class FileScheduling(LoadFileScheduling):
    """`--dist loadfile`, the real-Slurm files one unit, given a worker of its own from three."""

    cluster_node = None

    def _split_scope(self, nodeid: str) -> str:
        path = super()._split_scope(nodeid)
        return CLUSTER_UNIT if path.rsplit("/", 1)[-1] in CLUSTER_MODULES else path

    def _assign_work_unit(self, node) -> None:
        alone = next(iter(self.workqueue)) == CLUSTER_UNIT and len(self.nodes) >= OWN_WORKER_FROM
        super()._assign_work_unit(node)
        if alone:  # nothing will follow: a worker runs its last test only once it knows that
            self.cluster_node = node
            node.shutdown()

    def _reschedule(self, node) -> None:
        if node is not self.cluster_node:
            super()._reschedule(node)
