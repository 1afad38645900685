"""DeepEP V1 (`deep_ep.Buffer`, `deep_ep.Config`): an adapter over the engine, in this one package.

    buffer         Buffer (every mode behind one class), Config; its old path: `deepep_cupy.buffers.legacy`
    config         Config and DeepEP's dispatch / combine tables
    normal         normal mode inside one NVLink domain, on the EP engine (features/ep)
    low_latency    low-latency mode, on the low-latency engine (features/ll)
    internode      normal mode across scale-up domains, on the hybrid engine (features/hybrid)
    internode_ll   low-latency mode across scale-up domains, on the hybrid engine
    kernels/       V1's own kernels' launchers: layout (get_dispatch_layout), internode (V1's 10-element internode
                   handle), internode_ll (V1's low-latency layouts across domains), internode_reference (host mirrors)

Layering (tools/import_graph.py): this package is the adapter layer, above the api (buffers) and the features; the
engine never imports it (only `buffers.legacy`, V1's old path, and `buffers.shipped`, the list of every kernel, sit
with it). Importing it has no side effects.

The hook: every engine entry point and argument the adapter uses
-----------------------------------------------------------------
- `buffers.base.BufferBase(group=, num_bytes=, num_cpu_timeout_secs=, ...)`: symmetric memory, streams, barrier;
  `_acquire_stream` / `_release_stream` / `check_configuration` (buffer.py).
- EP engine (features/ep; normal.py): `EP(buf, num_max_tokens_per_rank, hidden, num_topk, True, True, nvlink_gbs)`;
  `EP.dispatch(x, topk_idx=, topk_weights=, num_experts=, num_max_tokens_per_rank=, ..., num_worst_tokens=,
  allow_previous_event_alone=True, legacy=LegacyLayout(...))` (non-cached) and `EP.dispatch(..., handle=,
  allow_previous_event_alone=True)` (cached); `EP.combine(x, handle, ..., weights_over_ranks=True,
  allow_previous_event_alone=True)`; `EPHandle`; sizing from `layout.EPLayout`, `layout.buffer_size_hint`,
  `kernels.COMBINE_CHUNK_ROWS` / `COMBINE_CHUNK_SIGNAL_BYTES`.
  `features/ep/legacy.py LegacyLayout` is the V1 record of one dispatch: in `num_channels` (config.num_sms // 2),
  `reported_num_tokens` (the capacity-overflow probe), `expert_counts` (num_tokens_per_expert without top-k); out
  `rank_prefix_matrix`, `channel_prefix_matrix`, `recv_channel_prefix_matrix`, `recv_src_idx`, `send_head`,
  `max_num_tokens`. Defaults of every V1 argument (None / 0 / False) give V2's behaviour.
- Hybrid engine (features/hybrid; internode.py, internode_ll.py): `buffers.hybrid.make_hybrid_ep`, `RailHooks`;
  `HybridEP.dispatch(..., v1=V1Options)`: `num_worst` rows without a CPU sync and three hooks the hybrid dispatch
  calls on its stream, `routed` → `notified(counts)` → `forward(...)` (returns the `LegacyLayout` it passes to the
  intranode `EP.dispatch`) — kernels/internode.py `V1Options` / `InternodeCall`, duck-typed, so the feature never
  imports this package; `HybridEP.combine(..., v1=True)` (= weights_over_ranks, previous event alone);
  `features.hybrid.plan.rail_area` for sizing.
- Low-latency engine (features/ll; low_latency.py, internode_ll.py): `LowLatencyEngine(base, M, hidden, E, ...)`
  with its `dispatch` / `combine` / mask methods, `check_dims`, `get_rdma_size_hint`, `NUM_MAX_RANKS`,
  `CONTROL_BYTES`, `plan.LLLayout`, `plan.SIZE_ALIGN`. features/ll serves only this adapter today: it is DeepEP V1's
  low-latency API, kept an engine feature because its kernels (kernels_cu/ep_ll.cu) are an engine of their own.

What is still V1-specific inside the engine, and why it stays
-------------------------------------------------------------
- features/ep/legacy.py: `LegacyLayout` (the hook's record: the engine checks and fills it, so it lives where the
  engine can import it) and the bound dispatch's V1 parts, `matrix_exprs` / `view_args` / `bind` / `v1_outputs`:
  V1's matrices are carved from the handle's workspace allocation and their pointers patched with the engine's own,
  in the per-call path (moving them out would need a callback there: a redesign, and more host work per call).
- features/ep/feature.py `EP.dispatch` / `combine`: the V1 arguments above, and the V1 part of the bound-call key.
- features/ep/plan.py: `DispatchPlan.legacy` and its checks, `num_worst_tokens`, `allow_previous_event_alone`
  (V1's previous-event rule), `CombinePlan.weights_over_ranks` (V1's combined_topk_weights).
- features/ep/bound.py (`v1_channels`, `v1_words`, `notify_v1_idx`, `max_num_tokens` after the CPU sync),
  lean.py (`run_no_sync_v1`, `run_cpu_sync_v1`: the lean per-call paths of V1 calls), patch.py (recv_src_idx's
  offset), dispatch_checks.py (expert counts' layout), kernels.py `NUM_MAX_CHANNELS`.
- kernels_cu/ep_notify.cu computes rank_prefix_matrix and V1's channel prefix matrices and publishes
  reported_num_tokens / expert_counts: the notify is the only pass over the counts, so a separate V1 kernel would
  re-read them at the cost of a launch and a grid barrier; ep_dispatch.cu's epilogue writes recv_src_idx for the
  same reason (it already writes the source metadata). All of it is off (null pointers, 0 channels) for V2 calls.
- features/hybrid/feature.py: the `v1` argument and its hook calls (above).
"""
