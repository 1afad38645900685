"""Engram host storage (`runtime/host_storage.py`) on CPU: two ranks (threads of this process, a host group that
all-gathers between them) create, map and exchange their segments without CUDA (`register=False`): names unique per
buffer, the names gone once every rank has mapped, one rank's writes seen through the other's mapping, the memfd
fallback when /dev/shm cannot hold a segment, errors raised on every rank, and local teardown."""

import ctypes
import os
import threading

import pytest

from deepep_cupy.buffers.elastic import ElasticBuffer
from deepep_cupy.runtime import host_storage as hs
from deepep_cupy.runtime.group import ProcessGroup

MiB = 1 << 20


class ThreadGroup(ProcessGroup):
    """`size` ranks as threads: `allgather_object` meets at a barrier and returns every rank's object."""

    def __init__(self, rank, size, shared):
        super().__init__(rank, size)
        self.shared = shared

    def allgather_object(self, obj, timeout=None):
        slots, barrier = self.shared
        barrier.wait(timeout=30)
        slots[self.rank] = obj
        barrier.wait(timeout=30)
        out = list(slots)
        barrier.wait(timeout=30)
        return out


def run_ranks(size, fn):
    """Run `fn(group)` on `size` thread ranks; the results (or exceptions) by rank."""
    shared = ([None] * size, threading.Barrier(size))
    results = [None] * size

    def body(rank):
        try:
            results[rank] = fn(ThreadGroup(rank, size, shared))
        except BaseException as e:  # noqa: BLE001 (returned to the test)
            results[rank] = e
    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def shm_names():
    return {n for n in os.listdir(hs.SHM_DIR) if n.startswith(hs.NAME_PREFIX)} if os.path.isdir(hs.SHM_DIR) else set()


def test_two_ranks_share_segments():
    before = shm_names()

    def rank_fn(group):
        storage = hs.HostStorage(group, [0, 1], 2 * MiB, register=False)
        # Rank r writes r + 1 into the first byte of its own segment; each rank reads both through its mappings.
        ctypes.c_uint8.from_address(storage.base).value = group.rank + 1
        group.barrier()
        seen = [ctypes.c_uint8.from_address(a).value for a in storage.addrs]
        locators = [m.fd for m in storage.mappings]
        group.barrier()
        storage.release()
        return seen, locators, storage.addrs
    results = run_ranks(2, rank_fn)
    for r in results:
        assert not isinstance(r, BaseException), r
    assert results[0][0] == [1, 2] and results[1][0] == [1, 2]
    assert results[0][2] == [] and shm_names() == before          # released, and no name left behind


def test_segment_names_and_tokens():
    a, b = hs.new_token(), hs.new_token()
    assert a != b and a.startswith(f'{os.getpid():x}-')
    assert hs.segment_name(a, 3) == f'deepep_cupy-{a}-3'
    fd, locator = hs.create_segment(a, 0, 2 * MiB)
    try:
        assert locator in (('shm', hs.segment_name(a, 0)), ('memfd', os.getpid(), fd))
        with pytest.raises(FileExistsError):
            if locator[0] != 'shm':
                raise FileExistsError('memfd: no name')
            hs.create_segment(a, 0, 2 * MiB)
        assert os.fstat(fd).st_size == 2 * MiB
        peer = hs.open_segment(locator)
        os.close(peer)
    finally:
        os.close(fd)
        hs._unlink(locator)


def test_memfd_fallback_when_shm_is_missing(tmp_path):
    fd, locator = hs.create_segment(hs.new_token(), 0, 2 * MiB, shm_dir=str(tmp_path / 'missing'))
    try:
        assert locator == ('memfd', os.getpid(), fd) and os.fstat(fd).st_size == 2 * MiB
        other = hs.open_segment(locator)
        addr = hs._map(other, 2 * MiB)
        ctypes.c_uint32.from_address(addr).value = 0xDEADBEEF
        own = hs._map(fd, 2 * MiB)
        assert ctypes.c_uint32.from_address(own).value == 0xDEADBEEF
        hs._unmap(addr, 2 * MiB)
        hs._unmap(own, 2 * MiB)
        os.close(other)
    finally:
        os.close(fd)


def test_errors_reach_every_rank(monkeypatch):
    real = hs.open_segment

    def fail_for_rank_0(locator, shm_dir=hs.SHM_DIR):
        if locator[0] == 'shm' and locator[1].endswith('-0'):
            raise OSError(2, 'cannot open the host storage segment (test)')
        return real(locator, shm_dir)
    monkeypatch.setattr(hs, 'open_segment', fail_for_rank_0)
    before = shm_names()
    results = run_ranks(2, lambda g: hs.HostStorage(g, [0, 1], 2 * MiB, register=False))
    assert all(isinstance(r, RuntimeError) and 'rank 1: [Errno 2] cannot open' in str(r) for r in results), results
    assert shm_names() == before
    (error,) = run_ranks(1, lambda g: hs.HostStorage(g, [0], 1000, register=False))
    assert isinstance(error, ValueError) and 'page size' in str(error)


def test_sizes_must_agree():
    results = run_ranks(2, lambda g: hs.HostStorage(g, [0, 1], (g.rank + 1) * 2 * MiB, register=False))
    assert all(isinstance(r, ValueError) and 'num_cpu_bytes' in str(r) for r in results)


def test_elastic_buffer_checks_num_cpu_bytes_before_any_cuda():
    with pytest.raises(ValueError, match='num_cpu_bytes must be a multiple'):
        ElasticBuffer(num_bytes=8 * MiB, num_cpu_bytes=MiB)
    with pytest.raises(ValueError, match='at most num_bytes'):
        ElasticBuffer(num_bytes=4 * MiB, num_cpu_bytes=6 * MiB)
