"""Where the low-latency kernels' time goes: a few eager FP8 dispatches and BF16 combines of one library, one rank,
on ll_side_by_side's inputs, for Nsight Compute to read (the script itself times nothing).

    ncu --clock-control none --set full -k regex:'dispatch|combine' --launch-skip 6 --launch-count 4 \
        python3 perf/ll_ncu.py [--lib ours|deepep] [--deepep-prefix /tmp/deepep_v121] [--num-tokens 128 ...]

`--lib deepep` imports DeepEP v1.2.1 from --deepep-prefix (tools/fetch_deepep_src.sh build), as ll_side_by_side's
child does; run it with that prefix first on PYTHONPATH.
"""

import argparse
import os
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'perf'))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--lib', choices=('ours', 'deepep'), default='ours')
    p.add_argument('--deepep-prefix', default='/tmp/deepep_v121')
    p.add_argument('--num-tokens', type=int, default=128)
    p.add_argument('--hidden', type=int, default=7168)
    p.add_argument('--num-topk', type=int, default=8)
    p.add_argument('--num-experts', type=int, default=256)
    p.add_argument('--calls', type=int, default=5, help='dispatch + combine pairs (the first ones warm up)')
    p.add_argument('--seed', type=int, default=0)
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    from ll_side_by_side import _import_buffer, make_inputs

    Buffer, where = _import_buffer(args.lib, args.deepep_prefix)
    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', world_size=1, rank=0)
    group = dist.new_group([0])
    M, H, K, E = args.num_tokens, args.hidden, args.num_topk, args.num_experts
    inp = make_inputs(M, H, K, E, 0, args.seed)
    x, topk_idx, topk_weights = inp['x'].cuda(), inp['topk_idx'].cuda(), inp['topk_weights'].cuda()
    buf = Buffer(group, num_nvl_bytes=0, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(M, H, 1, E),
                 low_latency_mode=True, num_qps_per_rank=E, explicitly_destroy=True)
    print(f'[ll_ncu] {where}: {args.calls} x (FP8 dispatch + BF16 combine), {M} tokens, hidden {H}, top-{K}, {E} '
          f'experts', flush=True)
    for _ in range(args.calls):
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, M, E, use_fp8=False, async_finish=False,
                                                             return_recv_hook=False)
        buf.low_latency_dispatch(x, topk_idx, M, E, use_fp8=True, async_finish=False, return_recv_hook=False)
        buf.low_latency_combine(recv, topk_idx, topk_weights, handle, async_finish=False, return_recv_hook=False)
    torch.cuda.synchronize()
    buf.destroy()
    dist.destroy_process_group()
    print('[ll_ncu] done', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
