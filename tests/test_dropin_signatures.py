"""Signature parity of `deepep_cupy.utils` with DeepEP's `deep_ep.utils` (V2.0, the HEAD era, and V2.5's additions),
checked against a table written down by hand from DeepEP's sources: for every public function, its parameters in
order with their kind and default. Ours must have the same names in the same order with the same kinds and defaults;
it may add trailing optional parameters, and where DeepEP has no default ours may have one only where `RELAXED` says
so (a caller passing the argument cannot tell)."""

import importlib
import inspect

import pytest

REQ = inspect.Parameter.empty          # no default
P, VAR, KW = 'pos', 'var', 'kw'        # positional-or-keyword, *args, keyword-only


def sig(*params):
    """(name, default) or (name, default, kind) tuples."""
    return tuple(p if len(p) == 3 else (p[0], p[1], P) for p in params)


# module -> {function (or Class.method) -> parameters}; `self` left out of methods.
DEEPEP = {
    'envs': {
        'init_seed': sig(('global_seed', REQ)),
        'get_local_seed': sig(),
        'get_global_seed': sig(),
        'dist_print': sig(('s', ''), ('once_in_node', False)),
        'init_dist': sig(('local_rank', REQ), ('num_local_ranks', REQ), ('seed', 0)),
        'get_physical_domain_size': sig(('group', REQ)),
        'get_logical_domain_size': sig(('group', REQ), ('allow_hybrid_mode', True)),
        'check_nvlink_connections': sig(('group', REQ)),
        'check_torch_deterministic': sig(),
        'get_nvlink_gbs': sig(('factor', 0.9)),
        'check_fast_rdma_atomic_support': sig(('nic_name', 'mlx5_0')),
        'get_rdma_gbs': sig(('nic_name', 'mlx5_0')),
        'get_sm_read_gbs': sig(),                                        # V2.5
        'get_sm_write_gbs': sig(),                                       # V2.5
        'EnvOverride.__init__': sig(('envs', REQ)),                      # V2.5
        'EnvOverride.__enter__': sig(),
        'EnvOverride.__exit__': sig(('_', REQ, VAR)),
    },
    'testing': {
        'flush_l2_cache': sig(('enabled', True)),
        'bench': sig(('fn', REQ), ('num_warmups', 50), ('num_tests', 50), ('post_fn', None), ('flush_l2', True)),
        'bench_kineto': sig(('fn', REQ), ('kernel_names', REQ), ('num_tests', 30), ('suppress_kineto_output', False),
                            ('trace_path', None), ('flush_l2', True), ('barrier_comm_profiling', False),
                            ('num_kernels_per_period', 1), ('barrier', None)),
        'empty_suppress.__enter__': sig(),
        'empty_suppress.__exit__': sig(('_', REQ, VAR)),
        'suppress_stdout_stderr.__enter__': sig(),
        'parse_num_bytes': sig(('text', REQ)),                            # V2.5
    },
    'gate': {
        'generate_topk_idx': sig(('rank_count', REQ), ('num_tokens', REQ), ('num_experts', REQ), ('num_ranks', REQ),
                                 ('num_topk', REQ)),
        'generate_rank_count': sig(('num_tokens', REQ), ('num_experts', REQ), ('num_ranks', REQ), ('num_topk', REQ),
                                   ('ratio', REQ)),
        'get_precise_unbalanced_scores': sig(('num_tokens', REQ), ('num_experts', REQ), ('num_ranks', REQ),
                                             ('num_topk', REQ), ('ratio', REQ)),
        'get_scores_by_factor': sig(('num_tokens', REQ), ('num_experts', REQ), ('num_ranks', REQ), ('factor', REQ)),
        'map_unbalanced_ratio_to_factor': sig(('num_tokens', REQ), ('num_experts', REQ), ('num_ranks', REQ),
                                              ('num_topk', REQ), ('ratio', REQ)),
        'get_random_unbalanced_scores': sig(('num_tokens', REQ), ('num_experts', REQ), ('num_ranks', REQ),
                                            ('num_topk', REQ), ('ratio', REQ)),
        'get_unbalanced_scores': sig(('num_tokens', REQ), ('num_experts', REQ), ('num_ranks', REQ), ('num_topk', REQ),
                                     ('ratio', REQ), ('precise', REQ)),
    },
    'refs': {
        'dispatch': sig(('x', REQ), ('topk_idx', REQ), ('topk_weights', REQ), ('num_max_tokens_per_rank', REQ),
                        ('num_experts', REQ)),
        'generate_pre_combine_data': sig(('src_token_global_idx', REQ), ('num_max_tokens_per_rank', REQ),
                                         ('num_topk', REQ), ('hidden', REQ)),
        'ordered_accumulate': sig(('data', REQ), ('initial_value', None)),
        'combine': sig(('y', REQ), ('topk_idx', REQ), ('num_scaleout_ranks', REQ), ('num_scaleup_ranks', REQ),
                       ('num_experts', REQ), ('bias', REQ), ('reduce_in_local', REQ), ('reduce_in_scaleup', REQ)),
    },
    'math': {
        'calc_diff': sig(('x', REQ), ('y', REQ)),
        'safe_div': sig(('a', REQ), ('b', REQ)),
        'ceil_div': sig(('x', REQ), ('y', REQ)),
        'align': sig(('x', REQ), ('y', REQ)),
        'per_token_cast_to_fp8': sig(('x', REQ)),
        'per_token_cast_back': sig(('x_fp8', REQ), ('x_scales', REQ)),
        'inplace_unique': sig(('x', REQ), ('num_slots', REQ)),
        'create_grouped_scores': sig(('scores', REQ), ('group_idx', REQ), ('num_groups', REQ)),
        'hash_tensor': sig(('t', REQ)),
        'hash_tensors': sig(('tensors', REQ, VAR)),
        'count_bytes': sig(('tensors', REQ, VAR)),
    },
    'event': {
        'EventOverlap.__init__': sig(('event', None), ('extra_tensors', None)),
        'EventOverlap.current_stream_wait': sig(('release_handle', False)),
        'EventOverlap.register_hook_after_wait': sig(('hook_after_wait', REQ)),
        'EventOverlap.__call__': sig(('release_handle', False)),
        'EventOverlap.__enter__': sig(),
        'EventOverlap.__exit__': sig(('exc_type', REQ), ('exc_val', REQ), ('exc_tb', REQ)),
        'EventOverlap.wait': sig(),                                      # V2.5
        'EventHandle.__init__': sig(),                                   # C++: EventHandle()
    },
    'semantic': {
        'value_or': sig(('value', REQ), ('default', REQ)),
        'weak_lru': sig(('maxsize', 128), ('typed', False)),
    },
    'comm': {   # V2.0 deep_ep.utils.comm; V2.5 moved it (plus the rest below) to deep_ep.comm
        'NCCLCommHandle.__init__': sig(('nccl_comm', REQ), ('managed', REQ)),
        'NCCLCommHandle.get': sig(),
        'get_nccl_comm_handle': sig(('group', REQ), ('force_new_comm', False)),
        'destroy_all_managed_nccl_comm': sig(),
        'barrier': sig(('buffer', REQ), ('wait_comm_stream', True), ('with_cpu_sync', False), ('sequential', True),
                       ('context_idx', None)),
        'get_comm_stream': sig(('buffer', REQ)),
        'get_physical_domain_size': sig(('group_or_buffer', REQ)),
        'get_logical_domain_size': sig(('group_or_buffer', REQ), ('allow_hybrid_mode', None)),
    },
}

