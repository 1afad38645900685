"""Signature parity of DeepEP V1's `Buffer` and `Config` (`deep_ep.Buffer`, `deep_ep.Config`) with a table written by
hand from DeepEP's `deep_ep/buffers/legacy.py` (HEAD) and `deep_ep/buffer.py` (v1.2.1 plus `enable_shrink`): every
method's parameters in order, with kind and default, and which methods are static. Ours may add trailing optional
(keyword-only) parameters: `KEYWORD_ONLY_EXTRAS` lists them and why."""

import inspect

import pytest

from deepep_cupy.buffers.legacy import Buffer, Config

REQ = inspect.Parameter.empty


def sig(*params):
    return tuple(params)


# method -> parameters (name, default); `self` left out. Static methods are listed in STATIC.
BUFFER = {
    '__init__': sig(('group', REQ), ('num_nvl_bytes', 0), ('num_rdma_bytes', 0), ('low_latency_mode', False),
                    ('num_qps_per_rank', 24), ('allow_nvlink_for_low_latency_mode', True), ('allow_mnnvl', False),
                    ('explicitly_destroy', False), ('enable_shrink', False), ('comm', None)),
    'destroy': sig(),
    'is_sm90_compiled': sig(),
    'set_num_sms': sig(('new_num_sms', REQ)),
    'capture': sig(),
    'get_low_latency_rdma_size_hint': sig(('num_max_dispatch_tokens_per_rank', REQ), ('hidden', REQ),
                                          ('num_ranks', REQ), ('num_experts', REQ)),
    'get_comm_stream': sig(),
    'get_local_buffer_tensor': sig(('dtype', REQ), ('size', None), ('offset', 0), ('use_rdma_buffer', False)),
    'get_dispatch_config': sig(('num_ranks', REQ)),
    'get_combine_config': sig(('num_ranks', REQ)),
    'get_dispatch_layout': sig(('topk_idx', REQ), ('num_experts', REQ), ('previous_event', None),
                               ('async_finish', False), ('allocate_on_comm_stream', False)),
    'dispatch': sig(('x', REQ), ('handle', None), ('num_tokens_per_rank', None), ('num_tokens_per_rdma_rank', None),
                    ('is_token_in_rank', None), ('num_tokens_per_expert', None), ('topk_idx', None),
                    ('topk_weights', None), ('expert_alignment', 1), ('num_worst_tokens', 0), ('config', None),
                    ('previous_event', None), ('async_finish', False), ('allocate_on_comm_stream', False)),
    'combine': sig(('x', REQ), ('handle', REQ), ('topk_weights', None), ('bias', None), ('config', None),
                   ('previous_event', None), ('async_finish', False), ('allocate_on_comm_stream', False)),
    'internode_dispatch': sig(('x', REQ), ('handle', None), ('num_tokens_per_rank', None),
                              ('num_tokens_per_rdma_rank', None), ('is_token_in_rank', None),
                              ('num_tokens_per_expert', None), ('topk_idx', None), ('topk_weights', None),
                              ('expert_alignment', 1), ('config', None), ('previous_event', None),
                              ('async_finish', False), ('allocate_on_comm_stream', False)),
    'internode_combine': sig(('x', REQ), ('handle', REQ), ('topk_weights', None), ('bias', None), ('config', None),
                             ('previous_event', None), ('async_finish', False), ('allocate_on_comm_stream', False)),
    'clean_low_latency_buffer': sig(('num_max_dispatch_tokens_per_rank', REQ), ('hidden', REQ), ('num_experts', REQ)),
    'low_latency_dispatch': sig(('x', REQ), ('topk_idx', REQ), ('num_max_dispatch_tokens_per_rank', REQ),
                                ('num_experts', REQ), ('cumulative_local_expert_recv_stats', None),
                                ('dispatch_wait_recv_cost_stats', None), ('use_fp8', True), ('round_scale', False),
                                ('use_ue8m0', False), ('async_finish', False), ('return_recv_hook', False)),
    'low_latency_combine': sig(('x', REQ), ('topk_idx', REQ), ('topk_weights', REQ), ('handle', REQ),
                               ('use_logfmt', False), ('zero_copy', False), ('async_finish', False),
                               ('return_recv_hook', False), ('out', None), ('combine_wait_recv_cost_stats', None)),
    'low_latency_update_mask_buffer': sig(('rank_to_mask', REQ), ('mask', False)),
    'low_latency_query_mask_buffer': sig(('mask_status', REQ)),
    'low_latency_clean_mask_buffer': sig(),
    'get_next_low_latency_combine_buffer': sig(('handle', REQ)),
}
STATIC = {'is_sm90_compiled', 'set_num_sms', 'capture', 'get_low_latency_rdma_size_hint', 'get_dispatch_config',
          'get_combine_config'}
