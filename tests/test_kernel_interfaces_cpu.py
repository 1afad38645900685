"""Every kernel interface against its one source of truth, the C++ signature, without a compiler
(tools/kernel_interfaces.py): each `KernelSpec` the package ships has its kernel in its family's translation unit
(template instantiations as the JIT's name expressions spell them), with the same parameters (names, order, pointer
or exact scalar type); every `KernelSpec(...)` in the package is shipped, every kernel has a spec; the limits of
deepep_cupy/constants.py and the constants the Python side mirrors equal the kernels' `constexpr`s and are defined
once; and the parser reads the C++ it must (comments, templates, qualifiers, macros, includes) and reports what
differs by kernel, position and both sides."""

import ast
import importlib.util
import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from deepep_cupy import constants
from deepep_cupy.buffers import shipped
from deepep_cupy.features import hybrid, ll, peer_copy
from deepep_cupy.features.agrs import bucket as bucket_kernels
from deepep_cupy.features.agrs import kernels as agrs_kernels
from deepep_cupy.features.engram import plan as engram_plan
from deepep_cupy.features.ep import fused as ep_fused
from deepep_cupy.features.ep import kernels as ep_kernels
from deepep_cupy.features.ep import layout as ep_layout
from deepep_cupy.features.hybrid import kernels as hybrid_kernels
from deepep_cupy.features.lb import plan as lb_plan
from deepep_cupy.features.pp import plan as pp_plan
from deepep_cupy.jit import launch
from deepep_cupy.runtime import errors, host_range

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    if 'kernel_interfaces' not in sys.modules:
        spec = importlib.util.spec_from_file_location('kernel_interfaces', ROOT / 'tools' / 'kernel_interfaces.py')
        module = importlib.util.module_from_spec(spec)
        sys.modules['kernel_interfaces'] = module
        spec.loader.exec_module(module)
    return sys.modules['kernel_interfaces']


ki = _tool()
SHIPPED = shipped.shipped_specs()


# ---- the package's kernels -------------------------------------------------------------------------------------------
def test_every_shipped_spec_matches_its_kernel():
    count, problems = ki.check_all(SHIPPED)
    assert count == sum(len(v) for v in SHIPPED.values()) >= 460
    assert problems == [], '\n'.join(problems)


def test_every_kernel_spec_of_the_package_is_shipped():
    """A spec built anywhere in the package makes name expressions the shipped set holds (so the check above saw it)."""
    names = [s.name for specs in SHIPPED.values() for s in specs]
    sites = ki.spec_sites()
    assert len(sites) >= 50
    for path, line, pattern in sites:
        assert pattern is not None, f'{path}:{line}: a KernelSpec whose name expression is not a literal or f-string'
        assert any(re.fullmatch(pattern, n) for n in names), f'{path}:{line}: {pattern} is not among the shipped specs'


# `.cu` files no shipped spec names, with the reason (a file of kernels is expected to be wired, or listed here).
_UNWIRED = {'testing': 'utils/testing.py launches sleep_cycles through CuPy\'s RawModule (a helper beside the library)',
            'legacy_internode': 'V1 internode kernels, their declarations being written'}


def test_every_kernel_has_a_spec():
    """Every kernel of a family's own file is declared by a shipped spec; a file no spec names is listed above."""
    declared = {s.name.split('<')[0] for specs in SHIPPED.values() for s in specs}
    for family in SHIPPED:
        src = ki.parse(family)
        own = {name for name, kernels in src.kernels.items() if kernels[0].path == f'{family}.cu'}
        assert own - declared == set(), f'{family}.cu: kernels without a KernelSpec'
    unwired = {p.stem for p in ki.KERNELS.glob('*.cu')} - set(SHIPPED)
    assert unwired <= set(_UNWIRED), f'kernel files no KernelSpec names: {sorted(unwired - set(_UNWIRED))}'
    assert set(ki.kernels_in_tree()) - declared >= {'sleep_cycles'}


def test_the_ll_and_peer_copy_kernels_are_read_as_declared():
    # Spot checks that the parser reads what the NVRTC probe (tests/test_peer_copy.py) compiles.
    src = ki.parse('ep_ll')
    kernel, = src.kernels['deepep::ll::dispatch']
    assert kernel.template == (('int', 'kNumRanks', False),)
    assert [p.name for p in kernel.params] == list(ll.dispatch_spec(2).param_names)
    kernel, = ki.parse('peer_copy').kernels['deepep::peer_copy_kernel']
    assert [(p.name, p.pointer) for p in kernel.params][:4] == [('src', True), ('send_bytes', True),
                                                                 ('peer_bases', True), ('rank', False)]
    assert ki.scalar_name(src.resolve(kernel.params[-1].base)) == 'uint64'


