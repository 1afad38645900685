"""Performance model of EP across scale-up domains (hybrid mode) on N hosts x R GPUs joined by one NIC per GPU.

Paper figures, not measurements: the issue asks for the modelled figures at 2 and 4 nodes with 400 Gb/s NICs beside
the published ones, and for the list of what a real two-node run must confirm. The model follows SCALEOUT.md §4
(uniform routing, dedup per destination domain, the forwarder fans out over NVLink) for two schedules:

- P1 (what deepep_cupy builds first): the stages one after another on the comm stream: count exchange over the rails
  (+ the host's wait for the counts), pack the rail rows, the rail transfer, the in-domain dispatch of the union of
  own and forwarded rows (NVLink, receive epilogue included); combine the reverse, plus the final reduction.
- P2: the rail transfer cut into chunks so NVLink forwarding overlaps it: time = max(rail, NVLink) + one chunk of the
  other + fixed costs.

    python perf/hybrid_model.py [--tokens 4096] [--hidden 7168] [--experts 256] [--topk 8] [--gpus-per-node 8]
                                [--nodes 2 4] [--nic-gbps 400]

Metric: DeepEP V1's RDMA GB/s (rail bytes per rank / time) and DeepEP V2's logical GB/s (every dispatched byte a rank
sends, own domain included, / time).
"""

import argparse
from dataclasses import dataclass
from math import comb
from typing import List

# Published internode anchors (GB/s), for the printout.
PUBLISHED = {
    2: 'DeepEP V2 (GIN) 8x2: dispatch 90, combine 81 (logical); Hybrid-EP 16 ranks 57.7 BF16 / 44.9 FP8 (torch API)',
    4: 'DeepEP V2 (GIN) 8x4: dispatch 61, combine 61 (logical); Hybrid-EP 32 ranks 46.5 BF16 / 41.2 FP8',
}


@dataclass(frozen=True)
class Machine:
    nvlink_gbs: float = 340.0          # per GPU and direction: the 2xH200 peer-copy floor (58.5 MB in 172 us)
    nic_gbps: float = 400.0            # one NIC per GPU, line rate in Gb/s
    nccl_efficiency: float = 0.93      # NCCL p2p share of line rate for >= 1 MB messages (assumption)
    hbm_gbs: float = 2500.0            # device copies (pack / unpack / final reduction)
    host_sync_us: float = 40.0         # hierarchical notify + the host's wait for the counts
    nccl_launch_us: float = 15.0       # one NCCL group from the host
    nccl_per_peer_us: float = 6.0      # per peer inside a group
    nccl_latency_us: float = 20.0      # small-message latency across hosts
    chunks: int = 8                    # P2 pipeline depth

    @property
    def nic_gbs(self) -> float:
        return self.nic_gbps / 8 * self.nccl_efficiency