CONFIG = {
    '__init__': sig(('num_sms', 20), ('num_max_nvl_chunked_send_tokens', 6), ('num_max_nvl_chunked_recv_tokens', 256),
                    ('num_max_rdma_chunked_send_tokens', 6), ('num_max_rdma_chunked_recv_tokens', 256)),
    'get_nvl_buffer_size_hint': sig(('hidden_bytes', REQ), ('num_ranks', REQ)),
    'get_rdma_buffer_size_hint': sig(('hidden_bytes', REQ), ('num_ranks', REQ)),
}
# Trailing keyword-only parameters ours adds, and why.
KEYWORD_ONLY_EXTRAS = {
    ('__init__', 'use_fabric'): 'DeepEP 567632d / HEAD name (positional there, after allow_mnnvl); no effect here',
    ('low_latency_dispatch', 'x_global_scale'): 'a DeepEP fork option (NVFP4): NotImplementedError when set',
    ('low_latency_dispatch', 'use_nvfp4'): 'a DeepEP fork option (NVFP4): NotImplementedError when set',
    ('low_latency_combine', 'overlap'): 'a DeepEP fork option (single-batch overlap): NotImplementedError when set',
    ('low_latency_combine', 'src_signals'): 'as overlap',
    ('low_latency_combine', 'src_signal_expect_value'): 'as overlap',
}

CASES = [(Buffer, name, params) for name, params in BUFFER.items()] + \
        [(Config, name, params) for name, params in CONFIG.items()]


@pytest.mark.parametrize('cls,name,want', CASES, ids=[f'{c.__name__}.{n}' for c, n, _ in CASES])
def test_signature_matches_deepep(cls, name, want):
    got = list(inspect.signature(getattr(cls, name)).parameters.values())
    if name not in STATIC or cls is not Buffer:
        assert got and got[0].name == 'self', f'{cls.__name__}.{name} must be a method'
        got = got[1:]
    assert len(got) >= len(want), f'{cls.__name__}.{name}: {len(got)} parameters, DeepEP has {len(want)}'
    for (w_name, w_default), g in zip(want, got):
        where = f'{cls.__name__}.{name}({w_name})'
        assert g.name == w_name, f'{where}: ours calls it {g.name!r}'
        assert g.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD, f'{where}: kind {g.kind}'
        assert g.default is w_default or (g.default == w_default and type(g.default) is type(w_default)), \
            f'{where}: default {g.default!r}, DeepEP {w_default!r}'
    for g in got[len(want):]:
        assert g.kind == inspect.Parameter.KEYWORD_ONLY and g.default is not REQ, \
            f'{cls.__name__}.{name}: extra parameter {g.name} must be keyword-only and optional'
        assert (name, g.name) in KEYWORD_ONLY_EXTRAS, f'{cls.__name__}.{name}: {g.name} is not documented'


def test_static_methods_are_static():
    for name in STATIC:
        assert isinstance(inspect.getattr_static(Buffer, name), staticmethod), name
    assert Buffer.num_sms == 20 and isinstance(inspect.getattr_static(Buffer, 'num_sms'), int)


def test_extras_exist():
    for (method, param) in KEYWORD_ONLY_EXTRAS:
        assert param in inspect.signature(getattr(Buffer, method)).parameters, (method, param)


def test_package_names():
    import deepep_cupy
    assert deepep_cupy.Buffer is Buffer and deepep_cupy.Config is Config