# ---- limits and mirrored constants ---------------------------------------------------------------------------------
# (Python value, C++ constexpr, family whose translation unit defines it)
_MIRRORS = [
    (constants.NUM_MAX_SCALEUP_RANKS, 'kNotifyMaxRanks', 'ep_notify'),
    (constants.NUM_MAX_LOCAL_EXPERTS, 'kNotifyMaxLocalExperts', 'ep_notify'),
    (ep_kernels.NUM_MAX_CHANNELS, 'kNotifyMaxChannels', 'ep_notify'),
    (ep_kernels.HOST_MAX_TOKENS_WORD, 'kHostMaxTokensWord', 'ep_notify'),
    (ep_kernels.NOTIFY_THREADS, 'kNotifyThreads', 'ep_notify'),
    (ep_layout.NOTIFY_TOKENS_PER_BLOCK, 'kNotifyThreads', 'ep_notify'),
    (ep_kernels.DISPATCH_THREADS, 'kDispatchThreads', 'ep_dispatch'),
    (ep_kernels.PHASE_SEND, 'kPhaseSend', 'ep_dispatch'),
    (ep_kernels.PHASE_RECV, 'kPhaseRecv', 'ep_dispatch'),
    (ep_kernels.COMBINE_CHUNK_SIGNAL_BYTES, 'kChunkSignalBytes', 'ep_combine'),
    (ep_kernels.DISPATCH_CHUNK_SIGNAL_BYTES, 'kDispatchSignalBytes', 'ep_dispatch'),
    (ep_fused.FUSED_MAX_COUNT_BLOCKS, 'kFusedMaxCountBlocks', 'ep_fused'),
    (errors.AUX_RAIL_READY, 'kAuxRailReady', 'ep_dispatch'),
    (host_range.RANGE_THREADS, 'kRangeThreads', 'ep_notify'),
    (hybrid_kernels.THREADS, 'kHybridThreads', 'hybrid'),
    (hybrid_kernels.ROUTE_THREADS, 'kHybridRouteThreads', 'hybrid'),
    (hybrid_kernels.MAX_DOMAINS, 'kHybridMaxDomains', 'hybrid'),
    (hybrid_kernels.MAX_SIGNALS, 'kHybridMaxSignals', 'hybrid'),
    (hybrid_kernels.MAX_SORT_RUNS, 'kHybridMaxRuns', 'hybrid'),
    (ll.THREADS, 'kThreads', 'ep_ll'),
    (ll.SEG_CHANNELS, 'kSegChannels', 'ep_ll'),
    (ll.CONTROL_BYTES, 'kControlBytes', 'ep_ll'),
    (ll.CTL_MASK_WORD, 'kCtlMask', 'ep_ll'),
    (agrs_kernels.THREADS, 'kAgrsThreads', 'agrs'),
    (agrs_kernels.GATHER_UNROLL, 'kAgrsGatherUnroll', 'agrs'),
    (agrs_kernels.GATHER_BATCH, 'kAgrsGatherBatch', 'agrs'),
    (agrs_kernels.MAX_GATHERS_PER_SESSION, 'kAgrsMetaSlots', 'agrs'),
    (agrs_kernels.MAX_SENDERS, 'kAgrsMaxSenders', 'agrs'),
    (bucket_kernels.THREADS, 'kBucketThreads', 'bucket'),
    (bucket_kernels.CONTEXT_BYTES, 'kBucketContextBytes', 'bucket'),
    (bucket_kernels.BARRIER_OFFSET, 'kBucketBarrierOffset', 'bucket'),
    (engram_plan.THREADS, 'kEngramThreads', 'engram'),
    (engram_plan.UNROLL, 'kEngramUnroll', 'engram'),
    (engram_plan.LAYER_WORDS, 'kEngramLayerWords', 'engram'),
    (lb_plan.THREADS, 'kLBThreads', 'lb'),
    (lb_plan.CHUNK_BYTES, 'kLBChunkVectors * 16', 'lb'),
    (peer_copy.THREADS, 'kPeerCopyThreads', 'peer_copy'),
    (pp_plan.THREADS, 'kPPThreads', 'pp'),
    (pp_plan.UNROLL, 'kPPUnroll', 'pp'),
    (pp_plan.HEADER_BYTES, 'kPPHeaderBytes', 'pp'),
    (pp_plan.ERROR_WORDS, 'kPPErrorWords', 'pp'),
]


