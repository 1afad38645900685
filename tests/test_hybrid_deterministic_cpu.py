"""Hybrid `deterministic=True`: DeepEP's row order after a dispatch across domains.

DeepEP's `EPHandle.deterministic_sort` (deep_ep/buffers/elastic.py) sorts ALL received rows by src_token_global_idx
in one sort (expanded: each expert's rows), rewriting no count; the composed path's intranode engine gives them
grouped by source scale-up index. Checked here without a GPU:
- the kernel's plan (`plan.sort_transposition`, the host model of kernels_cu/hybrid.cu `hybrid_sort_plan`) is
  DeepEP's sort (`reference.deepep_deterministic_sort`, its host version) on the rows of the host reference of a
  hybrid dispatch, at N x R with R > 1 (where the orders differ) and R = 1 (where they agree), expanded or not, with
  the rows past the received count of a dispatch without CPU sync;
- DeepEP's order is `refs.dispatch_from_gathered` / `refs.expanded_layout`'s, which the GPU rank program
  (deepep_cupy/tests/ep_hybrid.py with --deterministic) compares every output with;
- `HybridEP` with a deterministic buffer: CPU versions of the four sort kernels run on the launches' own arguments
  (addresses resolved to the test's tensors), so the dispatch's outputs, the handle's metadata and combine's input
  to the intranode engine are checked value by value against DeepEP's sort; the asynchronous call sorts on the
  communication stream and returns an event recorded there; a bad combine input raises before any launch.
"""

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import fakes  # noqa: E402
import test_hybrid_feature_cpu as hf  # noqa: E402
from references import hybrid_reference as href  # noqa: E402

from deepep_cupy.features.hybrid import deterministic as hdet  # noqa: E402
from deepep_cupy.features.hybrid import feature as hfeature  # noqa: E402
from deepep_cupy.features.hybrid import kernels as hkernels  # noqa: E402
from deepep_cupy.features.hybrid import plan as hplan  # noqa: E402
from deepep_cupy.utils import refs  # noqa: E402


def make_job(N, R, M, K, E, seed, masked=0.2, empty_ranks=()):
    shape = href.HybridShape(N, R, E, M, K)
    rng = np.random.default_rng(seed)
    topks = []
    for g in range(N * R):
        T = 0 if g in empty_ranks else int(rng.integers(1, M + 1))
        t = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64) if T else \
            np.zeros((0, K), dtype=np.int64)
        t[rng.random(t.shape) < masked] = -1
        topks.append(t)
    return shape, topks


