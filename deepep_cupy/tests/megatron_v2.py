"""Megatron-Core main's DeepEP V2 path, as its calls reach `deep_ep.ElasticBuffer`, for `tests.megatron_moe`.

Megatron-LM's main branch (`megatron/core/transformer/moe/fused_a2a.py`, read at NVIDIA/Megatron-LM 02ad939 and the
probe tests of `tests/unit_tests/transformer/moe/`) prefers DeepEP V2 when `from deep_ep import ElasticBuffer`
works; the released megatron-core 0.19.2 has only the V1 `Buffer` path. These autograd functions make the same
`ElasticBuffer` calls with the same arguments (our code, written from reading theirs), so the 0.19.2 MoE layer can
run Megatron main's V2 contract when `install()` puts them in place of its `fused_dispatch` / `fused_combine` /
`set_deepep_num_sms`:

- the buffer: `ElasticBuffer.get_buffer_size_hint(group=, num_max_tokens_per_rank=, hidden=, num_topk=,
  use_fp8_dispatch=False, allow_hybrid_mode=True, allow_multiple_reduction=True)`, then `ElasticBuffer(group=,
  num_max_tokens_per_rank=, hidden=, num_topk=, use_fp8_dispatch=False, allow_hybrid_mode=True,
  num_allocated_qps=0)`, rebuilt when `buffer.group != group` or its `num_nvl_bytes` / `num_rdma_bytes` (attributes
  Megatron sets on the buffer) are below the hint; the sizes come from `MCORE_DEEPEP_V2_MAX_TOKENS_PER_RANK` (8192),
  `MCORE_DEEPEP_V2_HIDDEN` (7168) and `MCORE_DEEPEP_V2_NUM_TOPK` (8);
- `ElasticBuffer.set_num_sms(n)` from the dispatcher's constructor; every call passes `num_sms=0`, `num_qps=0`;
- forward dispatch: `dispatch(x, topk_idx=, topk_weights=, num_experts=, num_max_tokens_per_rank=, num_sms=0,
  num_qps=0, previous_event=, async_with_compute_stream=, allocate_on_comm_stream=, do_expand=False)`, with
  `previous_event = buffer.capture()` and `allocate_on_comm_stream=True` when asynchronous; the per-expert counts
  from `handle.num_recv_tokens_per_expert_list`;
- its backward: `combine(grad, handle, topk_weights=grad_probs.float(), ...)`; forward combine: `combine(x,
  handle=handle, ...)`; its backward: a cached `dispatch(grad, handle=, num_experts=handle.num_experts, ...,
  do_expand=False)`.
"""

import os

import torch

MAX_TOKENS_ENV, HIDDEN_ENV, NUM_TOPK_ENV = ('MCORE_DEEPEP_V2_MAX_TOKENS_PER_RANK', 'MCORE_DEEPEP_V2_HIDDEN',
                                            'MCORE_DEEPEP_V2_NUM_TOPK')


class State:
    """The module-level state of Megatron's fused_a2a (one buffer) plus what the test counts."""
    buffer = None
    num_builds = 0
    num_sms_set = None


def _sizes():
    return (int(os.environ.get(MAX_TOKENS_ENV, '8192')), int(os.environ.get(HIDDEN_ENV, '7168')),
            int(os.environ.get(NUM_TOPK_ENV, '8')))


def get_buffer(group):
    import deep_ep
    num_max_tokens_per_rank, hidden, num_topk = _sizes()
    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(
        group=group, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk,
        use_fp8_dispatch=False, allow_hybrid_mode=True, allow_multiple_reduction=True)
    buf = State.buffer
    if (buf is None or buf.group != group or getattr(buf, 'num_nvl_bytes', 0) < hint
            or getattr(buf, 'num_rdma_bytes', 0) < hint):
        buf = deep_ep.ElasticBuffer(group=group, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                                    num_topk=num_topk, use_fp8_dispatch=False, allow_hybrid_mode=True,
                                    num_allocated_qps=0)
        buf.num_nvl_bytes = buf.num_rdma_bytes = hint
        State.buffer = buf
        State.num_builds += 1
    return buf


