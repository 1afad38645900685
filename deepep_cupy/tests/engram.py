"""Engram rank program: `engram_write` / `engram_fetch` checked against a host-gathered table, then timed.

    mpirun -np N python -m deepep_cupy.tests.engram [--num-entries 524288 --hidden 128 --num-tokens 512
        --num-entries-per-token 24 --use-fp8 --use-cpu-storage]

Every rank writes a random table; each rank fetches random global rows. The reference rows come through the host
process group (each owner ships the rows every rank asked it for), never from the code under test; data and scale
factors (FP8, row-major and TMA-aligned column-major) must match bit for bit, also with CuPy arrays and after a second
`engram_write` replaced every table. Invalid calls must raise before any kernel. Performance: the fetch kernel's GPU
time (issue), the hook's wait, the host time of the call, GB/s (`T * n * hidden * itemsize / time`) and million rows
per second, next to the peer-copy floor and an NCCL all-to-all moving the same cross-GPU bytes (one rank per GPU).

`--use-cpu-storage`: the tables live in pinned host memory shared by the ranks (`ElasticBuffer(num_bytes=gpu + cpu,
num_cpu_bytes=cpu)`); every check runs on that buffer, each fetch is also compared bit for bit with the same fetch
from a second buffer keeping the tables in GPU memory, and the perf lines show both paths in the same run.
"""

import sys
import time
from typing import List, Tuple

import numpy as np

from ..runtime import preflight
from . import cli

try:
    import torch
except ImportError as e:  # `--help` works without torch; a run names the extra that brings it
    preflight.exit_if_main(e, __name__, cli.engram_parser)
    raise

from ..features.engram.plan import storage_size_hint
from ..utils.testing import bench, bench_kineto
from .allocation import expect_error, log, make_buffer, nccl_all_to_all, peer_copy_floor, ranks_share_gpu
from .common import Failure, check, check_equal


