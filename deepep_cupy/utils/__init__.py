"""Test and benchmark utilities (DeepEP's `deep_ep.utils`): setup, math and FP8 helpers, unbalanced gating, timing,
references, events, NCCL handles.

Names resolve lazily (PEP 562): `math`, `gate` and `refs` need torch, the others do not, and importing this package
imports none of them. Submodules: `envs`, `testing`, `gate`, `math`, `refs`, `event`, `semantic`, `comm`
(DeepEP's modules of the same names) and `bench_bytes`.
"""

# Public name -> submodule defining it.
_LAZY = {
    **dict.fromkeys(('calc_diff', 'per_token_cast_to_fp8', 'per_token_cast_back', 'create_grouped_scores',
                     'inplace_unique', 'hash_tensor', 'hash_tensors', 'count_bytes', 'align', 'ceil_div',
                     'safe_div'), 'math'),
    **dict.fromkeys(('get_unbalanced_scores', 'generate_rank_count', 'generate_topk_idx', 'count_tokens_per_rank'),
                    'gate'),
    **dict.fromkeys(('bench', 'bench_kineto', 'BenchResult', 'flush_l2_cache', 'sleep_gpu', 'suppress_stdout_stderr',
                     'empty_suppress', 'parse_num_bytes'), 'testing'),
    **dict.fromkeys(('init_dist', 'init_seed', 'get_local_seed', 'get_global_seed', 'dist_print', 'get_nvlink_gbs',
                     'get_rdma_gbs'), 'envs'),
    **dict.fromkeys(('EventHandle', 'EventOverlap'), 'event'),
    **dict.fromkeys(('value_or', 'weak_lru'), 'semantic'),
}

_SUBMODULES = ('envs', 'gate', 'math', 'refs', 'testing', 'event', 'semantic', 'comm', 'bench_bytes')

__all__ = sorted(_LAZY)


def __getattr__(name):
    import importlib
    if name in _SUBMODULES:
        return importlib.import_module(f'{__name__}.{name}')
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    value = getattr(importlib.import_module(f'{__name__}.{module}'), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
