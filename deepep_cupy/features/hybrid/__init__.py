"""Hybrid mode: EP dispatch/combine across several scale-up (NVLink) domains joined by NCCL rails (design
memo SCALEOUT.md).

What runs today is P1, the COMPOSED path (feature.py): a rail hop packed by small kernels (kernels_cu/hybrid.cu),
then the verified intranode engine (features/ep, composed by the buffer) over each domain on the forwarder's union
input, and the reverse for combine, with a final FP32 reduction at the origin. Rows come in the hybrid order below
and combine is bitwise `refs.combine(..., reduce_in_scaleup=True)`. `ElasticBuffer` takes it when it has several
domains. The FUSED design below (hierarchical notify, forwarding straight into the receivers' slots, combine units
pushed to the forwarder, chunked rails overlapping NVLink) is the next step: it removes the union copy, the padded
N * M intranode layout and the second NVLink pass of own-domain tokens; its host references (dispatch, combine,
message formats, layout) live beside their tests in tests/references/ (the package ships no kernels of it), and the
kernels it needs are listed at the end.

Modules:
    feature.py            P1: `HybridEP` (dispatch / combine)
    rails.py              P1: `HybridRails` (rail memory and transport)
    plan.py, checks.py    P1: rail area, row sizes, payloads, transport choice, metadata translation, row order
                          (`hybrid_row_order`); argument checks
    handle.py, kernels.py P1: `HybridHandle`; kernel declarations and the loopback's stream signals
    deterministic.py      P1: `deterministic=True`, DeepEP's row order (one sort by src_token_global_idx)
    ../../runtime/rails.py  rail topology, `RailGroup`, exchange plans, `NcclRailTransport`, `IpcLoopbackTransport`
The fused design's host references, in tests/references/:
    hybrid_layout.py      sizes and offsets (symmetric data region, rail regions, message formats), the size hint
    hybrid_reference.py   host reference of dispatch: routing, positions, rails, forwarding, receive layout
    hybrid_combine_reference.py  combine: in-domain reduction at the forwarder, the final one at the origin
    hybrid_messages.py    byte formats (headers, rail / scale-up messages) and host versions of pack and forward

Protocol (N domains x R ranks, rank g = n * R + r; rail r = the ranks with scale-up index r; W = N * R)
------------------------------------------------------------------------------------------------------------------
Dispatch, at origin s = (n, r):
 1. hierarchical notify: per token its destination ranks and domains; `send_pos[t][d]` (slot at every rank d =
    position among s's tokens going to d), `domain_pos[t][m]` (position among s's tokens going to domain m: the rail
    position, and the combine stage row `n * M + domain_pos` at the forwarder), `send_expert_pos[t][k]`; a counts
    block `[R][1 + L]` per destination domain, sent to the rail peer (m, r) in a fixed-size rail exchange; the
    forwarder (m, r) hands row l of every rail peer's block (its own included) to (m, l) over NVLink, so each rank
    holds `[W regions][1 + L]` counts, regions in row order `r * N + n`.
 2. own domain: the existing NVLink send writes each token straight into region (r, n) of every destination (n, l).
 3. other domains: each token crosses rail r ONCE per destination domain m (dedup), packed at `domain_pos[t][m]` in
    the rail send region for m with its R forward slots; the forwarder (m, r) writes it into region (r, n) of every
    rank (m, l) whose forward slot is >= 0, and records `token_metadata_at_forward[n][p] = [t, K expert ids]`.
 4. receive (rank (m, l)): rows grouped by the source's scale-up index r (`psum_num_recv_tokens_per_scaleup_rank`,
    `[R]` inclusive: group r = all sources (*, r), everything local peer r wrote), inside a group by source domain,
    then source token: `src_token_global_idx` ascending inside each group. DeepEP's `deterministic=True` sorts ALL
    rows by `src_token_global_idx` in one sort ((source rank, token): `refs.dispatch_from_gathered`'s order), which
    differs once R > 1: deterministic.py moves the rows into it after the intranode dispatch (P1) and combine's input
    back. `plan.hybrid_row_order` maps the sorted order onto the grouped one. Expanded
    rows: `start[j] + src_base[region][j] + send_expert_pos` (receive-row order inside each expert). Metadata
    column 1 = `stage_row * K + stage_slot` (this rank's ordinal among the token's destination ranks of its domain, by
    first top-k appearance).
Combine (a unit = a bfloat16 partial plus the top-k slots it stands for; its key = the last of them):
 5. each rank pushes its unit (the row, or its local expanded rows summed in FP32 from +0.0 in ascending k, rounded
    once; one unit per local slot with `allow_multiple_reduction=False` and expanded input) to the forwarder (m, r)
    of the token's origin, stage `[stage_row][stage_slot]` (slot k without the local reduction);
 6. the forwarder sums its domain's units in FP32 from +0.0 in ascending key, rounds once (`reduce_in_scaleup`;
    else passes them through) and sends one row per (token, domain) over the rail back to the origin at
    `domain_pos`; own-domain tokens stay (the forwarder is their origin);
 7. the origin: FP32 bias_0 + bias_1, then every domain's unit in ascending key, one rounding. Bitwise equal to
    `refs.combine(y, topk_idx, N, R, E, bias, reduce_in_local, reduce_in_scaleup)` for DeepEP's three recipes
    (tests/test_hybrid_reference_cpu.py). `combined_topk_weights[t][k]` = the owner's weight for slot k, selected.

Stream ordering (P1: sequential stages; CPU sync = exact NCCL sizes, no sync = static worst-case sizes)
------------------------------------------------------------------------------------------------------------------
    comm stream A                                                 stream B (after event e1 on A)
    hybrid_notify_dispatch ── e1 ─────────────────────────────►   NVLink direct send (own domain)
    rail exchange 'notify' (fixed size: header + R(1+L) int32)
    hybrid_notify_scatter (waits the R forwarders of its domain)
    [CPU sync: host polls num_recv / expert counts / rail counts (transport.check() while polling), allocates]
    hybrid_pack → rail exchange 'dispatch' → hybrid_forward
    receive epilogue over W regions (waits each region's chunk signals) ◄── e2: A waits B before returning
    combine: hybrid_combine_send → hybrid_combine_forward_reduce → rail exchange 'combine' (the dispatch's counts
    reversed, known on both ends) → hybrid_combine_final
Every rail peer enqueues the same rail exchanges in the same order (`runtime.rails.plan_exchange` makes matching
groups; every transfer carries a 16-byte header with its count, so the forward kernel needs no host). Without CPU sync
and in CUDA graphs every exchange is static (whole regions), so the whole call, NCCL included, is capturable; the
loopback transport keeps its epochs on the device for the same reason. P2 (composed path, written: feature.py's
docstring, `DEEPEP_CUPY_HYBRID_PIPELINE`): split rail rows, metadata exchange first, the payload in chunks on a side
stream, each chunk unpacked and published through a rows-ready counter (a 1-thread kernel in the transports'
`after_chunk`) that the intranode dispatch kernel polls per row with bounded waits (its readiness guard), SMs left
free for the side stream; combine reduces the tokens of each landed chunk on the side stream. NCCL's CTAs are not
capped yet (`NcclConfig`).
Timeouts: every GPU wait is bounded (error record names phase and peer); the host then calls
`transport.timeout_error(phase, peer_domain, secs)`, which aborts the rail communicators and returns the
`TimeoutError` to raise.

Kernels of the fused design (not written yet; each must match the reference named)
------------------------------------------------------------------------------------------------------------------
- kernels_cu/ep_hybrid_notify.cu
  `hybrid_notify_dispatch<kMaxTopk>` (cooperative, W <= 64 destinations): send_pos [T][W], domain_pos [T][N],
  send_expert_pos [T][K], token_of_slot [R][T] for the own-domain send, blocks [N][R][1 + L] into the rail notify
  send regions with headers (kind 1) -- `hybrid_reference.route`, `hybrid_messages.pack_notify`.
  `hybrid_notify_scatter<kNumScaleup>` (one block): rows of the rail notify receive regions (and the own block) into
  each local rank's notify area `[W][1 + L]` (workspace kWsEPNotify, whole region), notify signal per forwarder, wait
  for R, then the layout blob (psum over R groups, src_base [W][L], counts, aligned starts), host-mapped totals and
  rail counts (tokens to / from each rail peer) -- `hybrid_reference.receive_layout`.
- kernels_cu/ep_hybrid_dispatch.cu
  `hybrid_pack<kMaxTopk>`: rail messages at domain_pos + headers (kind 2) -- `hybrid_messages.pack_dispatch`.
  `hybrid_forward<kMaxTopk>`: per rail receive region (count from its header, epoch checked), scale-up messages into
  region (r, n) of each (m, l) at its forward slot, token_metadata_at_forward, then per destination chunk signals
  (slots at one destination grow with the rail position, so chunk j is complete once its last slot is written) --
  `hybrid_messages.forward`.
  ep_dispatch.cu generalised: send role to own-domain ranks at region r * N + n, receive role over W regions
  (binary search on the region prefix), chunk signals per region, metadata column 1 as above --
  `hybrid_reference._receive`.
- kernels_cu/ep_hybrid_combine.cu
  `hybrid_combine_send<kMaxTopk, kLocalReduce>`: the combine send role towards the forwarder's stage slots.
  `hybrid_combine_forward_reduce<kMaxTopk, kReduceScaleup>`: per stage row, units in ascending key (from
  token_metadata_at_forward), FP32 from +0.0, one rounding; an own-domain token's result replaces stage slot 0 of
  its row (the final kernel reads it at n * M + domain_pos[t][n]), the others go into the rail send region for their
  origin's domain at the row's p, with a header (kind 3) -- `hybrid_combine_reference.combine` step 2.
  `hybrid_combine_final<kMaxTopk>`: bias, own partial and rail rows in ascending key -- step 3.
- kernels_cu/rail_signal.cu (loopback): `rail_epoch_begin`, `rail_signal` (release store of the device epoch at
  system scope), `rail_wait` (bounded, error record with phase and peer): `runtime.rails.StreamSignals`.
Every specialisation compiles for sm_90 in the CPU tests (as the shipped ones do).

P1 on a GPU (launch/gpu_suite.sh hybrid: ranks sharing GPU 0, loopback rails; launch/scaleout_nccl.sh: NCCL rails
across two GPUs), e.g.
    DEEPEP_CUPY_SCALEUP_SIZE=2 DEEPEP_CUPY_RAIL_TRANSPORT=loopback launch/run_local.sh 4 python -m \\
        deepep_cupy.tests.ep --num-tokens 256 --hidden 2048 --num-experts 64 --skip-perf-test     # 2 x 2
"""