def inner_keys(shape, recv):
    """The composed path's intranode key of each row: (r * N + s) * M + t (forwarder r, source domain s)."""
    N, R, M = shape.num_domains, shape.num_scaleup_ranks, shape.num_max_tokens_per_rank
    return (recv.recv_src_rank % R * N + recv.recv_src_rank // R) * M + recv.recv_src_token_idx


SHAPES = [(2, 2, 16, 4, 16), (3, 2, 12, 3, 24), (2, 4, 10, 6, 32), (4, 2, 9, 2, 16), (2, 1, 12, 4, 8),
          (4, 1, 8, 3, 16)]


@pytest.mark.parametrize('N,R,M,K,E', SHAPES)
@pytest.mark.parametrize('alignment', [1, 4])
@pytest.mark.parametrize('tail', [0, 7])
def test_kernel_plan_is_deepep_sort(N, R, M, K, E, alignment, tail):
    """sort_transposition (the kernel's plan) gives DeepEP's permutation, rows and expanded rows; rows past the
    received count (`tail`: a dispatch without CPU sync) stay; the sorted order is refs' (source rank, token)."""
    shape, topks = make_job(N, R, M, K, E, seed=N * 100 + R * 10 + K, empty_ranks=(N * R - 1,))
    hd = href.dispatch(shape, topks, alignment, do_expand=True)
    rng = np.random.default_rng(7)
    moved_somewhere = False
    for d, recv in enumerate(hd.recv):
        n, lay = recv.layout.num_recv_tokens, recv.layout
        keys = np.concatenate([inner_keys(shape, recv), rng.integers(0, 2 ** 30, tail)])
        meta = np.concatenate([recv.recv_src_metadata, np.full((tail, K + 2), -1, dtype=np.int32)])
        meta[n:, 0] = rng.integers(0, 2 ** 30, tail)        # garbage past the count, as without CPU sync
        row_src, row_dst = hplan.sort_transposition(keys, [n], 1, n + tail, N, R, M)
        deepep = href.deepep_deterministic_sort(meta, n)
        assert np.array_equal(row_src, deepep.row_src), f'rank {d}: rows'
        assert np.array_equal(row_dst[row_src], np.arange(n + tail))
        assert np.array_equal(row_src[n:], np.arange(n, n + tail))
        g = recv.recv_src_rank * M + recv.recv_src_token_idx      # src_token_global_idx
        assert np.all(np.diff(g[row_src[:n]]) > 0), 'DeepEP: ascending src_token_global_idx = (source rank, token)'
        moved_somewhere |= not np.array_equal(row_src[:n], np.arange(n))

        # Expanded: one group per expert, the keys of each expanded row its receive row's
        exp_rows = lay.num_expanded_tokens + tail
        exp_keys = np.full(exp_rows, -1, dtype=np.int64)
        valid = recv.expanded_row_src >= 0
        exp_keys[:lay.num_expanded_tokens][valid] = keys[recv.expanded_row_src[valid]]
        exp_src, exp_dst = hplan.sort_transposition(exp_keys, lay.psum_num_recv_tokens_per_expert, alignment,
                                                    exp_rows, N, R, M)
        deepep_exp = href.deepep_deterministic_sort(meta, n, True, lay.psum_num_recv_tokens_per_expert,
                                                    lay.num_unaligned_recv_tokens_per_expert, exp_rows)
        assert np.array_equal(exp_src, deepep_exp.expanded_row_src), f'rank {d}: expanded rows'
        # Our handle's metadata: rows sorted as the non-expanded ones, columns 2.. DeepEP's remapped rows
        ours = meta[row_src].copy()
        ours[:, 2:] = np.where(ours[:, 2:] >= 0, exp_dst[np.maximum(ours[:, 2:], 0)], ours[:, 2:])
        assert np.array_equal(ours, deepep_exp.recv_src_metadata[row_src])

        # The rank program's references: refs.expanded_layout of the sorted rows is DeepEP's expanded order
        local = torch.from_numpy(recv.recv_topk_idx[row_src[:n]])
        ref_lay = refs.expanded_layout(local, shape.num_local_experts, alignment)
        recv_row_sorted = np.where(valid, row_dst[np.maximum(recv.expanded_row_src, 0)], -1)
        sorted_exp_src = recv_row_sorted[exp_src[:lay.num_expanded_tokens]]
        assert np.array_equal(sorted_exp_src, ref_lay.row_src.numpy())
        assert np.array_equal(ours[:n, 2:], ref_lay.topk_to_expanded_row.numpy())
    # The grouped order differs from DeepEP's exactly when a domain has several ranks
    assert moved_somewhere == (R > 1 and N > 1)


def test_grouped_order_differs_from_deepep_at_2x2():
    """The issue's case: at 2 x 2 the rows grouped by scale-up index are not in DeepEP's order (so a deterministic
    hybrid dispatch must move them), and DeepEP's psum per scale-up index still counts every source (*, r)."""
    shape, topks = make_job(2, 2, 8, 2, 8, seed=3, masked=0.0)
    recv = href.dispatch(shape, topks).recv[0]
    n = recv.layout.num_recv_tokens
    deepep = href.deepep_deterministic_sort(recv.recv_src_metadata, n)
    assert not np.array_equal(deepep.row_src, np.arange(n))
    per_rank = np.bincount(recv.recv_src_rank, minlength=4)
    assert recv.layout.psum_num_recv_tokens_per_scaleup_rank.tolist() == np.cumsum(
        [per_rank[0::2].sum(), per_rank[1::2].sum()]).tolist()


# ---- HybridEP with a deterministic buffer, the sort kernels run on the CPU -------------------------------------
class HostMemory:
    """Addresses of the test's CPU tensors as numpy views (every access range-checked against a known tensor)."""

    def __init__(self):
        self.tensors = []

    def add(self, t):
        self.tensors.append(t)
        return t

    def bytes(self, addr: int, num_bytes: int) -> np.ndarray:
        if num_bytes <= 0:
            return np.zeros(0, dtype=np.uint8)
        for t in self.tensors:
            s = t.untyped_storage()
            if s.data_ptr() <= addr and addr + num_bytes <= s.data_ptr() + s.nbytes():
                return np.ctypeslib.as_array((ctypes.c_uint8 * num_bytes).from_address(addr))
        raise AssertionError(f'address {addr:#x} (+{num_bytes} bytes) is in no tensor the test knows')

    def array(self, addr: int, dtype, count: int) -> np.ndarray:
        return self.bytes(addr, count * np.dtype(dtype).itemsize).view(dtype)


def cpu_kernels(mem: HostMemory):
    """CPU versions of kernels_cu/hybrid.cu hybrid_sort_* on the launches' arguments."""

    def keys(a):
        K, num_rows = a['num_topk'], a['num_rows']
        n = min(max(int(mem.array(a['num_recv'], np.int32, 1)[0]), 0), a['num_meta_rows'])
        meta = mem.array(a['meta'], np.int32, n * (K + 2)).reshape(n, K + 2)
        out = mem.array(a['keys'], np.int32, num_rows)
        slots = meta[:, 2:]
        ok = (slots >= 0) & (slots < num_rows)
        out[slots[ok]] = np.broadcast_to(meta[:, :1], slots.shape)[ok]

    def plan(a):
        rows, stride = a['num_rows'], a['key_stride']
        k = mem.array(a['keys'], np.int32, (rows - 1) * stride + 1)[::stride]
        ends = mem.array(a['group_end'], np.int32, a['num_groups'])
        src, dst = hplan.sort_transposition(k, ends, a['alignment'], rows, a['num_domains'],
                                            a['num_scaleup_ranks'], a['num_max_tokens'])
        mem.array(a['row_src'], np.int32, rows)[:] = src
        mem.array(a['row_dst'], np.int32, rows)[:] = dst

    def rows(a):
        n, cols, elem, rs, cs, mode = (a['num_rows'], a['num_cols'], a['elem_bytes'], a['row_stride'],
                                       a['col_stride'], a['mode'])
        span = ((n - 1) * rs + (cols - 1) * cs + 1) * elem
        src = mem.bytes(a['src'], span).reshape(-1, elem)
        dst = mem.bytes(a['dst'], span).reshape(-1, elem)
        index = mem.array(a['index'], np.int32, a['num_index']) if a['num_index'] else np.zeros(0, np.int32)
        c = np.arange(cols) * cs
        for j in range(n):
            i = int(index[j]) if j < a['num_index'] else j
            i = j if not 0 <= i < n else i
            if mode != 0 and i == j:
                continue
            dst[j * rs + c] = src[(j if mode == 2 else i) * rs + c]

    def meta(a):
        n, K, N, R, M = a['num_rows'], a['num_topk'], a['num_domains'], a['num_scaleup_ranks'], a['num_max_tokens']
        m = mem.array(a['meta'], np.int32, n * (K + 2)).reshape(n, K + 2)
        out = mem.array(a['out'], np.int32, n * (K + 2)).reshape(n, K + 2)
        src = mem.array(a['row_src'], np.int32, a['num_index'])
        i = np.array([src[j] if j < a['num_index'] else j for j in range(n)], dtype=np.int64)
        i = np.where((i < 0) | (i >= n), np.arange(n), i)
        v = m[i].copy()
        v[:, 0] = hplan.translate_src_index(v[:, 0].astype(np.int64), N, R, M)
        if a['exp_dst']:
            dst = mem.array(a['exp_dst'], np.int32, a['num_exp_rows'])
            cols = v[:, 2:]
            ok = (cols >= 0) & (cols < a['num_exp_rows'])
            cols[ok] = dst[cols[ok]]
        out[:] = v

    return {'sort_keys': keys, 'sort_plan': plan, 'sort_rows': rows, 'sort_meta': meta}


N, R, M, H, E = 2, 2, 12, 64, 16


class FakeInner:
    """The intranode engine: hands out prepared outputs in the grouped order (and records combine's input)."""

    def __init__(self):
        self.settings = SimpleNamespace(device=-1)
        self.out = None
        self.combined = []

    def _check_usable(self):
        pass

    def dispatch(self, *args, **kwargs):
        return self.out

    def combine(self, x, handle, topk_weights=None, **rest):
        self.combined.append((x.clone(), None if topk_weights is None else topk_weights.clone()))
        return torch.zeros((N * M, H), dtype=torch.bfloat16), torch.zeros((N * M, handle.num_topk)), None

    def destroy(self):
        pass


@pytest.fixture
def env(monkeypatch):
    streams = SimpleNamespace(current=fakes.FakeStream('current'))
    monkeypatch.setattr(hfeature.interop, 'current_stream', lambda like=None: streams.current)
    monkeypatch.setattr(hfeature, '_capturing', lambda like: False)
    monkeypatch.setattr(hfeature, 'EventHandle', lambda stream: ('event on', stream))
    monkeypatch.setattr(hfeature, 'EventOverlap',
                        lambda event, extra_tensors=None: SimpleNamespace(event=event, extra_tensors=extra_tensors))
    mem = HostMemory()
    real_empty, real_like = hdet._empty, hdet._empty_like
    monkeypatch.setattr(hdet, '_empty', lambda like, shape, dtype: mem.add(real_empty(like, shape, dtype)))
    monkeypatch.setattr(hdet, '_empty_like', lambda a: mem.add(real_like(a)))
    return SimpleNamespace(mem=mem, streams=streams)


def make_feature(env, num_topk, rank=0, deterministic=True):
    log = []
    run = cpu_kernels(env.mem)
    specs = {'route': hkernels.route_spec(4), 'pack': hkernels.pack_spec(4), 'report': hkernels.report_spec(),
             'unpack': hkernels.unpack_spec(4), 'combine_pack': hkernels.combine_pack_spec(),
             'combine_final': hkernels.combine_final_spec(4), 'sort_keys': hkernels.sort_keys_spec(),
             'sort_plan': hkernels.sort_plan_spec(), 'sort_rows': hkernels.sort_rows_spec(),
             'sort_meta': hkernels.sort_meta_spec()}
    kernels = SimpleNamespace(**{name: fakes.RecordingKernel(spec, log, run.get(name)) for name, spec in specs.items()})
    buf = fakes.make_buffer(num_ranks=N * R, rank=rank, num_scaleup_ranks=R, num_scaleout_ranks=N,
                            scaleup_rank_idx=rank % R, scaleout_rank_idx=rank // R, deterministic=deterministic)
    inner = FakeInner()
    feat = hfeature.HybridEP(buf, inner, M, H, num_topk, rails=hf.FakeRails(rank, N, R), kernels_of=lambda k: kernels,
                             host=fakes.FakeHostMapped())
    return feat, inner, log


def prepare(env, inner, K, do_expand, alignment, tail, fp8, rank=0, seed=1):
    """The intranode outputs of rank `rank` of a 2 x 2 job (the host reference's grouped order, which is the
    composed path's), random payloads; `tail` rows past the count (no CPU sync). Returns what DeepEP's sort makes of
    them: (expected outputs, DeepEP's `DeterministicSort`, row count)."""
    shape, topks = make_job(N, R, M, K, E, seed=seed)
    recv = href.dispatch(shape, topks, alignment, do_expand=do_expand).recv[rank]
    lay, n = recv.layout, recv.layout.num_recv_tokens
    rows = n + tail
    gen = torch.Generator().manual_seed(seed)
    meta = torch.full((rows, K + 2), -1, dtype=torch.int32)
    meta[:n, 0] = torch.from_numpy(inner_keys(shape, recv).astype(np.int32))
    meta[:n, 1] = torch.arange(n, dtype=torch.int32) + 1000
    if do_expand:
        meta[:n, 2:] = torch.from_numpy(recv.recv_src_metadata[:, 2:])
    meta[n:, 0] = torch.randint(0, 2 ** 30, (tail,), generator=gen, dtype=torch.int32)
    out_rows = (lay.num_expanded_tokens + tail) if do_expand else rows
    x = torch.randn((out_rows, H), generator=gen).to(torch.bfloat16)
    sf = None
    if fp8:
        x = torch.randn((out_rows, H), generator=gen).to(torch.float8_e4m3fn)
        padded = (out_rows + 3) // 4 * 4
        sf = torch.randn((2, padded), generator=gen)[:, :out_rows].t()       # column-major, TMA-aligned
        env.mem.add(sf)
    topk = None if do_expand else torch.randint(-1, 4, (rows, K), generator=gen, dtype=torch.int64)
    w = torch.randn((out_rows,) if do_expand else (rows, K), generator=gen)
    for t in (meta, x, topk, w):
        if t is not None:
            env.mem.add(t)
    psum_src = torch.from_numpy(lay.psum_num_recv_tokens_per_scaleup_rank.astype(np.int32))
    psum_exp = torch.from_numpy(lay.psum_num_recv_tokens_per_expert.astype(np.int32))
    unaligned = torch.from_numpy(lay.num_unaligned_recv_tokens_per_expert.astype(np.int32))
    for t in (psum_src, psum_exp):
        env.mem.add(t)
    handle = SimpleNamespace(do_expand=do_expand, expert_alignment=alignment, recv_src_metadata=meta,
                             psum_num_recv_tokens_per_scaleup_rank=psum_src, psum_num_recv_tokens_per_expert=psum_exp,
                             num_unaligned_recv_tokens_per_expert=unaligned, num_rows=out_rows, num_recv_tokens=rows,
                             num_topk=K)
    inner.out = ((x, sf) if fp8 else x), topk, w, handle, 'inner event'
    deepep_meta = meta.numpy().copy()
    deepep_meta[:n, 0] = recv.recv_src_rank * M + recv.recv_src_token_idx
    sort = href.deepep_deterministic_sort(deepep_meta, n, do_expand, lay.psum_num_recv_tokens_per_expert,
                                          lay.num_unaligned_recv_tokens_per_expert, out_rows)
    order = sort.expanded_row_src if do_expand else sort.row_src
    assert not np.array_equal(order, np.arange(order.size)), 'the test needs rows that DeepEP\'s sort moves'
    order = torch.from_numpy(order)
    expected = dict(x=x[order].clone(), sf=None if sf is None else sf[order].clone(), w=w[order].clone(),
                    topk=None if topk is None else topk[order].clone())
    return expected, sort, n


def _same(a, b):
    if a.dtype == torch.float8_e4m3fn:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize('do_expand,alignment', [(False, 1), (True, 1), (True, 4)])
@pytest.mark.parametrize('tail', [0, 5])
@pytest.mark.parametrize('K,fp8', [(4, False), (3, True)])
def test_deterministic_dispatch_and_combine(env, do_expand, alignment, tail, K, fp8):
    feat, inner, log = make_feature(env, K)
    expected, sort, n = prepare(env, inner, K, do_expand, alignment, tail, fp8)
    x_in = torch.zeros((2, H), dtype=torch.bfloat16)
    topk_in = torch.zeros((2, K), dtype=torch.int64)
    recv_x, recv_topk, recv_w, h, event = feat.dispatch(x_in, topk_in, None, num_experts=E, do_cpu_sync=False)
    sorts = [c for c in log if 'hybrid_sort' in c.name]
    assert sorts and all(c.stream is env.streams.current for c in sorts) and event == 'inner event'
    rx, rsf = recv_x if fp8 else (recv_x, None)
    assert _same(rx, expected['x']) and torch.equal(recv_w, expected['w'])
    if fp8:
        assert torch.equal(rsf, expected['sf'])
    if not do_expand:
        assert torch.equal(recv_topk, expected['topk'])
    # The handle's metadata: DeepEP's (rows sorted; expanded: its columns 2.., rows sorted as the plain ones)
    meta = h.recv_src_metadata.numpy()
    want = sort.recv_src_metadata if not do_expand else sort.recv_src_metadata[sort.row_src]
    assert np.array_equal(meta[:n], want[:n]) and np.all(np.diff(meta[:n, 0]) > 0)
    assert h.psum_num_recv_tokens_per_scaleup_rank is inner.out[3].psum_num_recv_tokens_per_scaleup_rank

    # Combine: the caller's rows (DeepEP's order) reach the intranode engine in its order
    rows = recv_x[0].shape[0] if fp8 else recv_x.shape[0]
    cx = env.mem.add(torch.randn((rows, H)).to(torch.bfloat16))
    cw = env.mem.add(torch.randn((rows,) if do_expand else (rows, K)))
    log.clear()
    feat.combine(cx, h, topk_weights=cw)
    assert [c.name for c in log][0] == 'deepep::hybrid_sort_rows'
    got_x, got_w = inner.combined[-1]
    to = torch.from_numpy(np.argsort(sort.expanded_row_src if do_expand else sort.row_src, kind='stable'))
    assert torch.equal(got_x, cx[to]) and torch.equal(got_w, cw[to])
    # and a cached dispatch sorts its outputs again (the intranode engine's cached rows are in its order)
    expected, _, _ = prepare(env, inner, K, do_expand, alignment, tail, fp8)
    again = feat.dispatch(x_in, handle=h)
    assert _same(again[0][0] if fp8 else again[0], expected['x'])


def test_async_dispatch_sorts_on_the_communication_stream(env, monkeypatch):
    # (the union's record_stream on the communication stream: no CUDA here)
    monkeypatch.setattr(hfeature.interop, 'torch_stream', lambda ptr: None)
    monkeypatch.setattr(torch.Tensor, 'record_stream', lambda self, stream: None)
    feat, inner, log = make_feature(env, 4)
    expected, _, _ = prepare(env, inner, 4, False, 1, 0, False)
    out = feat.dispatch(torch.zeros((2, H), dtype=torch.bfloat16), torch.zeros((2, 4), dtype=torch.int64), None,
                        num_experts=E, do_cpu_sync=False, async_with_compute_stream=True)
    comm = feat._buf.comm_stream
    assert all(c.stream is comm for c in log if 'hybrid_sort' in c.name)
    assert out[4].event == ('event on', comm) and out[4].extra_tensors      # recorded after the sort, keeps its arrays
    assert torch.equal(out[0], expected['x'])


def test_not_deterministic_or_one_rank_per_domain_moves_nothing(env):
    feat, inner, log = make_feature(env, 4, deterministic=False)
    prepare(env, inner, 4, False, 1, 0, False)
    h = feat.dispatch(torch.zeros((2, H), dtype=torch.bfloat16), torch.zeros((2, 4), dtype=torch.int64), None,
                      num_experts=E, do_cpu_sync=False)[3]
    assert not [c for c in log if 'hybrid_sort' in c.name] and h.sorted_rows is None


def test_bad_combine_input_raises_before_any_launch(env):
    feat, inner, log = make_feature(env, 4)
    prepare(env, inner, 4, False, 1, 0, False)
    out = feat.dispatch(torch.zeros((2, H), dtype=torch.bfloat16), torch.zeros((2, 4), dtype=torch.int64), None,
                        num_experts=E, do_cpu_sync=False)
    log.clear()
    rows = out[0].shape[0]
    with pytest.raises(ValueError, match='rows'):
        feat.combine(torch.zeros((rows + 1, H), dtype=torch.bfloat16), out[3])
    with pytest.raises(ValueError, match='topk_weights'):
        feat.combine(torch.zeros((rows, H), dtype=torch.bfloat16), out[3], topk_weights=torch.zeros((rows, 5)))
    assert not log