# Where DeepEP has no default and ours has one, on purpose.
RELAXED = {
    ('envs', 'init_dist', 'local_rank'): 'None: the launcher form (torchrun, mpirun, SLURM) joins the launched job',
    ('envs', 'init_dist', 'num_local_ranks'): 'None: the launcher form',
    ('envs', 'get_physical_domain_size', 'group'): 'None: the job get_group() finds',
    ('envs', 'get_logical_domain_size', 'group'): 'None: the job get_group() finds',
    ('gate', 'get_unbalanced_scores', 'ratio'): '1.0: balanced',
    ('gate', 'get_unbalanced_scores', 'precise'): 'False: random mode',
    ('refs', 'dispatch', 'topk_weights'): 'still required positionally; None is accepted (no weights)',
    ('refs', 'combine', 'bias'): 'None',
    ('refs', 'combine', 'reduce_in_local'): 'True: the non-hybrid combine',
    ('refs', 'combine', 'reduce_in_scaleup'): 'False',
}

# Defaults that differ between DeepEP versions: ours must be one of them.
VERSION_DEFAULTS = {('testing', 'bench', 'num_warmups'): (50, 30), ('testing', 'bench', 'num_tests'): (50, 30)}

KINDS = {inspect.Parameter.POSITIONAL_OR_KEYWORD: P, inspect.Parameter.POSITIONAL_ONLY: P,
         inspect.Parameter.VAR_POSITIONAL: VAR, inspect.Parameter.KEYWORD_ONLY: KW,
         inspect.Parameter.VAR_KEYWORD: 'varkw'}