@pytest.mark.parametrize('value, name, family', _MIRRORS, ids=[m[1] for m in _MIRRORS])
def test_python_constants_equal_the_kernels(value, name, family):
    src = ki.parse(family)
    words = ki.tokenize_words(name)
    cpp = src.constant(name) if len(words) == 1 else ki._evaluate(words, src.constants)
    assert cpp == value, f'{name} = {cpp} in {family}.cu, the Python side has {value}'


def test_topk_buckets_are_the_kernels_template_values():
    """The kMaxTopk of every shipped EP and hybrid specialisation is a bucket, and every bucket ships."""
    assert constants.NUM_MAX_TOPK == max(constants.TOPK_BUCKETS)
    assert [constants.topk_bucket(k) for k in (1, 3, 8, 9, 32)] == [1, 4, 8, 16, 32]
    with pytest.raises(ValueError, match=r'num_topk must be in \[1, 32\], got 33'):
        constants.topk_bucket(33)
    for family, position in (('ep_notify', 1), ('ep_dispatch', 1), ('ep_fused', 1), ('ep_combine', 1), ('hybrid', 0)):
        src = ki.parse(family)
        used = set()
        for spec in SHIPPED[family]:
            qualname, args = ki.split_name_expression(spec.name)
            kernel, = src.kernels[qualname]
            if kernel.template and any(name == 'kMaxTopk' for _, name, _ in kernel.template):
                assert kernel.template[position][1] == 'kMaxTopk', spec.name
                used.add(int(args[position]))
        assert used == set(constants.TOPK_BUCKETS), family


_LIMITS = ('NUM_MAX_SCALEUP_RANKS', 'NUM_MAX_LOCAL_EXPERTS', 'NUM_MAX_TOPK', 'TOPK_BUCKETS', 'SF_GROUP',
           'DEFAULT_NVLINK_GBS', 'BUFFER_ALIGNMENT')
# Files that still define a limit of their own, with the reason (remove an entry once its file imports the table).
_NOT_YET = {('deepep_cupy/v1/buffer.py', 'DEFAULT_NVLINK_GBS'): 'owned by the V1 work in progress'}


def test_the_shared_limits_are_defined_once():
    """No module but constants.py assigns a shared limit a value (the others import it)."""
    found = []
    for path in sorted((ROOT / 'deepep_cupy').rglob('*.py')):
        rel = str(path.relative_to(ROOT))
        if rel == 'deepep_cupy/constants.py':
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Name) and t.id in _LIMITS and (rel, t.id) not in _NOT_YET:
                    found.append(f'{rel}:{node.lineno}: {t.id}')
    assert found == [], f'define these in deepep_cupy/constants.py and import them: {found}'


# ---- the parser ------------------------------------------------------------------------------------------------------
_CU = r'''
// a comment naming __global__ void fake(int x)
#include "common/types.cuh"
#define DEEPEP_RESTRICT __restrict__
namespace deepep {
namespace inner {
typedef unsigned int word_t;
using count_t = long long;
constexpr int kBase = 4, kMax = kBase * (1 << 3) + 1;
constexpr float kScale = 1e-4f;
template <typename T> struct is_ptr { static constexpr bool value = false; };
template <typename T>
__device__ __forceinline__ T twice(T a) { return a + a; }

template <int kNumRanks, bool kFlag, typename T>
__global__ void __launch_bounds__(kMax, 1)
kernel_a(const T* DEEPEP_RESTRICT values /* [n] */, T scalar, word_t w,   // trailing comment, with, commas
         count_t n, const uint8_t* const __restrict__ bytes, bool* flags, float scale, unsigned long long big,
         int32_t arr[]) {
    if (n > 0) { values = nullptr; }
}
}  // namespace inner

__global__ void plain(void) {}
}  // namespace deepep

extern "C" __global__ void c_kernel(long long cycles, signed char c) {}
'''


@pytest.fixture
def tree(tmp_path):
    (tmp_path / 'common').mkdir()
    (tmp_path / 'common' / 'types.cuh').write_text((ki.KERNELS / 'common' / 'types.cuh').read_text())
    (tmp_path / 'fam.cu').write_text(_CU)
    return tmp_path


def _spec(name, *params):
    return launch.KernelSpec('fam', name, tuple(launch.Param(n, k) for n, k in params))


_GOOD = (('values', launch.PTR), ('scalar', np.int64), ('w', np.uint32), ('n', np.int64), ('bytes', launch.PTR),
         ('flags', launch.PTR), ('scale', np.float32), ('big', np.uint64), ('arr', launch.PTR))


