"""Peer-copy floor and EP benchmark helpers, without a GPU: the kernel family compiles for sm_90, every launcher
declaration matches its kernel's C++ signature (checked by NVRTC with static_asserts), the launcher validates its
arguments, and the benchmark's byte counts are right."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from deepep_cupy.buffers import shipped
from deepep_cupy.features import peer_copy
from deepep_cupy.jit import compiler, launch
from deepep_cupy.runtime import workspace
from deepep_cupy.utils import bench_bytes

ROOT = Path(__file__).resolve().parents[1]

# C++ spelling (kernels_cu/common/types.cuh typedefs resolve to these) of each numpy scalar kind a Param may have.
_CPP_TYPES = {'int8': 'signed char', 'uint8': 'unsigned char', 'int16': 'short', 'uint16': 'unsigned short',
              'int32': 'int', 'uint32': 'unsigned int', 'int64': 'long long', 'uint64': 'unsigned long long',
              'float32': 'float', 'float64': 'double'}
_PROBE_HELPERS = '''
namespace probe {
template <typename T> struct is_ptr { static constexpr bool value = false; };
template <typename T> struct is_ptr<T*> { static constexpr bool value = true; };
template <typename A, typename B> struct same { static constexpr bool value = false; };
template <typename A> struct same<A, A> { static constexpr bool value = true; };
template <int I, typename H, typename... T> struct nth { using type = typename nth<I - 1, T...>::type; };
template <typename H, typename... T> struct nth<0, H, T...> { using type = H; };
template <typename F> struct sig;
template <typename... A> struct sig<void(A...)> {
    static constexpr int arity = sizeof...(A);
    template <int I> using arg = typename nth<I, A...>::type;
};
}  // namespace probe
'''


def signature_probe(family: str, specs) -> str:
    """A translation unit that includes the family and static_asserts, for every spec, the parameter count and, per
    parameter, pointer-ness (`'ptr'`) or the exact scalar type the launcher will pass. Parameter names are checked
    too: the launchers bind arguments by name, so a name must be the C++ parameter's (the signature's names are read
    from the source by `declared_names` and compared in `compile_probe`)."""
    lines = [f'#include "{family}.cu"', _PROBE_HELPERS]
    for spec in specs:
        sig = f'probe::sig<decltype({spec.name})>'
        lines.append(f'static_assert({sig}::arity == {len(spec.params)}, '
                     f'"{spec.name}: the launcher declares {len(spec.params)} parameters");')
        for i, p in enumerate(spec.params):
            arg = f'{sig}::template arg<{i}>'
            if p.kind == launch.PTR:
                lines.append(f'static_assert(probe::is_ptr<{arg}>::value, '
                             f'"{spec.name}: parameter {i} ({p.name}) is declared a pointer");')
            else:
                cpp = _CPP_TYPES[np.dtype(p.kind).name]
                lines.append(f'static_assert(probe::same<{arg}, {cpp}>::value, '
                             f'"{spec.name}: parameter {i} ({p.name}) is declared {cpp}");')
    return '\n'.join(lines) + '\n'


def declared_names(family: str, kernel: str):
    """The parameter names of `kernel` (a name expression, e.g. `deepep::notify_dispatch<2, 8>`) as defined in the
    translation unit of `kernels_cu/<family>.cu`, in order (read by tools/kernel_interfaces.py)."""
    from test_kernel_interfaces_cpu import ki
    qualname, _ = ki.split_name_expression(kernel)
    found = ki.parse(family).kernels.get(qualname)
    assert found, f'{kernel}: no definition in {family}.cu or its includes'
    return [p.name for p in found[0].params]


def compile_probe(family: str, specs) -> None:
    """Check the declarations of `specs` against the kernels of `family`: names and order (from the source), count,
    pointer-ness and exact scalar types (static_asserts compiled by NVRTC; `decltype` of each specialisation needs
    its declaration only, so nothing is instantiated and the probe compiles in about a second)."""
    from cupy.cuda import compiler as cupy_compiler
    prog = cupy_compiler._NVRTCProgram(signature_probe(family, specs), f'probe_{family}.cu', method='ptx')
    try:
        prog.compile(compiler._options('90', {}, ()))
    except cupy_compiler.CompileException as e:
        raise AssertionError(str(e)) from None
    for spec in specs:
        names = declared_names(family, spec.name)
        assert list(spec.param_names) == names, f'{spec.name}: declared {list(spec.param_names)}, kernel has {names}'


def test_peer_copy_family_compiles_for_sm90():
    specs = shipped.shipped_specs()['peer_copy']
    assert [s.name for s in specs] == [f'deepep::peer_copy_kernel<{n}>' for n in range(1, 9)]
    module = compiler.compile_cubin('peer_copy', [s.name for s in specs], arch='90', use_cache=False)
    assert module.cubin[:4] == b'\x7fELF' and set(module.lowered) == {s.name for s in specs}


def _one_spec_per_family():
    """The peer-copy specs, plus one representative specialisation of every other shipped family."""
    out = []
    for family, specs in sorted(shipped.shipped_specs().items()):
        if family == 'peer_copy':
            out.append((family, specs))
        else:
            names = {s.name for s in specs}
            pick = [s for s in specs if '<2, 8' in s.name] or [s for s in specs if '<2>' in s.name] or specs[:1]
            pick += [s for s in specs if ('<' not in s.name or 'value_range' in s.name) and s not in pick]   # shared
            assert {s.name for s in pick} <= names
            out.append((family, pick))
    return out


_FAMILY_CASES = _one_spec_per_family()


@pytest.mark.parametrize('family, specs', _FAMILY_CASES, ids=[family for family, _ in _FAMILY_CASES])
def test_launcher_declarations_match_kernel_signatures(family, specs):
    compile_probe(family, specs)


def test_signature_probe_catches_a_wrong_declaration():
    from dataclasses import replace
    spec = peer_copy.peer_copy_spec(2)
    rank = spec.params[3]
    assert rank.name == 'rank'
    with pytest.raises(AssertionError, match='parameters'):
        compile_probe('peer_copy', [replace(spec, params=spec.params[:-1])])
    with pytest.raises(AssertionError, match=r'parameter 3 \(rank\) is declared long long'):
        compile_probe('peer_copy', [replace(spec, params=spec.params[:3] + (launch.Param('rank', np.int64),)
                                            + spec.params[4:])])
    with pytest.raises(AssertionError, match=r'parameter 0 \(src\) is declared unsigned long long'):
        compile_probe('peer_copy', [replace(spec, params=(launch.Param('src', np.uint64),) + spec.params[1:])])
    # Two parameters of one type swapped: the types pass, the names do not (launches bind by name).
    swapped = spec.params[:4] + (spec.params[5], spec.params[4]) + spec.params[6:]
    assert swapped[4].kind == swapped[5].kind
    with pytest.raises(AssertionError, match=r"declared \[.*'recv_stride', 'recv_offset'.*kernel has"):
        compile_probe('peer_copy', [replace(spec, params=swapped)])


def test_peer_copy_control_region_is_documented_in_the_kernel():
    source = (compiler.kernels_dir() / 'peer_copy.cu').read_text()
    assert 'kPeerCopyCtrlOffset = kWsPeerCopyOffset;' in source
    assert 'kPeerCopyCtrlBytes = kWsPeerCopyBytes;' in source
    assert f'kPeerCopyThreads = {peer_copy.THREADS}' in source
    # Its region of the workspace map (common/workspace.cuh), clear of the EP control area and the notify counts.
    assert (peer_copy.CTRL_OFFSET, peer_copy.CTRL_BYTES) == workspace.PEER_COPY
    assert workspace.EP_CTRL.end <= peer_copy.CTRL_OFFSET and peer_copy.CTRL_OFFSET + peer_copy.CTRL_BYTES <= 65536


class _FakeSym:
    num_peers, local_idx, num_bytes, peer_bases_ptr = 2, 0, 64 << 20, 0x1000


class _FakeKernel:
    """`prepare` with the real launcher's named signature; argument kinds and count must match the spec (the byte
    counts stand in for a device array here)."""

    def __init__(self):
        self.prepare = launch.named_launcher(peer_copy.peer_copy_spec(2), self._prepare, with_stream=False,
                                             what='prepare')

    def _prepare(self, grid, block, args, shared_mem=0, cooperative=False):
        launch.pack_args(peer_copy.peer_copy_spec(2), (args[0], 0x3000, *args[2:]))
        self.grid, self.block, self.args = grid, block, args
        return lambda stream: None


@pytest.fixture()
def fake_peer_copy(monkeypatch):
    monkeypatch.setattr(peer_copy, 'load_kernels', lambda specs: {specs[0].name: _FakeKernel()})
    # No GPU here: the per-peer byte counts stay a numpy array instead of being uploaded.
    import cupy
    monkeypatch.setattr(cupy, 'asarray', lambda a: a)
    return peer_copy.PeerCopy(_FakeSym(), 0x2000, 10 ** 9)


def test_peer_copy_prepare_checks_and_packs_arguments(fake_peer_copy, monkeypatch):
    from deepep_cupy.runtime import interop
    info = interop.TensorInfo('cupy', 0x10000, (4096,), (1,), 'uint8', 0, None)
    monkeypatch.setattr(interop, 'tensor_info', lambda x, name='tensor': info)
    offset = 2 * 1024 * 1024
    src = 0x10000
    run = fake_peer_copy.prepare(src, [999_999 * 16, 256 * 16], offset, 8192, 24)
    kernel = fake_peer_copy.kernel
    assert callable(run) and kernel.grid == 24 and kernel.block == peer_copy.THREADS
    assert list(kernel.args[1]) == [0, 4096]          # own entry zeroed
    for send, match in (([16, 16, 16], 'send_bytes'), ([0, 17], 'send_bytes'), ([0, 8192 + 16], 'src holds')):
        with pytest.raises(ValueError, match=match):
            fake_peer_copy.prepare(src, send, offset, 8192, 24)
    with pytest.raises(ValueError, match='recv_stride'):
        fake_peer_copy.prepare(src, [0, 4096], offset, 2048, 24)
    with pytest.raises(ValueError, match='must lie in'):
        fake_peer_copy.prepare(src, [0, 4096], 16384, 8192, 24)        # inside the workspace
    with pytest.raises(ValueError, match='must lie in'):
        fake_peer_copy.prepare(src, [0, 4096], (64 << 20) - 8192, 8192, 24)
    with pytest.raises(ValueError, match='num_sms'):
        fake_peer_copy.prepare(src, [0, 4096], offset, 8192, 0)


# ---- benchmark byte counts -----------------------------------------------------------------------------------------


def test_tokens_per_rank_counts_each_destination_once():
    # 8 experts over 2 ranks (experts 0-3 on rank 0, 4-7 on rank 1).
    topk_idx = np.array([[0, 1, 2],      # rank 0 only (three experts there: counted once)
                         [0, 4, -1],     # both ranks
                         [5, 6, 7],      # rank 1 only
                         [-1, -1, -1],   # nowhere
                         [3, -1, 4]])    # both
    assert bench_bytes.tokens_per_rank(topk_idx, 8, 2) == [3, 3]
    assert bench_bytes.tokens_per_rank(topk_idx, 8, 4) == [2, 2, 3, 1]
    assert bench_bytes.tokens_per_rank(np.zeros((0, 3), dtype=np.int64), 8, 2) == [0, 0]
    with pytest.raises(ValueError):
        bench_bytes.tokens_per_rank(topk_idx, 9, 2)
    with pytest.raises(ValueError):
        bench_bytes.tokens_per_rank(topk_idx + 8, 8, 2)


def test_tokens_per_rank_matches_gate_counter():
    torch = pytest.importorskip('torch')
    from deepep_cupy.utils.gate import count_tokens_per_rank
    g = torch.Generator().manual_seed(0)
    topk_idx = torch.randint(-1, 256, (500, 8), generator=g)
    assert bench_bytes.tokens_per_rank(topk_idx, 256, 8) == count_tokens_per_rank(topk_idx, 256, 8).tolist()


def test_bytes_per_token_formulas():
    # BF16: hidden + int64 ids + float32 weights; FP8: hidden bytes + 56 float32 scales + the same metadata.
    assert bench_bytes.dispatch_bytes_per_token(7168, 2, 0, 8) == 14336 + 96
    assert bench_bytes.dispatch_bytes_per_token(7168, 1, 56, 8) == 7168 + 224 + 96
    assert bench_bytes.combine_bytes_per_token(7168) == 14336


def test_traffic_per_peer_and_direction():
    rows = [[10, 7, 0],     # rank 0 dispatches 10 tokens to itself, 7 to rank 1, none to rank 2
            [3, 4, 5],
            [1, 0, 2]]
    d = bench_bytes.traffic(rows, 1, 100)
    assert d.send_bytes == [304, 0, 512]            # 3 and 5 rows, rounded up to 16 bytes
    assert d.recv_bytes == [704, 0, 0]
    assert d.logical_bytes == (7 + 4 + 0) * 100     # every received row, own ones included
    assert d.cross_bytes == 816
    c = bench_bytes.traffic(rows, 1, 100, reverse=True)
    assert c.send_bytes == [704, 0, 0]              # the rows received from rank 0 go back to it
    assert c.recv_bytes == [304, 0, 512]
    assert c.logical_bytes == d.logical_bytes
    with pytest.raises(ValueError):
        bench_bytes.traffic([[1, 2]], 0, 16)


# ---- the benchmark script itself (import only: no GPU, no MPI) ------------------------------------------------------


def _load_bench():
    spec = importlib.util.spec_from_file_location('ep_bench', ROOT / 'perf' / 'ep_bench.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_rows_and_targets_from_synthetic_results():
    bench = _load_bench()
    ours = {'dispatch': {'us': 180.0}, 'combine': {'us': 200.0}, 'check': {'dispatch_equals_refs': True,
                                                                            'combine_equals_refs': True}}
    case = {'num_tokens': 4096, 'dtype': 'bf16', 'num_sms_arg': 24, 'num_sms': 24, 'ours': ours,
            'floor': {'dispatch': {'us': 160.0}, 'combine': {'error': 'x'}},
            'refs': {'dispatch': {'us': 1170.0}, 'combine': {'us': 950.0}},
            'floor_all_sms': {'dispatch': {'us': 150.0}, 'combine': {'us': 170.0}},
            'a2a': {'dispatch': {'us': 240.0}, 'combine': {'us': 230.0}}}
    bench.summarize(case, case, ours, {'dispatch': (58.5e6, 58.3e6), 'combine': (58.5e6, 58.3e6)})
    assert ours['dispatch']['gbs'] == pytest.approx(58.5e6 / 180.0 / 1e3)
    assert ours['dispatch']['x_floor'] == pytest.approx(180 / 160)
    assert ours['dispatch']['refs_speedup'] == pytest.approx(1170 / 180)
    assert ours['combine']['x_floor'] is None and ours['combine']['x_floor_all_sms'] == pytest.approx(200 / 170)
    text = bench.row_text(case)
    assert text.startswith('  4096  bf16  24 |') and text.endswith('| ok') and '1.12' in text
    targets = {name: met for name, _, _, met in bench.targets_report([case], {'dispatch': {'us_median': 18.0}})}
    assert targets['4096 bf16 24 SMs dispatch x_floor'] and targets['4096 bf16 24 SMs dispatch refs_speedup']
    assert not targets['4096 bf16 24 SMs combine x_floor'] and targets['decode dispatch us']
    assert not targets['4096 bf16 24 SMs dispatch x_floor_all_sms']      # 180 / 150 > 1.15
    assert not targets['decode combine us']