def _events(buf, async_finish: bool, allocate_on_comm_stream: bool):
    if async_finish:
        return buf.capture(), True
    return None, allocate_on_comm_stream


def _wait(async_finish: bool, event) -> None:
    if async_finish and event is not None:
        from deep_ep.utils import EventOverlap
        EventOverlap(event).current_stream_wait()


class FusedDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group, async_finish=False,
                allocate_on_comm_stream=False):
        buf = get_buffer(group)
        prev, on_comm = _events(buf, async_finish, allocate_on_comm_stream)
        recv_x, recv_idx, recv_probs, handle, event = buf.dispatch(
            x, topk_idx=token_indices, topk_weights=token_probs, num_experts=num_experts,
            num_max_tokens_per_rank=_sizes()[0], num_sms=0, num_qps=0, previous_event=prev,
            async_with_compute_stream=async_finish, allocate_on_comm_stream=on_comm, do_expand=False)
        _wait(async_finish, event)
        ctx.group, ctx.handle = group, handle
        ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
        counts = handle.num_recv_tokens_per_expert_list
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()
        return recv_x, recv_idx, recv_probs, torch.tensor(list(counts or [])), handle

    @staticmethod
    def backward(ctx, grad_output, grad_token_indices, grad_token_probs, grad_tokens_per_expert, grad_handle):
        buf = get_buffer(ctx.group)
        prev, on_comm = _events(buf, ctx.async_finish, ctx.allocate_on_comm_stream)
        grad_x, grad_probs, event = buf.combine(
            grad_output.contiguous(), ctx.handle, topk_weights=grad_token_probs.float(), num_sms=0, num_qps=0,
            previous_event=prev, async_with_compute_stream=ctx.async_finish, allocate_on_comm_stream=on_comm)
        _wait(ctx.async_finish, event)
        return grad_x, None, grad_probs, None, None, None, None


class FusedCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, handle, async_finish=False, allocate_on_comm_stream=False):
        buf = get_buffer(group)
        prev, on_comm = _events(buf, async_finish, allocate_on_comm_stream)
        combined_x, _, event = buf.combine(x, handle=handle, num_sms=0, num_qps=0, previous_event=prev,
                                           async_with_compute_stream=async_finish, allocate_on_comm_stream=on_comm)
        _wait(async_finish, event)
        ctx.group, ctx.handle = group, handle
        ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
        return combined_x, None

    @staticmethod
    def backward(ctx, grad_output, previous_event=None):
        buf = get_buffer(ctx.group)
        prev, on_comm = _events(buf, ctx.async_finish, ctx.allocate_on_comm_stream)
        grad_x, _, _, _, event = buf.dispatch(
            grad_output.contiguous(), handle=ctx.handle, num_experts=getattr(ctx.handle, 'num_experts', None),
            num_sms=0, num_qps=0, previous_event=prev, async_with_compute_stream=ctx.async_finish,
            allocate_on_comm_stream=on_comm, do_expand=False)
        _wait(ctx.async_finish, event)
        return grad_x, None, None, None, None


def fused_dispatch(x, token_indices, token_probs, num_experts, group, async_finish=False,
                   allocate_on_comm_stream=False):
    return FusedDispatch.apply(x.contiguous(), token_indices, token_probs, num_experts, group, async_finish,
                               allocate_on_comm_stream)


def fused_combine(x, group, handle, async_finish=False, allocate_on_comm_stream=False):
    return FusedCombine.apply(x, group, handle, async_finish, allocate_on_comm_stream)


def set_deepep_num_sms(num_sms):
    import deep_ep
    deep_ep.ElasticBuffer.set_num_sms(num_sms)
    State.num_sms_set = num_sms


def install() -> None:
    """Put these in place of the V1 functions megatron-core's token dispatcher imported from fused_a2a."""
    from megatron.core.transformer.moe import fused_a2a, token_dispatcher
    for module in (fused_a2a, token_dispatcher):
        module.fused_dispatch, module.fused_combine = fused_dispatch, fused_combine
        module.set_deepep_num_sms = set_deepep_num_sms


def release() -> None:
    """Drop the buffer as Megatron does (it never calls destroy(); built with explicitly_destroy=False, the buffer
    frees itself when the last reference goes)."""
    State.buffer = None
