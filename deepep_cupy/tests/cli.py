"""Command lines of the rank programs, in one torch-free module.

Each program builds its parser here, so `python -m deepep_cupy.tests.NAME --help` works before torch or a GPU is
present, and one CPU test checks that every option of every program explains itself and shows its default. Flags and
defaults follow DeepEP's test programs where the program has a DeepEP counterpart.
"""

import argparse
import re

LAUNCH = ('Start the ranks with a launcher, e.g. mpirun (the [mpi] extra brings one):\n'
          '  mpirun -np N python -m deepep_cupy.tests.{name} [options]\n'
          'In a checkout, launch/run_local.sh N python -m deepep_cupy.tests.{name} [options] does the same with\n'
          'NVLink multicast off and, for Open MPI, the root and oversubscription flags. torchrun and srun work too\n'
          '(see the README, Launching).')


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help line; descriptions keep their line breaks."""


def _parser(name: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f'python -m deepep_cupy.tests.{name}', description=description,
                                   epilog=LAUNCH.format(name=name), formatter_class=HelpFormatter)


def parse_num_bytes(text: str) -> int:
    """`'64M'` → 64 MiB; also `K`, `G` (binary) and plain byte counts."""
    match = re.fullmatch(r'\s*(\d+)\s*([KMG]?)i?B?\s*', str(text), re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f'not a byte count: {text!r} (use e.g. 64M, 512K or 4096)')
    return int(match.group(1)) << {'': 0, 'K': 10, 'M': 20, 'G': 30}[match.group(2).upper()]


def _timeouts(p: argparse.ArgumentParser, cpu: bool = False) -> None:
    p.add_argument('--num-gpu-timeout-secs', type=float, default=100,
                   help='bound on every GPU wait of the buffer; a wait that runs out raises TimeoutError naming the '
                        'missing rank')
    if cpu:
        p.add_argument('--num-cpu-timeout-secs', type=float, default=100,
                       help='bound on the buffer\'s host-side waits (host collectives, CPU sync)')


def _skip(p: argparse.ArgumentParser, *which: str) -> None:
    texts = {
        'check': 'skip the bitwise correctness checks',
        'perf': 'skip the timing output (use it when ranks share a GPU: the figures would mean nothing)',
        'error': 'skip the invalid-argument checks',
        'timeout': 'skip the check that a missing rank makes every other rank raise TimeoutError',
        'baselines': 'no peer-copy floor or NCCL baseline next to the timings',
        # (`--skip-perf-test` of a program without timings: every rank program takes the flag)
        'noperf': 'accepted like in every rank program; this one prints no timings, so it changes nothing',
    }
    for w in which:
        flag = {'perf': '--skip-perf-test', 'noperf': '--skip-perf-test', 'error': '--skip-error-test',
                'timeout': '--skip-timeout-test'}.get(w, f'--skip-{w}')
        p.add_argument(flag, action='store_true', help=texts[w])


def ep_parser() -> argparse.ArgumentParser:
    p = _parser('ep', 'EP dispatch/combine test (DeepEP\'s tests/elastic/test_ep.py flags): every dispatch and combine '
                      'mode checked bit for bit\nagainst host references, then argument, timeout and create/destroy '
                      'checks and DeepEP-style performance lines.')
    p.add_argument('--num-tokens', type=int, default=4096,
                   help='tokens per rank (rank r dispatches max(1, num_tokens - r)); also num_max_tokens_per_rank')
    p.add_argument('--hidden', type=int, default=7168, help='hidden size: bfloat16 elements per token')
    p.add_argument('--num-topk', type=int, default=6, help='experts per token (top-k)')
    p.add_argument('--num-experts', type=int, default=256,
                   help='experts in all (rounded down to a multiple of the rank count)')
    p.add_argument('--num-sms', type=int, default=0,
                   help='SMs per dispatch/combine in the performance lines (0: the library heuristic)')
    _timeouts(p, cpu=True)
    p.add_argument('--allow-multiple-reduction', type=int, default=1, choices=(0, 1),
                   help='ElasticBuffer(allow_multiple_reduction=...): 1 reduces expanded rows per rank before sending')
    p.add_argument('--deterministic', action='store_true',
                   help='ElasticBuffer(deterministic=True): rows sorted by source token, as DeepEP (across '
                        'domains of several ranks the rows move; inside one domain they already are)')
    p.add_argument('--seed', type=int, default=0, help='seed of the inputs (rank r draws from seed * 1000 + r)')
    p.add_argument('--unbalanced-ratio', type=float, default=1.0,
                   help='load of the hottest rank relative to the others (1.0: balanced routing)')
    p.add_argument('--precise-unbalanced-ratio', action='store_true',
                   help='route so the hot rank gets exactly --unbalanced-ratio, not just on average')
    p.add_argument('--masked-ratio', type=float, default=0.0,
                   help='fraction of top-k slots set to -1 (tokens that skip an expert)')
    _skip(p, 'check', 'perf')
    p.add_argument('--test-first-only', action='store_true',
                   help='check only the first dispatch/combine mode (a quick smoke test)')
    p.add_argument('--do-pressure-test', action='store_true',
                   help='after the checks, run the first mode again for --num-pressure-seeds more input seeds')
    p.add_argument('--num-pressure-seeds', type=int, default=100, help='seeds of the pressure test')
    _skip(p, 'error', 'timeout')
    p.add_argument('--timeout-test-secs', type=float, default=3.0,
                   help='GPU timeout of the buffer used by the missing-rank check')
    p.add_argument('--skip-graph-test', action='store_true',
                   help='hybrid mode (several scale-up domains): skip the CUDA-graph capture and replay check')
    p.add_argument('--timeout-test-no-sync', action='store_true',
                   help='the missing-rank check with a dispatch without CPU sync (the fused kernel under '
                        'DEEPEP_CUPY_EP_FUSED_NOTIFY=1)')
    p.add_argument('--num-create-destroy', type=int, default=100,
                   help='buffer create/destroy cycles of the memory-leak check (0: skip it)')
    return p


def pp_parser() -> argparse.ArgumentParser:
    p = _parser('pp', 'PP send/recv test (DeepEP\'s tests/elastic/test_pp.py flags): a random-timing ring stress, '
                      'back-pressure, CuPy,\nevents, argument errors, size mismatch, reconfiguration and timeout '
                      'checks, then performance lines.')
    p.add_argument('--num-processes', type=int, default=4,
                   help='accepted for DeepEP compatibility and ignored: the launcher decides the rank count')
    p.add_argument('--num-tokens', type=int, default=4096, help='rows of each sent tensor')
    p.add_argument('--hidden', type=int, default=7168, help='bfloat16 elements per row of each sent tensor')
    p.add_argument('--num-max-inflight-tensors', type=int, default=4,
                   help='messages a sender may have in flight per peer before it waits')
    p.add_argument('--num-stress-iterations', type=int, default=4, help='random schedules of the stress test')
    p.add_argument('--num-sends', type=int, default=128, help='messages per stress schedule')
    p.add_argument('--num-sleep-cycles', type=float, default=1e7,
                   help='GPU sleep, in clock cycles, spread over each stress schedule between its operations')
    p.add_argument('--num-sms', type=int, default=0, help='SMs per send (0: the library default)')
    _timeouts(p)
    p.add_argument('--num-perf-tests', type=int, default=30, help='timed calls per performance case')
    p.add_argument('--seed', type=int, default=0, help='seed of the schedules and message contents')
    _skip(p, 'perf', 'error', 'timeout')
    p.add_argument('--timeout-test-secs', type=float, default=3.0,
                   help='GPU timeout of the buffer used by the missing-rank check')
    return p


def agrs_parser() -> argparse.ArgumentParser:
    p = _parser('agrs', 'All-gather sessions / reduce-scatter / all-reduce test (DeepEP\'s tests/elastic/test_agrs.py '
                        'flags): a random\nstress checked bit for bit, CuPy arrays, argument errors, size-mismatch and '
                        'missing-rank checks, then a\nperformance sweep next to NCCL.')
    p.add_argument('--num-max-inflight-agrs', type=int, default=4, help='all-gathers a session may have in flight')
    p.add_argument('--num-stress-iterations', type=int, default=4, help='random interleavings of the stress test')
    p.add_argument('--num-stress-gathers', type=int, default=16, help='gathered tensors per stress iteration')
    p.add_argument('--num-stress-reductions', type=int, default=8, help='reductions per stress iteration')
    p.add_argument('--num-sms', type=int, default=0, help='blocks per gather / reduction launch (0: heuristic)')
    p.add_argument('--num-perf-tests', type=int, default=50, help='timed calls per performance case')
    _timeouts(p, cpu=True)
    p.add_argument('--timeout-test-secs', type=float, default=3.0,
                   help='GPU timeout of the buffer used by the size-mismatch and missing-rank checks')
    p.add_argument('--seed', type=int, default=0, help='seed of the stress schedule and inputs')
    _skip(p, 'check', 'perf')
    p.add_argument('--skip-failure-test', action='store_true',
                   help='skip the size-mismatch and missing-rank checks (both must raise TimeoutError)')
    return p


def engram_parser() -> argparse.ArgumentParser:
    p = _parser('engram', 'Engram test (DeepEP\'s tests/elastic/test_engram.py flags): engram_write / engram_fetch '
                          'checked bit for bit\nagainst a host-gathered table, invalid calls, then fetch timings next '
                          'to the peer-copy floor and NCCL.')
    p.add_argument('--num-qps', type=int, default=0, help='blocks of the fetch kernel (0: all SMs)')
    p.add_argument('--num-entries', type=int, default=524288, help='rows of each rank\'s table')
    p.add_argument('--hidden', type=int, default=128, help='elements per table row')
    p.add_argument('--num-tokens', type=int, default=512, help='tokens per fetch')
    p.add_argument('--num-entries-per-token', type=int, default=24, help='table rows each token fetches')
    p.add_argument('--use-fp8', action='store_true', help='FP8 table rows with per-row scale factors (else bfloat16)')
    p.add_argument('--use-cpu-storage', action='store_true',
                   help='tables in pinned host memory (num_cpu_bytes): checked bit for bit against the reference and '
                        'the GPU-storage path, fetch GB/s and rows/s next to the GPU-storage path in the same run')
    p.add_argument('--seed', type=int, default=0, help='seed of the tables and fetch indices')
    _timeouts(p)
    _skip(p, 'check', 'perf', 'baselines', 'error')
    return p


def v25_parser() -> argparse.ArgumentParser:
    p = _parser('v25', 'DeepEP V2.5 API test: BucketBuffer / BucketSession, EPBuffer (dispatch / combine beside load '
                       'balancing, defer_epilogue),\nPPBuffer and EngramBuffer (GPU and host storage), checked bit for '
                       'bit against host references; then bucket timings.')
    p.add_argument('--num-tokens', type=int, default=256, help='tokens per rank of the EPBuffer checks')
    p.add_argument('--hidden', type=int, default=2048, help='hidden size of the EPBuffer checks')
    p.add_argument('--num-topk', type=int, default=8, help='top-k of the EPBuffer checks')
    p.add_argument('--num-experts', type=int, default=64, help='experts in all (a multiple of the rank count)')
    p.add_argument('--num-entries', type=int, default=4096, help='entries per rank of the first engram layer')
    p.add_argument('--perf-bytes', type=parse_num_bytes, default=64 << 20, help='bytes of the timed bucket')
    p.add_argument('--seed', type=int, default=0, help='seed of every input')
    _skip(p, 'perf')
    return p


def lb_parser(op: str) -> argparse.ArgumentParser:
    """`reduce_grads` (op 'reduce') and `prefetch_weights` (op 'prefetch') share one command line."""
    name = 'reduce_grads' if op == 'reduce' else 'prefetch_weights'
    what = ('lb_reduce_grads: every redundant copy of an expert\'s gradient summed into its owner' if op == 'reduce'
            else 'lb_prefetch_weights: every owner\'s expert weights copied to the ranks that host a copy')
    p = _parser(name, f'Load-balancing test of {what}\n(DeepEP\'s tests/ep/test_{name}.py flags): checked bit for bit '
                      f'over a sweep of sizes and mappings, then invalid\narguments, a missing rank and performance '
                      f'lines.')
    p.add_argument('--num-experts', type=int, default=64,
                   help='experts in all (rounded down to a multiple of the rank count)')
    p.add_argument('--num-redundant-experts', type=int, default=8, help='redundant expert slots per rank')
    p.add_argument('--num-hidden-bytes', type=parse_num_bytes, default=64 << 20,
                   help='bytes per expert in the benchmark (64M, 512K or plain bytes)')
    p.add_argument('--num-rounds', type=int, default=2, help='mappings per hidden size in the correctness sweep')
    p.add_argument('--empty-ratio', type=float, default=0.25, help='fraction of redundant slots left empty')
    p.add_argument('--pattern', type=str, default='random', choices=('random', 'ring', 'spread'),
                   help='placement of the redundant copies in the benchmark')
    p.add_argument('--num-sms', type=int, default=0, help='blocks per call (0: lb_get_theoretical_num_sms())')
    p.add_argument('--seed', type=int, default=0, help='seed of the mappings and values')
    _timeouts(p)
    p.add_argument('--timeout-test-secs', type=float, default=3.0,
                   help='GPU timeout of the buffer used by the missing-rank check')
    _skip(p, 'check', 'perf', 'baselines', 'error', 'timeout')
    return p


def allocation_parser() -> argparse.ArgumentParser:
    p = _parser('allocation', 'BufferAllocator test: plans torch and CuPy tensors of odd sizes and dtypes, '
                              'materialises them in a buffer\nand checks offsets, views and peer reads; then the '
                              'misuse cases.')
    _timeouts(p)
    _skip(p, 'noperf')
    return p


def barrier_parser() -> argparse.ArgumentParser:
    p = _parser('barrier', 'GPU barrier test: correctness with a late rank, microseconds per barrier, timeout '
                           'diagnosis and\nmisconfiguration checks. Needs CuPy only (no torch).')
    p.add_argument('--num-barriers', type=int, default=1000, help='barriers timed for the per-barrier figure')
    p.add_argument('--num-rounds', type=int, default=64, help='correctness rounds')
    p.add_argument('--delay-us', type=float, default=200.0, help='GPU sleep of the late rank per round')
    _timeouts(p)
    p.add_argument('--timeout-test-secs', type=float, default=3.0,
                   help='GPU timeout of the buffer used by the missing-rank check')
    _skip(p, 'perf', 'timeout')
    p.add_argument('--skip-config-test', action='store_true',
                   help='skip the check that mismatched buffer sizes raise ValueError on every rank')
    return p


def jit_timing_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog='python -m deepep_cupy.tests.jit_timing', formatter_class=HelpFormatter,
        description='JIT and start-up timings (one process, one GPU): import time, a cold compile of the kernels one '
                    'buffer needs\n(empty cache) and a warm start that finds them in the cache. Needs CuPy only.')
    p.add_argument('--num-ranks', type=int, default=2, help='rank count whose kernel specialisations are compiled')
    p.add_argument('--num-topk', type=int, default=8, help='top-k whose kernel specialisations are compiled')
    return p


# Program name -> parser builder, for tests and tools.
def legacy_low_latency_parser() -> argparse.ArgumentParser:
    p = _parser('legacy_low_latency', 'Low-latency dispatch/combine test (DeepEP\'s tests/legacy/test_low_latency.py '
                                      'flags): every mode (receive hook or not, BF16 / FP8 /\nFP8 round_scale / '
                                      'UE8M0, zero-copy combine) checked bit for bit against host references, with '
                                      'ragged and 0-token\nranks, two hooked calls in flight, CUDA-graph replays, '
                                      'masks, a timeout check, then performance lines.')
    p.add_argument('--num-processes', type=int, default=8,
                   help='accepted for DeepEP compatibility and ignored: the ranks come from the launcher')
    p.add_argument('--num-tokens', type=int, default=128,
                   help='tokens per rank; also num_max_dispatch_tokens_per_rank')
    p.add_argument('--hidden', type=int, default=7168, help='hidden size (a multiple of 128)')
    p.add_argument('--num-topk', type=int, default=8, help='experts per token (top-k)')
    p.add_argument('--num-experts', type=int, default=288,
                   help='experts in all (rounded down to a multiple of the number of ranks)')
    p.add_argument('--allow-mnnvl', action='store_true', help='accepted for DeepEP compatibility (no effect)')
    p.add_argument('--disable-nvlink', action='store_true', help='accepted for DeepEP compatibility (no effect)')
    p.add_argument('--use-logfmt', action='store_true',
                   help='LogFMT is not supported: the [errors] checks expect NotImplementedError')
    p.add_argument('--pressure-test', action='store_true', help='repeat every mode over many seeds')
    p.add_argument('--num-pressure-seeds', type=int, default=20, help='seeds of the pressure test')
    p.add_argument('--shrink-test', action='store_true',
                   help='accepted for DeepEP compatibility: the mask test always runs (see --skip-mask-test)')
    p.add_argument('--seed', type=int, default=0, help='global random seed')
    _timeouts(p)
    p.add_argument('--timeout-test-secs', type=float, default=3.0,
                   help='GPU timeout of the buffer the timeout check builds')
    _skip(p, 'check')
    p.add_argument('--skip-graph-test', action='store_true', help='skip the CUDA-graph capture and replay checks')
    p.add_argument('--skip-mask-test', action='store_true', help='skip the mask / shrink checks')
    _skip(p, 'timeout', 'perf')
    return p


def legacy_intranode_parser() -> argparse.ArgumentParser:
    p = _parser('legacy_intranode', 'DeepEP V1 Buffer, normal mode (DeepEP\'s tests/legacy/test_intranode.py flags): '
                                    'get_dispatch_layout, dispatch (BF16,\nFP8 with float32 or UE8M0 scales, with and '
                                    'without top-k, expert alignment, num_worst_tokens, cached) and combine (biases,\n'
                                    'weights) checked bit for bit against host references, with vLLM\'s and SGLang\'s '
                                    'call sequences (dual-batch\noverlap, one buffer serving both modes, the hook '
                                    'pattern, 0-token ranks, a dispatch that grows the buffer,\nnum_worst_tokens in a '
                                    'CUDA graph), then DeepEP-style performance lines next to ElasticBuffer\'s.')
    p.add_argument('--num-processes', type=int, default=8,
                   help='accepted for DeepEP compatibility and ignored: the ranks come from the launcher')
    p.add_argument('--num-tokens', type=int, default=4096,
                   help='tokens of rank 0 (rank r dispatches max(1, num_tokens - r))')
    p.add_argument('--hidden', type=int, default=7168, help='hidden size: bfloat16 elements per token')
    p.add_argument('--num-topk', type=int, default=8, help='experts per token (top-k)')
    p.add_argument('--num-experts', type=int, default=256,
                   help='experts in all (rounded down to a multiple of the rank count)')
    p.add_argument('--allow-mnnvl', action='store_true', help='accepted for DeepEP compatibility (no effect)')
    p.add_argument('--num-sms', type=int, default=24, help='Config(num_sms, ...) of the checked calls and the timings')
    p.add_argument('--seed', type=int, default=0, help='seed of the inputs (rank r draws from seed * 1000 + r)')
    _skip(p, 'check')
    p.add_argument('--skip-scenario-test', action='store_true',
                   help='skip the vLLM / SGLang call sequences, growth, both-modes and CUDA-graph checks')
    _skip(p, 'error', 'perf')
    return p


def legacy_internode_parser() -> argparse.ArgumentParser:
    p = _parser('legacy_internode', 'DeepEP V1 Buffer across scale-up domains (DeepEP\'s internode normal mode): '
                                    'get_dispatch_layout, dispatch (BF16,\nFP8, expert alignment, num_worst_tokens, '
                                    'cached) with every element of the 10-element handle, combine (biases,\nweights), '
                                    'growth, invalid calls, checked bit for bit against host references.')
    p.add_argument('--num-tokens', type=int, default=4096,
                   help='tokens of rank 0 (rank r dispatches max(1, num_tokens - r); rank 1 none)')
    p.add_argument('--hidden', type=int, default=7168, help='hidden size: bfloat16 elements per token')
    p.add_argument('--num-topk', type=int, default=8, help='experts per token (top-k)')
    p.add_argument('--num-experts', type=int, default=256,
                   help='experts in all (rounded down to a multiple of the rank count)')
    p.add_argument('--num-sms', type=int, default=24, help='Config(num_sms, ...) of the calls (V1 channels: half)')
    p.add_argument('--seed', type=int, default=0, help='seed of the inputs (rank r draws from seed * 1000 + r)')
    _skip(p, 'noperf')
    return p


def legacy_low_latency_internode_parser() -> argparse.ArgumentParser:
    p = _parser('legacy_low_latency_internode', 'V1 low-latency dispatch/combine across scale-up domains '
                                                '(DEEPEP_CUPY_SCALEUP_SIZE on one GPU): every mode (hook or not,\n'
                                                'async, BF16 / FP8 / round_scale / UE8M0, zero-copy) bit for bit '
                                                'against the single-domain references, ragged and\n0-token ranks, '
                                                'CUDA-graph capture of call and hook, masks, one buffer serving '
                                                'both modes, bad input.')
    p.add_argument('--num-tokens', type=int, default=64,
                   help='tokens per rank; also num_max_dispatch_tokens_per_rank')
    p.add_argument('--hidden', type=int, default=2048, help='hidden size (a multiple of 512 for the UE8M0 cases)')
    p.add_argument('--num-topk', type=int, default=6, help='experts per token (top-k)')
    p.add_argument('--num-experts', type=int, default=64,
                   help='experts in all (rounded down to a multiple of the number of ranks)')
    p.add_argument('--seed', type=int, default=0, help='global random seed')
    _timeouts(p)
    _skip(p, 'check')
    p.add_argument('--skip-graph-test', action='store_true', help='skip the CUDA-graph capture and replay checks')
    p.add_argument('--skip-mask-test', action='store_true', help='skip the mask checks')
    _skip(p, 'perf')
    return p


PARSERS = {
    'ep': ep_parser, 'pp': pp_parser, 'agrs': agrs_parser, 'engram': engram_parser,
    'reduce_grads': lambda: lb_parser('reduce'), 'prefetch_weights': lambda: lb_parser('prefetch'),
    'allocation': allocation_parser, 'barrier': barrier_parser, 'jit_timing': jit_timing_parser,
    'legacy_low_latency': legacy_low_latency_parser, 'legacy_intranode': legacy_intranode_parser,
    'legacy_low_latency_internode': legacy_low_latency_internode_parser,
    'legacy_internode': legacy_internode_parser,
    'v25': v25_parser,
}


def serving_replay_parser() -> argparse.ArgumentParser:
    """`serving_replay`: vLLM's and SGLang's DeepEP V1 backends replayed call for call."""
    cases = ('vllm_ht_bf16', 'vllm_ht_fp8', 'vllm_ht_sync_finalize', 'vllm_ht_dbo', 'vllm_ht_idle_ranks',
             'vllm_ll_bf16', 'vllm_ll_fp8', 'vllm_ll_fp8_ue8m0', 'vllm_ll_sync_finalize', 'vllm_ll_dbo',
             'vllm_ll_idle_ranks', 'vllm_ll_cuda_graph', 'vllm_ll_fault_tolerance', 'sglang_normal_fp8',
             'sglang_normal_ue8m0', 'sglang_normal_tbo', 'sglang_normal_idle_ranks', 'sglang_normal_prefill_growth',
             'sglang_normal_sync', 'sglang_ll_fp8', 'sglang_ll_ue8m0', 'sglang_ll_bf16', 'sglang_ll_idle_ranks',
             'sglang_ll_cuda_graph', 'sglang_auto')
    p = _parser('serving_replay', 'vLLM\'s and SGLang\'s DeepEP V1 backends (deepep_high_throughput, '
                                  'deepep_low_latency; deepep normal, low_latency,\nauto) replayed call for call on '
                                  'deep_ep = deepep_cupy, buffers sized as the frameworks size them (from their\n'
                                  'environment: VLLM_DEEPEP_BUFFER_SIZE_MB, VLLM_MOE_DP_CHUNK_SIZE, VLLM_DBO_COMM_SMS,'
                                  '\n'
                                  'SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK, ...); every output checked bit for '
                                  'bit against host\nreferences. Runs on 1, 2 or 4 ranks sharing one GPU in one '
                                  'scale-up domain, or across several (internode\nmode: 2x1, 2x2, 4x1, 2x4 domains x '
                                  'ranks; DEEPEP_CUPY_SCALEUP_SIZE=<ranks per domain> with\n'
                                  'DEEPEP_CUPY_RAIL_TRANSPORT=loopback or nccl), checked there against the internode '
                                  'references.')
    p.add_argument('--num-tokens', type=int, default=128,
                   help='normal-mode (prefill) tokens of rank 0 (rank r: max(1, num_tokens - r))')
    p.add_argument('--num-ll-tokens', type=int, default=32,
                   help='low-latency (decode) tokens of rank 0 (rank r: num_ll_tokens - r); at most the frameworks\' '
                        'max tokens per rank (vLLM 256, SGLang 128 by default)')
    p.add_argument('--num-prefill-tokens', type=int, default=0,
                   help='tokens per rank of sglang_normal_prefill_growth (0: what DeepEP\'s default configs hold in '
                        'flight, more than SGLang\'s FP8-sized buffer has slots for, inside one domain or across '
                        'several)')
    p.add_argument('--hidden', type=int, default=2048,
                   help='hidden size (vLLM\'s low-latency cases need one of 2048, 2560, 3072, 4096, 5120, 6144, 7168, '
                        '8192; FP8 UE8M0 a multiple of 512)')
    p.add_argument('--num-topk', type=int, default=8, help='experts per token (top-k)')
    p.add_argument('--num-experts', type=int, default=64,
                   help='experts in all (rounded down to a multiple of the rank count)')
    p.add_argument('--seeds', type=str, default='0', help='comma-separated seeds; every case runs once per seed')
    p.add_argument('--cases', type=str, default='all',
                   help=f'comma-separated case names, or all; cases: {", ".join(cases)}')
    _skip(p, 'noperf')
    return p


PARSERS['serving_replay'] = serving_replay_parser


def megatron_moe_parser() -> argparse.ArgumentParser:
    """`megatron_moe`: Megatron-Core's MoE layer on deep_ep."""
    p = _parser('megatron_moe', "Megatron-Core's MoE layer, unmodified, on deep_ep = deepep_cupy: the flex dispatcher "
                'with its DeepEP backend against the all-to-all dispatcher, forward and backward, several SGD steps '
                "(EP = the number of ranks; at one rank Megatron's fused_a2a functions alone). Needs megatron-core.")
    p.add_argument('--num-tokens', type=int, default=256, help='tokens per rank (sequence length, batch 1)')
    p.add_argument('--hidden', type=int, default=512, help='hidden size')
    p.add_argument('--ffn-hidden', type=int, default=768, help='expert FFN hidden size')
    p.add_argument('--num-experts', type=int, default=8, help='routed experts (a multiple of EP)')
    p.add_argument('--num-topk', type=int, default=2, help='top-k of the top-k cases')
    p.add_argument('--num-steps', type=int, default=3, help='training steps per case')
    p.add_argument('--lr', type=float, default=1e-2, help='SGD learning rate between steps')
    p.add_argument('--api', choices=('v1', 'v2', 'both'), default='both',
                   help="deep_ep API Megatron calls: 'v1' Buffer (megatron-core 0.19), 'v2' ElasticBuffer "
                        "(Megatron main's path), or both")
    p.add_argument('--seed', type=int, default=0, help='seed of weights and inputs')
    _skip(p, 'noperf')
    return p


