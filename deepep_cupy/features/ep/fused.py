"""Sizes of the fused notify and dispatch launch (`kernels_cu/ep_fused.cu`, `DEEPEP_CUPY_EP_FUSED_NOTIFY`), as pure
functions of plain values (tests/test_ep_fused_cpu.py).

The fused kernel waits inside the launch (its senders and receivers for flags its notify blocks raise), so every block
must be resident at once: the launch is cooperative (the driver refuses a grid that cannot be co-resident, and
jit/launch.py checks it against the occupancy first), and the grid stays at most one block per SM, like the dispatch
kernel's. A call the fused kernel cannot serve says why (`fused_refusal`) and runs the notify and dispatch kernels."""

from typing import Optional

from ...runtime.sizes import ceil_div
from .kernels import DISPATCH_THREADS

FUSED_THREADS = DISPATCH_THREADS            # threads per block = notify tokens per notify block
NUM_MAX_FUSED_SMEM_BYTES = 200 * 1024       # dynamic shared memory (notify's per-warp counts), one block per SM
FUSED_MAX_COUNT_BLOCKS = 512                # kernels_cu/common/ep.cuh kFusedMaxCountBlocks: the self-counting
                                            # receivers' count words (one thread of a block reads each)


def fused_smem_bytes(num_experts: int, num_ranks: int) -> int:
    """Dynamic shared memory of the fused kernel: notify_body's per-warp counts, block bases and totals per key for
    FUSED_THREADS / 32 warps (plan.notify_smem_bytes for the notify kernel's 8)."""
    return (FUSED_THREADS // 32 + 2) * (num_experts + num_ranks) * 4


def fused_notify_blocks(num_tokens: int) -> int:
    """Blocks that run the notify's work: one token per thread."""
    return max(1, ceil_div(num_tokens, FUSED_THREADS))


def fused_refusal(num_tokens: int, num_experts: int, num_ranks: int, num_send_blocks: int, num_device_sms: int,
                  cached: bool, cpu_sync: bool, one_launch: bool, mode: Optional[bool] = True,
                  do_expand: bool = False) -> Optional[str]:
    """Why a dispatch is not one fused launch, or None when it is. `mode`: `DEEPEP_CUPY_EP_FUSED_NOTIFY` (envs.py:
    None when unset, then only where the receivers count for themselves: one rank, not expanded)."""
    if mode is False:
        return 'DEEPEP_CUPY_EP_FUSED_NOTIFY is off'
    if mode is None and (num_ranks > 1 or do_expand):
        return ('DEEPEP_CUPY_EP_FUSED_NOTIFY is unset: by default only a dispatch at one rank without expansion is '
                'fused (its receivers count for themselves)')
    if cached:
        return 'a cached dispatch has no notify'
    if cpu_sync:
        return 'a CPU-sync dispatch waits for the counts on the host between notify and receive'
    if not one_launch:
        return 'the dispatch runs its send and receive as two launches (DEEPEP_CUPY_EP_DISPATCH_OVERLAP=0)'
    if num_device_sms > FUSED_MAX_COUNT_BLOCKS:
        return f'{num_device_sms} SMs: the fused kernel counts in at most {FUSED_MAX_COUNT_BLOCKS} receiving blocks'
    if fused_smem_bytes(num_experts, num_ranks) > NUM_MAX_FUSED_SMEM_BYTES:
        return f'num_experts={num_experts}: the notify counts exceed the shared memory of a 512-thread block'
    if num_send_blocks + fused_notify_blocks(num_tokens) > num_device_sms:
        return (f'{num_tokens} tokens need {fused_notify_blocks(num_tokens)} notify blocks beside '
                f'{num_send_blocks} sending blocks: more than the GPU has SMs')
    return None


def fused_grid(num_send_blocks: int, epilogue_grid: int, num_notify_blocks: int, num_device_sms: int) -> int:
    """Blocks of a fused launch: the senders, then receivers as the dispatch kernel has them (at most one block per
    SM), at least as many as the notify blocks (the first receivers; `fused_refusal` keeps them within the SMs)."""
    grid = num_send_blocks + min(epilogue_grid, num_device_sms - num_send_blocks)
    return min(num_device_sms, max(grid, num_send_blocks + num_notify_blocks))


def fused_notify_blocks_receive(grid: int, num_send_blocks: int, num_notify_blocks: int, num_ranks: int,
                                do_expand: bool) -> bool:
    """Whether the notify blocks of a fused launch also receive (kernels_cu/ep_fused.cu's rule, here for the tests
    and the GPU lanes' choice of sizes). At one rank without expansion the other receivers count for themselves and
    start long before the notify blocks are done; they take the whole copy when they are at least 3/4 of the
    receivers."""
    num_receivers = grid - num_send_blocks
    return num_ranks > 1 or do_expand or num_receivers < 4 * num_notify_blocks