@dataclass(frozen=True)
class Routing:
    tokens: int
    hidden: int
    experts: int
    topk: int
    gpus_per_node: int
    nodes: int

    def p_hit(self, num_experts_in_group: int) -> float:
        """Probability that a token's top-k (uniform, distinct experts) hits a group of that many experts."""
        return 1 - comb(self.experts - num_experts_in_group, self.topk) / comb(self.experts, self.topk)

    @property
    def p_node(self) -> float:
        return self.p_hit(self.experts // self.nodes)

    @property
    def p_rank(self) -> float:
        return self.p_hit(self.experts // (self.nodes * self.gpus_per_node))


def message_bytes(hidden: int, topk: int, fp8: bool) -> int:
    """One row as it travels: the payload, FP8 scales (one float per 128 channels), top-k ids and weights."""
    payload = hidden * (1 if fp8 else 2) + (hidden // 128 * 4 if fp8 else 0)
    return payload + topk * 8 + 16


@dataclass
class Stage:
    name: str
    us: float


def _rail_bytes(r: Routing, msg: int) -> float:
    return r.tokens * (r.nodes - 1) * r.p_node * msg


def _nvlink_bytes(r: Routing, msg: int) -> float:
    """Bytes a rank pushes over NVLink: its own tokens and the forwarded ones, to every other local rank hit (the
    copy to itself stays in HBM). Forwarded rows per rank equal the rail rows it sends (symmetry)."""
    ranks_hit_per_domain = r.gpus_per_node * r.p_rank
    remote_share = (r.gpus_per_node - 1) / r.gpus_per_node
    own = r.tokens * ranks_hit_per_domain * remote_share
    forwarded = r.tokens * (r.nodes - 1) * ranks_hit_per_domain * remote_share
    return (own + forwarded) * msg


def _nccl_us(m: Machine, r: Routing, nbytes: float) -> float:
    return m.nccl_launch_us + m.nccl_per_peer_us * (r.nodes - 1) + m.nccl_latency_us + nbytes / m.nic_gbs / 1e3


def dispatch_stages(m: Machine, r: Routing, fp8: bool = True) -> List[Stage]:
    msg = message_bytes(r.hidden, r.topk, fp8)
    rail, nvl = _rail_bytes(r, msg), _nvlink_bytes(r, msg)
    return [Stage('notify + counts over the rails + host wait', m.host_sync_us + _nccl_us(m, r, 0)),
            Stage('pack rail rows (HBM)', 2 * rail / m.hbm_gbs / 1e3),
            Stage('rail transfer (NCCL)', _nccl_us(m, r, rail) - _nccl_us(m, r, 0)),
            Stage('in-domain dispatch of own + forwarded rows (NVLink)', nvl / m.nvlink_gbs / 1e3)]


def combine_stages(m: Machine, r: Routing) -> List[Stage]:
    msg = message_bytes(r.hidden, r.topk, fp8=False)
    rail, nvl = _rail_bytes(r, msg), _nvlink_bytes(r, msg)
    return [Stage('in-domain combine to the forwarders (NVLink)', nvl / m.nvlink_gbs / 1e3),
            Stage('rail transfer back (NCCL)', _nccl_us(m, r, rail)),
            Stage('final reduction at the origin (HBM)', (rail + r.tokens * msg) / m.hbm_gbs / 1e3)]


def schedule_us(stages: List[Stage], pipelined: bool, chunks: int) -> float:
    """P1: the sum. P2: the rail and NVLink stages overlap chunk by chunk."""
    if not pipelined:
        return sum(s.us for s in stages)
    rail = next(s.us for s in stages if 'rail transfer' in s.name)
    nvl = next(s.us for s in stages if 'NVLink' in s.name)
    rest = sum(s.us for s in stages) - rail - nvl
    return rest + max(rail, nvl) + min(rail, nvl) / chunks


def model(m: Machine, r: Routing) -> dict:
    out = {}
    for op, stages, fp8 in (('dispatch', dispatch_stages(m, r), True), ('combine', combine_stages(m, r), False)):
        msg = message_bytes(r.hidden, r.topk, fp8)
        rail = _rail_bytes(r, msg)
        logical = r.tokens * r.nodes * r.p_node * msg      # every byte the rank dispatches, own domain included
        for name, pipelined in (('P1', False), ('P2', True)):
            us = schedule_us(stages, pipelined, m.chunks)
            out[(op, name)] = {'us': us, 'rdma_gbs': rail / us / 1e3, 'logical_gbs': logical / us / 1e3,
                               'rail_mb': rail / 1e6, 'nvlink_mb': _nvlink_bytes(r, msg) / 1e6}
        out[(op, 'stages')] = stages
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('--tokens', type=int, default=4096, help='tokens per rank')
    parser.add_argument('--hidden', type=int, default=7168, help='hidden size')
    parser.add_argument('--experts', type=int, default=256, help='experts in all')
    parser.add_argument('--topk', type=int, default=8, help='experts per token')
    parser.add_argument('--gpus-per-node', type=int, default=8, help='ranks per scale-up domain')
    parser.add_argument('--nodes', type=int, nargs='+', default=[2, 4], help='scale-up domains (hosts)')
    parser.add_argument('--nic-gbps', type=float, default=400.0, help='NIC line rate per GPU, Gb/s')
    args = parser.parse_args(argv)
    m = Machine(nic_gbps=args.nic_gbps)
    for n in args.nodes:
        r = Routing(args.tokens, args.hidden, args.experts, args.topk, args.gpus_per_node, n)
        res = model(m, r)
        print(f'== {args.gpus_per_node}x{n} (EP{args.gpus_per_node * n}), {args.tokens} tokens, hidden {args.hidden}, '
              f'top-{args.topk} of {args.experts}, {args.nic_gbps:g} Gb/s NIC per GPU, p_node {r.p_node:.3f}')
        for op in ('dispatch', 'combine'):
            stages = ' | '.join(f'{s.name} {s.us:.0f}' for s in res[(op, 'stages')])
            print(f'  {op:8s} stages (us): {stages}')
            for name in ('P1', 'P2'):
                v = res[(op, name)]
                print(f'  {op:8s} {name}: {v["us"]:7.0f} us | rail {v["rail_mb"]:6.1f} MB, '
                      f'NVLink {v["nvlink_mb"]:6.1f} MB | RDMA {v["rdma_gbs"]:5.1f} GB/s, '
                      f'logical {v["logical_gbs"]:5.1f} GB/s')
        if n in PUBLISHED:
            print(f'  published: {PUBLISHED[n]}')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