def test_the_parser_reads_templates_qualifiers_macros_and_includes(tree):
    src = ki.parse('fam', tree)
    assert src.files == ['fam.cu', 'common/types.cuh']
    assert set(src.kernels) == {'deepep::inner::kernel_a', 'deepep::plain', 'c_kernel'}
    kernel, = src.kernels['deepep::inner::kernel_a']
    assert kernel.template == (('int', 'kNumRanks', False), ('bool', 'kFlag', False), ('typename', 'T', False))
    assert [p.name for p in kernel.params] == [n for n, _ in _GOOD]
    assert src.constant('kMax') == 33 and src.constant('kScale') == pytest.approx(1e-4)
    assert 'value' not in src.constants               # a struct member, not at namespace scope
    assert ki.check_spec(_spec('deepep::inner::kernel_a<8, true, long long>', *_GOOD), src) == []
    assert ki.check_spec(_spec('deepep::plain'), src) == []
    assert ki.check_spec(_spec('c_kernel', ('cycles', np.int64), ('c', np.int8)), src) == []


def test_the_check_names_kernel_position_and_both_sides(tree):
    src = ki.parse('fam', tree)
    expr = 'deepep::inner::kernel_a<8, true, long long>'

    def problems(*params, name=expr):
        return '\n'.join(ki.check_spec(_spec(name, *params), src))

    swapped = _GOOD[:2] + (_GOOD[3], _GOOD[2]) + _GOOD[4:]
    assert 'parameter 2: spec n: int64, C++ w: word_t (uint32)' in problems(*swapped)
    # the typename argument decides a scalar's type
    assert 'parameter 1: spec scalar: int64, C++ scalar: T (int32)' in problems(*_GOOD, name=expr.replace(
        'long long', 'int'))
    assert 'parameter 0: spec values: int64, C++ values: const T* __restrict__ (ptr)' in problems(
        ('values', np.int64), *_GOOD[1:])
    assert 'parameter 6: spec scale: float64, C++ scale: float (float32)' in problems(
        *_GOOD[:6], ('scale', np.float64), *_GOOD[7:])
    assert 'declares 8 parameters, the kernel has 9' in problems(*_GOOD[:-1])
    assert 'parameter 8: spec (none), C++ arr: int32_t' in problems(*_GOOD[:-1])
    assert '2 template arguments, the kernel takes 3' in problems(*_GOOD, name='deepep::inner::kernel_a<8, true>')
    assert "template argument 1 (bool kFlag) got '1'" in problems(*_GOOD, name='deepep::inner::kernel_a<8, 1, int>')
    assert "template argument 0 (int kNumRanks) got 'true'" in problems(
        *_GOOD, name='deepep::inner::kernel_a<true, true, int>')
    assert 'is not a template' in problems(name='deepep::plain<2>')
    assert "no __global__ deepep::kernel_a in fam.cu or its includes (found ['deepep::inner::kernel_a'])" in \
        problems(*_GOOD, name='deepep::kernel_a<8, true, int>')


def test_the_check_catches_a_drifted_shipped_declaration():
    spec = peer_copy.peer_copy_spec(2)
    src = ki.parse('peer_copy')
    assert ki.check_spec(spec, src) == []
    swapped = spec.params[:4] + (spec.params[5], spec.params[4]) + spec.params[6:]
    assert ki.check_spec(replace(spec, params=swapped), src)[0].startswith(
        'deepep::peer_copy_kernel<2> (peer_copy.cu:')
    rank = replace(spec, params=spec.params[:3] + (launch.Param('rank', np.int64),) + spec.params[4:])
    assert ki.check_spec(rank, src) == [
        f'deepep::peer_copy_kernel<2> (peer_copy.cu:{src.kernels["deepep::peer_copy_kernel"][0].line}): '
        'parameter 3: spec rank: int64, C++ rank: int (int32)']


def test_an_unnamed_parameter_is_refused(tmp_path):
    (tmp_path / 'bad.cu').write_text('__global__ void k(int a, float) {}\n')
    with pytest.raises(ValueError, match=r'bad.cu:1: k: parameter `float` has no name'):
        ki.parse('bad', tmp_path)


def test_the_tool_runs_as_a_script(capsys):
    assert ki.main([]) == 0
    out = capsys.readouterr().out
    assert re.search(r'^\d+ specs of \d+ kernels in \d+ families checked against kernels_cu/: 0 mismatches$', out, re.M)


def test_hybrid_package_ships_no_reference_of_the_fused_design():
    # The fused design's host references live beside their tests (tests/references/); the package keeps P1 only.
    names = {p.stem for p in Path(hybrid.__file__).parent.glob('*.py')}
    assert not names & {'reference', 'combine_reference', 'messages', 'layout'}
