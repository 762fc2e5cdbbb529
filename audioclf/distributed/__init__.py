"""Everything that talks to torch.distributed or unwraps `.module` lives in this package.

group: process-group set-up and teardown (the launcher's ranks come from audioclf.distributed.launch);
wrapping: DDP / DataParallel / SyncBN; collectives: gathers that keep gradients, reductions,
rank 0 first; failures: the failure protocol between ranks; consistency: the parameter check.
Every function here that runs a collective says so: every rank must call it.
"""

from audioclf.distributed.collectives import (
    all_gather_nograd,
    all_gather_with_grad,
    all_reduce_max,
    all_reduce_sum,
    broadcast_object,
    gather_objects,
    gather_to_primary,
    primary_first,
    primary_only,
)
from audioclf.distributed.consistency import (
    ParameterDriftError,
    check_parameter_consistency,
)
from audioclf.distributed.failures import (
    PeerFailure,
    announce_failure,
    is_peer_failure,
    peer_failure,
)
from audioclf.distributed.group import (
    DistEnv,
    barrier,
    get_rank,
    get_world_size,
    is_initialized,
    process_group,
    setup,
    teardown,
)
from audioclf.distributed.wrapping import AutocastReplica, no_sync, unwrap, wrap

__all__ = [
    "AutocastReplica",
    "DistEnv",
    "ParameterDriftError",
    "PeerFailure",
    "all_gather_nograd",
    "all_gather_with_grad",
    "all_reduce_max",
    "all_reduce_sum",
    "announce_failure",
    "barrier",
    "broadcast_object",
    "check_parameter_consistency",
    "gather_objects",
    "gather_to_primary",
    "get_rank",
    "get_world_size",
    "is_initialized",
    "is_peer_failure",
    "no_sync",
    "peer_failure",
    "primary_first",
    "primary_only",
    "process_group",
    "setup",
    "teardown",
    "unwrap",
    "wrap",
]
