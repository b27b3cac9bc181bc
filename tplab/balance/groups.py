"""The world split into data-parallel (DP) groups of tensor-parallel (TP) ranks.

With K ranks and TP size t there are K / t groups; group g holds the consecutive ranks g·t .. g·t+t-1
(Megatron's layout: TP ranks are neighbours, so on a real machine they share a node's fast links). Each
group holds a TP copy of the model and serves its own requests; the groups never talk during a forward
pass, only to be told what to do next.

    K = 8, t = 2:   group 0: ranks 0 1 | group 1: ranks 2 3 | group 2: ranks 4 5 | group 3: ranks 6 7

Besides the TP communicator (``group``, used by the layers' collectives), two private copies carry the
control messages (which item next?) with a deadline: a rank waiting there polls and sleeps instead of
spinning, so on an oversubscribed laptop an idle rank does not steal the core of a busy one, and a lost
message becomes an error rather than a hang.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_made: dict = {}  # (id(comm), tp, timeout) -> DataParallelGroups: communicators are made once and kept


@dataclass
class DataParallelGroups:
    world: object  # the Communicator that was split
    tp: int  # ranks per group
    index: int  # my group
    count: int  # number of groups
    group: object  # my TP group: the model's collectives run here
    control: object  # private copy of world, with a deadline: work requests, barriers, gathering results
    group_control: object  # private copy of my group, with a deadline: the leader tells its group the item
    sharded: dict = field(default_factory=dict)  # id(model) -> (model, its TP copy on this group)

    @property
    def is_leader(self) -> bool:
        """The group's first rank talks to the dispatcher for the whole group."""
        return self.group.rank == 0

    @property
    def leaders(self) -> list[int]:
        return [g * self.tp for g in range(self.count)]

    def shard(self, model):
        """The TP copy of ``model`` on this group (made once per model, collective on the group). With
        tp = 1 the group is a plain data-parallel replica: the unsplit model itself, which skips the
        one-rank collectives (and their argument checks) a TP copy would still call."""
        from tplab.models import parallelize

        if self.tp == 1:
            return model
        key = id(model)
        if key not in self.sharded:
            self.sharded[key] = (model, parallelize(model, self.group))  # the model is kept: its id stays its own
        return self.sharded[key][1]


def _private_copy(comm, timeout):
    """A duplicate of ``comm`` (its own message space) whose blocking calls poll until ``timeout``."""
    return comm.with_timeout(timeout)


def data_parallel_groups(comm, tp: int, timeout: float = 600.0) -> DataParallelGroups:
    """Split ``comm`` into groups of ``tp`` consecutive ranks (collective; the same arguments everywhere).
    A clear error on every rank if ``tp`` does not divide the number of ranks."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, not {tp!r}")
    if comm.size % tp:
        raise ValueError(f"{comm.size} ranks cannot form data-parallel groups of tp = {tp} ranks "
                         f"(tp must divide the number of ranks)")
    key = (id(comm), tp, timeout)
    if key not in _made:
        index = comm.rank // tp
        control = _private_copy(comm, timeout)
        _made[key] = DataParallelGroups(
            world=comm, tp=tp, index=index, count=comm.size // tp,
            group=comm.split(color=index, key=comm.rank),
            control=control, group_control=control.split(color=index, key=comm.rank))
    return _made[key]