def _bits(t: torch.Tensor) -> np.ndarray:
    """Raw bits of a CPU tensor as an integer numpy array (float8 and bfloat16 included)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).numpy()


def _from_bits(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).view(dtype)


def reference_rows(group, table_bits: np.ndarray, indices: np.ndarray, num_entries: int) -> np.ndarray:
    """`[T * n, row]` raw rows of this rank's indices, shipped by their owners through the host process group.

    Args:
        table_bits: this rank's `[num_entries, row]` table as integers.
        indices: this rank's `[T, n]` global indices.
    """
    everyone = group.allgather_object(indices.reshape(-1))
    me = group.rank
    shipped = [table_bits[idx[idx // num_entries == me] % num_entries] for idx in everyone]
    parts = group.allgather_object(shipped)          # parts[owner][requester]
    flat = indices.reshape(-1)
    out = np.empty((flat.size, table_bits.shape[1]), dtype=table_bits.dtype)
    for owner in range(group.size):
        out[flat // num_entries == owner] = parts[owner][me]
    return out


class EngramTest:
    def __init__(self, args, group):
        from ..utils.math import per_token_cast_to_fp8
        self.args, self.group = args, group
        self.rank, self.num_ranks = group.rank, group.size
        self.N, self.H, self.T, self.n = args.num_entries, args.hidden, args.num_tokens, args.num_entries_per_token
        self.dtype = torch.float8_e4m3fn if args.use_fp8 else torch.bfloat16
        gpu_bytes, cpu_bytes = storage_size_hint(self.N, self.H, self.T * self.n, self.dtype)
        self.hint = (gpu_bytes, cpu_bytes)
        # With --use-cpu-storage the buffer under test keeps the tables in host memory; `gpu_buf` (tables in GPU
        # memory) is the path every fetch is compared with, bit for bit, and timed beside.
        self.num_cpu_bytes = cpu_bytes if args.use_cpu_storage else 0
        self.buf = make_buffer(group, gpu_bytes + cpu_bytes, num_gpu_timeout_secs=args.num_gpu_timeout_secs,
                               num_cpu_bytes=self.num_cpu_bytes)
        self.gpu_buf = make_buffer(group, gpu_bytes + cpu_bytes, num_gpu_timeout_secs=args.num_gpu_timeout_secs) \
            if args.use_cpu_storage else None
        gen = torch.Generator(device='cuda').manual_seed(args.seed * 1000 + self.rank)
        bf16 = torch.randn((self.N, self.H), dtype=torch.float32, device='cuda', generator=gen).to(torch.bfloat16)
        self.sf = None
        if args.use_fp8:
            self.table, local_sf = per_token_cast_to_fp8(bf16)
            gathered = group.allgather_object(local_sf.cpu().numpy())
            self.sf = torch.from_numpy(np.concatenate(gathered)).cuda()
        else:
            self.table = bf16
        self.table_bits = _bits(self.table.cpu())
        self.indices = torch.randint(0, self.num_ranks * self.N, (self.T, self.n), dtype=torch.int32, device='cuda',
                                     generator=gen)
        self.ref = reference_rows(group, self.table_bits, self.indices.cpu().numpy(), self.N)

    def write(self, table, sf) -> None:
        self.buf.engram_write(table, sf=sf)
        if self.gpu_buf is not None:
            self.gpu_buf.engram_write(table, sf=sf)

    def check_fetch(self, what: str, data, sf, ref_rows: np.ndarray) -> None:
        T, n = self.T, self.n
        if self.gpu_buf is not None and tuple(data.shape) == (T, n * self.H):
            # The same fetch from GPU storage: host storage must give the same bits.
            gpu_data, gpu_sf = self.gpu_buf.engram_fetch(self.indices, use_tma_aligned_col_major_sf=True)()
            check_equal(data.cpu(), gpu_data.cpu(), f'{what}: host-storage data vs GPU-storage data')
            if sf is not None:
                check_equal(sf.cpu(), gpu_sf.cpu(), f'{what}: host-storage sf vs GPU-storage sf')
        check(tuple(data.shape) == (T, n * self.H), f'{what}: data shape {tuple(data.shape)}')
        check_equal(data.cpu(), _from_bits(ref_rows.reshape(T, -1), self.dtype), f'{what}: data')
        if self.sf is None:
            check(sf is None, f'{what}: sf must be None without scale factors')
            return
        want = self.sf.cpu()[self.indices.cpu().long().view(-1)].view(T, -1)
        check_equal(sf.cpu(), want, f'{what}: sf')

    def run_checks(self) -> int:
        from ..runtime.interop import to_cupy, to_torch
        self.write(self.table, self.sf)
        num_checked = 0
        for col_major in ((False, True) if self.sf is not None else (False,)):
            data, sf = self.buf.engram_fetch(self.indices, use_tma_aligned_col_major_sf=col_major)()
            self.check_fetch(f'fetch (column-major sf: {col_major})', data, sf, self.ref)
            if col_major:
                check(sf.stride() == (1, (self.T + 3) // 4 * 4), f'column-major sf strides {sf.stride()}')
            num_checked += 1
        # A small fetch on few blocks, and the same rows again (the table does not change between writes).
        data, sf = self.buf.engram_fetch(self.indices, num_qps=3, check_indices=False)()
        self.check_fetch('fetch on 3 blocks', data, sf, self.ref)
        head = self.indices[:1, :1].contiguous()
        data, _ = self.buf.engram_fetch(head)()
        check_equal(data.cpu(), _from_bits(self.ref[:1], self.dtype), 'single-row fetch')
        # CuPy in, CuPy out.
        data, sf = self.buf.engram_fetch(to_cupy(self.indices))()
        import cupy
        check(isinstance(data, cupy.ndarray), 'CuPy indices give CuPy data')
        self.check_fetch('CuPy fetch', to_torch(data, str(self.dtype).replace('torch.', '')),
                         None if sf is None else to_torch(sf), self.ref)
        num_checked += 4
        # Rewrite every table (each value's bits + 1 in the low byte): fetches must see the new tables.
        bumped_bits = self.table_bits.copy()
        bumped_bits.view(np.uint8)[..., 0::self.table_bits.itemsize] += 1
        bumped = _from_bits(bumped_bits, self.dtype).cuda()
        self.write(bumped, self.sf)
        ref = reference_rows(self.group, bumped_bits, self.indices.cpu().numpy(), self.N)
        data, sf = self.buf.engram_fetch(self.indices)()
        self.check_fetch('fetch after a second engram_write', data, sf, ref)
        self.write(self.table, self.sf)
        return num_checked + 1

    def run_errors(self) -> List[str]:
        tried = []
        idx, buf, R, N = self.indices, self.buf, self.num_ranks, self.N
        expect_error(tried, 'indices int64', TypeError, lambda: buf.engram_fetch(idx.long()))
        expect_error(tried, 'indices 1-D', ValueError, lambda: buf.engram_fetch(idx.view(-1)))
        expect_error(tried, 'indices non-contiguous', ValueError, lambda: buf.engram_fetch(idx.t()))
        expect_error(tried, 'index too large', ValueError, lambda: buf.engram_fetch(torch.full_like(idx, R * N)))
        expect_error(tried, 'negative index', ValueError, lambda: buf.engram_fetch(torch.full_like(idx, -1)))
        too_many = self.hint[0] // (self.H * self.table.element_size()) + 1
        expect_error(tried, 'more rows than the fetch area', ValueError,
                     lambda: buf.engram_fetch(torch.zeros((too_many, 1), dtype=torch.int32, device='cuda')))
        expect_error(tried, 'storage float32', TypeError, lambda: buf.engram_write(self.table.float()))
        bad = self.table[:, :self.H - 1] if self.H > 1 else self.table
        expect_error(tried, 'storage rows not contiguous', ValueError, lambda: buf.engram_write(bad))
        if self.num_ranks > 1:
            mine = self.table if self.rank else self.table[:-1]
            expect_error(tried, 'tables of different sizes', ValueError, lambda: buf.engram_write(mine, sf=self.sf))
        if self.sf is not None:
            expect_error(tried, 'sf of one rank only', ValueError,
                         lambda: buf.engram_write(self.table, sf=self.sf[:N]) if R > 1 else
                         buf.engram_write(self.table, sf=self.sf[:-1]))
        else:
            expect_error(tried, 'sf with a bfloat16 table', ValueError,
                         lambda: buf.engram_write(self.table, sf=torch.zeros((R * N, 1), device='cuda')))
        fresh = make_buffer(self.group, 2 << 20)
        try:
            expect_error(tried, 'fetch before any write', RuntimeError, lambda: fresh.engram_fetch(idx))
        finally:
            fresh.destroy()
        data, sf = buf.engram_fetch(idx)()
        self.check_fetch('fetch after the error cases', data, sf, self.ref)
        return tried

    def run_perf(self) -> Tuple[List[str], dict]:
        T, n, R, N = self.T, self.n, self.num_ranks, self.N
        row_bytes = self.H * self.table.element_size()
        num_bytes = T * n * row_bytes

        def fetch_and_wait(check_indices=True):
            self.buf.engram_fetch(self.indices, num_qps=self.args.num_qps, use_tma_aligned_col_major_sf=True,
                                  check_indices=check_indices)()

        kernel_t = bench_kineto(lambda: fetch_and_wait(False), 'engram_fetch_impl', barrier_comm_profiling=True,
                                barrier=self.buf.barrier)
        e2e = bench(fetch_and_wait, flush_l2=True).avg
        e2e_nocheck = bench(lambda: fetch_and_wait(False), flush_l2=True).avg
        torch.cuda.synchronize()
        issue, wait = [], []
        for _ in range(100):
            t0 = time.perf_counter()
            hook = self.buf.engram_fetch(self.indices, num_qps=self.args.num_qps, use_tma_aligned_col_major_sf=True)
            t1 = time.perf_counter()
            hook()
            issue.append(t1 - t0)
            wait.append(time.perf_counter() - t1)
        torch.cuda.synchronize()
        issue_us, wait_us = np.median(issue) * 1e6, np.median(wait) * 1e6
        where = 'host storage' if self.num_cpu_bytes else 'GPU storage'
        line = (f'[perf] rank {self.rank} ({where}): fetch kernel {kernel_t * 1e6:7.1f} us (issue), hook '
                f'{wait_us:5.1f} us (wait), host call {issue_us:6.1f} us | {num_bytes / kernel_t / 1e9:6.1f} GB/s, '
                f'{T * n / kernel_t / 1e6:7.1f} M rows/s | end-to-end {e2e * 1e6:7.1f} us with the index check, '
                f'{e2e_nocheck * 1e6:7.1f} us without ({num_bytes / e2e_nocheck / 1e9:6.1f} GB/s)')
        lines = [line]
        if self.gpu_buf is not None:
            gpu_t = bench_kineto(lambda: self.gpu_buf.engram_fetch(self.indices, num_qps=self.args.num_qps,
                                                                   use_tma_aligned_col_major_sf=True,
                                                                   check_indices=False)(),
                                 'engram_fetch_impl', barrier_comm_profiling=True, barrier=self.gpu_buf.barrier)
            lines.append(f'[perf] rank {self.rank} (GPU storage, same run): fetch kernel {gpu_t * 1e6:7.1f} us | '
                         f'{num_bytes / gpu_t / 1e9:6.1f} GB/s, {T * n / gpu_t / 1e6:7.1f} M rows/s | host storage '
                         f'takes {kernel_t / gpu_t:.2f} x the GPU-storage time')
        # Bytes that cross to this rank from each owner (remote rows only), for the same-bytes baselines.
        owners = self.indices.cpu().numpy().reshape(-1) // N
        recv = [int((owners == p).sum()) * row_bytes if p != self.rank else 0 for p in range(R)]
        everyone = self.group.allgather_object(recv)
        send = [everyone[p][self.rank] for p in range(R)]
        stats = {'kernel': kernel_t}
        if not self.args.skip_baselines and not ranks_share_gpu(self.buf):
            floor = peer_copy_floor(self.group, send, self.buf.num_device_sms)
            if floor is not None:
                line += f' | peer-copy floor (all SMs) {floor * 1e6:7.1f} us ({floor / kernel_t:.2f} x)'
            a2a = nccl_all_to_all(self.group, send, recv)
            line += f' | NCCL all-to-all {a2a * 1e6:7.1f} us ({a2a / kernel_t:.2f} x)'
            lines[0] = line
        return lines, stats

    def destroy(self) -> None:
        self.buf.destroy()
        if self.gpu_buf is not None:
            self.gpu_buf.destroy()


def main(argv=None) -> int:
    p = cli.engram_parser()
    args = p.parse_args(argv)
    preflight.check_cuda()

    from ..runtime.group import get_group
    from ..utils.envs import init_dist
    rank, num_ranks, _ = init_dist(seed=args.seed)
    group = get_group()  # host group: MPI under mpirun, else the torch world init_dist joined
    t0 = time.perf_counter()
    test = EngramTest(args, group)
    gpu_bytes, cpu_bytes = test.hint
    log(group, f'[init] {num_ranks} ranks, {test.buf.topology.num_ranks_per_gpu()} per GPU; {args.num_entries} entries '
               f'x {args.hidden} {"FP8" if args.use_fp8 else "BF16"} per rank; {args.num_tokens} tokens x '
               f'{args.num_entries_per_token} entries; storage hint gpu {gpu_bytes >> 20} MiB + cpu {cpu_bytes >> 20} '
               f'MiB ({"tables in pinned host memory" if args.use_cpu_storage else "both in GPU memory"}); set up in '
               f'{time.perf_counter() - t0:.2f} s')
    ok = True
    try:
        if not args.skip_check:
            n = test.run_checks()
            log(group, f'[check] {n} fetches bitwise equal to the host-gathered table')
        else:
            test.write(test.table, test.sf)
        if not args.skip_error_test:
            tried = test.run_errors()
            log(group, f'[errors] {len(tried)} invalid calls raised before any kernel ran; the buffer still works:')
            for line in tried:
                log(group, f'    {line}')
        if not args.skip_perf_test:
            lines, _ = test.run_perf()
            for rank_lines in group.allgather_object(lines):
                for line in rank_lines:
                    log(group, line)
    except Failure as e:
        print(f'[rank {rank}] FAILED: {e}', flush=True)
        ok = False
    test.destroy()
    ok = all(group.allgather_object(ok))
    log(group, 'engram test: PASSED' if ok else 'engram test: FAILED')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(preflight.run(main))