def resolve(module, name):
    obj = importlib.import_module(f'deepep_cupy.utils.{module}')
    for part in name.split('.'):
        obj = getattr(obj, part)
    return obj


def ours(module, name):
    params = list(inspect.signature(resolve(module, name)).parameters.values())
    if '.' in name and params and params[0].name == 'self':
        params = params[1:]
    return params


CASES = [(m, f) for m, table in DEEPEP.items() for f in table]


@pytest.mark.parametrize('module,name', CASES, ids=[f'{m}.{f}' for m, f in CASES])
def test_signature_matches_deepep(module, name):
    pytest.importorskip('torch')
    want = DEEPEP[module][name]
    got = ours(module, name)
    assert len(got) >= len(want), f'{module}.{name}: {len(got)} parameters, DeepEP has {len(want)}'
    for (w_name, w_default, w_kind), g in zip(want, got):
        where = f'{module}.{name}({w_name})'
        if w_kind == VAR:
            assert KINDS[g.kind] == VAR, f'{where}: DeepEP takes *{w_name}, ours is {g}'
            continue
        assert g.name == w_name, f'{where}: ours calls it {g.name!r}'
        assert KINDS[g.kind] == w_kind, f'{where}: kind {KINDS[g.kind]}, DeepEP {w_kind}'
        key = (module, name, w_name)
        if key in VERSION_DEFAULTS:
            assert g.default in VERSION_DEFAULTS[key], f'{where}: default {g.default!r}'
        elif w_default is REQ:
            assert g.default is REQ or key in RELAXED, f'{where}: ours defaults to {g.default!r}, DeepEP requires it'
        else:
            assert g.default == w_default and type(g.default) is type(w_default), \
                f'{where}: default {g.default!r}, DeepEP {w_default!r}'
    for g in got[len(want):]:
        assert g.default is not REQ or KINDS[g.kind] in (VAR, 'varkw'), \
            f'{module}.{name}: extra parameter {g.name} must be optional'


def test_relaxations_are_real():
    """Every RELAXED entry still names a DeepEP-required parameter that ours defaults."""
    pytest.importorskip('torch')
    for (module, name, param), _ in RELAXED.items():
        want = {p[0]: p[1] for p in DEEPEP[module][name]}
        assert want[param] is REQ
        got = {p.name: p for p in ours(module, name)}
        assert param in got


@pytest.mark.parametrize('module', sorted(DEEPEP))
def test_classes_are_classes(module):
    pytest.importorskip('torch')
    for name in DEEPEP[module]:
        if '.' in name:
            assert inspect.isclass(resolve(module, name.split('.')[0])), f'{module}.{name.split(".")[0]}'


def test_package_level_names():
    """`deep_ep.utils` exports EventHandle (DeepEP) and EventOverlap (what Megatron imports from there)."""
    utils = importlib.import_module('deepep_cupy.utils')
    event = importlib.import_module('deepep_cupy.utils.event')
    assert utils.EventHandle is event.EventHandle and utils.EventOverlap is event.EventOverlap
    import deepep_cupy
    assert event.EventOverlap is deepep_cupy.EventOverlap
    for name in ('ElasticBuffer', 'EPHandle', 'EventOverlap', 'EventHandle', 'get_physical_domain_size',
                 'get_logical_domain_size', 'topk_idx_t', 'comm', 'destroy_all_managed_nccl_comm', 'BufferAllocator',
                 'BufferBase', 'EPBuffer', 'get_num_allocation_alignment', 'get_num_tma_alignment',
                 'get_num_rdma_alignment'):
        assert name in dir(deepep_cupy), name