PARSERS['megatron_moe'] = megatron_moe_parser


# ---- faults: its own launcher (a killed rank would end an mpirun job), so no LAUNCH epilog ------------------------
FAULT_CASES = ('before_dispatch', 'in_dispatch_wait', 'before_combine', 'in_low_latency', 'in_low_latency_combine',
               'in_graph_replay')


def faults_parser() -> argparse.ArgumentParser:
    """`faults`: a rank SIGKILLed at a chosen point; every other rank must raise, destroy and exit."""
    p = argparse.ArgumentParser(
        prog='python -m deepep_cupy.tests.faults', formatter_class=HelpFormatter,
        description='Fault test (no hang, ever, when a rank dies): starts --num-ranks child ranks itself, all on GPU '
                    '0, joined by the TCP\nhost group; per case one rank SIGKILLs itself at the case\'s point and '
                    'every survivor must raise TimeoutError or\nRuntimeError naming the phase and the dead peer within '
                    'the timeout plus --slack-secs, then destroy() must return and\nthe process exit 0. One line per '
                    'case, a summary, exit status 0 only if every case passed.\nCases: ' + ', '.join(FAULT_CASES) + '.')
    p.add_argument('--mode', choices=('ipc', 'nccl'), default='ipc',
                   help='ipc: one scale-up domain (CUDA IPC); nccl: hybrid mode over two domains (rank g in domain '
                        'g // (num_ranks / 2)), NCCL rails over sockets on the loopback')
    p.add_argument('--num-ranks', type=int, choices=(2, 4), default=2, help='child ranks (all on GPU 0)')
    p.add_argument('--cases', type=str, default='all',
                   help='comma-separated cases, or all (those that apply to the mode: the low-latency ones need ipc)')
    p.add_argument('--victim', type=int, default=-1, help='the rank that is killed (-1: the last rank)')
    _timeouts(p, cpu=True)
    p.set_defaults(num_gpu_timeout_secs=8.0, num_cpu_timeout_secs=16.0)
    p.add_argument('--slack-secs', type=float, default=10.0,
                   help='allowed on top of the timeout between the start of the survivor\'s faulted step and its error')
    p.add_argument('--delay-secs', type=float, default=2.0,
                   help='in_* cases: survivors start their step this much after the victim, so it dies inside its call')
    p.add_argument('--num-rounds', type=int, default=3,
                   help='rounds of the workload a survivor runs from the fault until a call raises')
    p.add_argument('--setup-secs', type=float, default=240.0,
                   help='bound on a child\'s start (imports, JIT, buffers, warm-up) and its rendezvous timeout')
    p.add_argument('--num-tokens', type=int, default=128, help='tokens per rank (also num_max_tokens_per_rank)')
    p.add_argument('--hidden', type=int, default=2048, help='hidden size')
    p.add_argument('--num-experts', type=int, default=64, help='experts in all (a multiple of the rank count)')
    p.add_argument('--num-topk', type=int, default=4, help='experts per token')
    p.add_argument('--seed', type=int, default=0, help='seed of the inputs')
    p.add_argument('--out', type=str, default='out/faults',
                   help='directory of the children\'s logs and the JSON report')
    p.add_argument('--child', type=str, default='',
                   help='internal: run as one rank of this case (the parent starts the children with it)')
    _skip(p, 'noperf')
    return p


PARSERS['faults'] = faults_parser
