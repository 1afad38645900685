"""Rank program for `tests/test_nccl_bootstrap.py`: run with `mpirun -np N python tests/mpi_bootstrap_prog.py`.

Every rank builds the MPI process group, checks `allgather_object` / `broadcast_object` / `barrier`, exchanges an NCCL
unique id (no GPU needed) and checks `check_same` raises on EVERY rank when one rank differs. Checks never skip a
collective, so ranks stay in lockstep; a rank that saw a failure prints it and exits 1, else prints
`rank R/N: bootstrap OK`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepep_cupy.runtime.group import get_group  # noqa: E402
from deepep_cupy.runtime.nccl import exchange_unique_id  # noqa: E402


def main() -> int:
    group = get_group(timeout=60)
    rank, size = group.rank, group.size
    failures = []

    def check(ok: bool, what: str):
        if not ok:
            failures.append(what)

    check(group.backend == 'mpi', f'backend is {group.backend}, expected mpi')

    gathered = group.allgather_object({'rank': rank, 'square': rank * rank})
    check(gathered == [{'rank': r, 'square': r * r} for r in range(size)], f'allgather_object gave {gathered}')

    root = (size - 1) // 2
    value = group.broadcast_object(f'hello from {rank}' if rank == root else None, root=root)
    check(value == f'hello from {root}', f'broadcast_object gave {value!r}')
    group.barrier()

    uid = exchange_unique_id(group)
    check(len(uid) == 128, f'unique id has {len(uid)} bytes')
    ids = group.allgather_object(bytes(uid))
    check(all(i == ids[0] for i in ids), 'ranks hold different NCCL unique ids')

    # Same value everywhere: no rank raises. One rank differs: every rank raises.
    outcomes = []
    for num_bytes in (1 << 20, (1 << 20) + (rank == size - 1)):
        try:
            group.check_same('num_bytes', num_bytes)
            outcomes.append('ok')
        except ValueError as e:
            outcomes.append('raised' if 'num_bytes' in str(e) else f'raised without naming num_bytes: {e}')
    all_outcomes = group.allgather_object(outcomes)
    check(all(o == ['ok', 'raised'] for o in all_outcomes), f'check_same outcomes per rank: {all_outcomes}')

    group.barrier()
    if failures:
        print(f'rank {rank}/{size}: FAILED: ' + '; '.join(failures), flush=True)
        return 1
    print(f'rank {rank}/{size}: bootstrap OK', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
