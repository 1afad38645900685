"""Every environment variable deepep_cupy reads, in one place (documented in the README).

Values are read when asked for, never at import, so tests can change them in-process. The knobs that choose a kernel
design or a stream policy are read together, once per buffer (`DesignKnobs`), and compared across its ranks.
"""

import os
from dataclasses import astuple, dataclass, fields
from typing import Optional, Sequence

_TRUE = ('1', 'true', 'yes', 'on')


def _get_optional_bool(name: str) -> Optional[bool]:
    """None when the variable is unset or blank, else whether it says yes."""
    value = os.environ.get(name)
    return None if value is None or value.strip() == '' else value.strip().lower() in _TRUE


def _get_bool(name: str, default: bool = False) -> bool:
    value = _get_optional_bool(name)
    return default if value is None else value


def _get_int(name: str, default: Optional[int] = None) -> Optional[int]:
    value = os.environ.get(name)
    if value is None or value.strip() == '':
        return default
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f'environment variable {name}={value!r} must be an integer') from e


def jit_debug() -> bool:
    """`DEEPEP_CUPY_JIT_DEBUG` (bool, default off): print every compile, cache hit and its timing."""
    return _get_bool('DEEPEP_CUPY_JIT_DEBUG')


def jit_cache_dir() -> str:
    """`DEEPEP_CUPY_JIT_CACHE_DIR` (path, default `~/.cache/deepep_cupy/jit`): compiled kernel cache."""
    value = os.environ.get('DEEPEP_CUPY_JIT_CACHE_DIR')
    if value:
        return os.path.abspath(os.path.expanduser(value))
    xdg = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    return os.path.join(xdg, 'deepep_cupy', 'jit')


def jit_disable_cache() -> bool:
    """`DEEPEP_CUPY_JIT_DISABLE_CACHE` (bool, default off): always compile, never read or write the disk cache."""
    return _get_bool('DEEPEP_CUPY_JIT_DISABLE_CACHE')


def jit_lineinfo() -> bool:
    """`DEEPEP_CUPY_JIT_LINEINFO` (bool, default off): compile with `-lineinfo` (for profilers and sanitizers)."""
    return _get_bool('DEEPEP_CUPY_JIT_LINEINFO')


def scaleup_size() -> Optional[int]:
    """`DEEPEP_CUPY_SCALEUP_SIZE` (int, default: all NVLink-reachable GPUs of a host): force a smaller scale-up
    domain, e.g. 1 to run the scale-out path between the GPUs of one host."""
    return _get_int('DEEPEP_CUPY_SCALEUP_SIZE')


def rail_transport() -> str:
    """`DEEPEP_CUPY_RAIL_TRANSPORT` (`auto` | `nccl` | `loopback`, default `auto`): how hybrid mode crosses scale-up
    domains: NCCL point-to-point on one communicator per rail, or CUDA-IPC copies between the rail members' buffers
    (one host only; a test double). `auto`: loopback when two members of a rail share a GPU (NCCL refuses that),
    else NCCL."""
    value = (os.environ.get('DEEPEP_CUPY_RAIL_TRANSPORT') or 'auto').strip().lower()
    if value not in ('auto', 'nccl', 'loopback'):
        raise ValueError(f'DEEPEP_CUPY_RAIL_TRANSPORT must be auto, nccl or loopback, got {value!r}')
    return value


def hybrid_pipeline() -> bool:
    """`DEEPEP_CUPY_HYBRID_PIPELINE` (bool, default off): hybrid dispatches send the rail payload in chunks on a side
    stream while the intranode dispatch forwards the rows already landed, and hybrid combines reduce the tokens of
    each landed rail chunk while the next ones travel (P2, features/hybrid/feature.py). A design knob
    (`DesignKnobs`)."""
    return _get_bool('DEEPEP_CUPY_HYBRID_PIPELINE')


def hybrid_pipeline_rows() -> int:
    """`DEEPEP_CUPY_HYBRID_PIPELINE_ROWS` (int, default 0 = automatic): rail rows per chunk of a pipelined hybrid
    dispatch's payload and combine's exchange. A design knob (`DesignKnobs`)."""
    return _get_int('DEEPEP_CUPY_HYBRID_PIPELINE_ROWS', 0)


def device_override() -> Optional[int]:
    """`DEEPEP_CUPY_DEVICE` (int, default `local_rank % num_visible_devices`): the CUDA device of this rank."""
    return _get_int('DEEPEP_CUPY_DEVICE')


def host_override() -> Optional[str]:
    """`DEEPEP_CUPY_HOST` (str, default the hostname): host identity used to group ranks into hosts; ranks that set
    different values act as different hosts (for testing several-host logic on one machine)."""
    return os.environ.get('DEEPEP_CUPY_HOST') or None


def cpu_timeout_secs(default: float) -> float:
    """`DEEPEP_CUPY_CPU_TIMEOUT_SECS` (float, default per call): bound on host-side collective waits."""
    value = os.environ.get('DEEPEP_CUPY_CPU_TIMEOUT_SECS')
    return float(value) if value else default


def use_nvidia_tools() -> bool:
    """`DEEPEP_CUPY_USE_NVIDIA_TOOLS` (bool, default off): the process runs under an external NVIDIA profiler (Nsight
    Systems / Compute), so `utils.testing.bench_kineto` skips torch's profiler and returns 1 s placeholders
    (upstream's `EP_USE_NVIDIA_TOOLS`)."""
    return _get_bool('DEEPEP_CUPY_USE_NVIDIA_TOOLS')


def shadow_deep_ep() -> bool:
    """`DEEPEP_CUPY_SHADOW_DEEP_EP` (bool, default off): let `deepep_cupy.install_as_deep_ep()` and
    `python -m deepep_cupy.as_deep_ep` stand in for `deep_ep` even though a real DeepEP is installed (a warning is
    printed once); without it they refuse."""
    return _get_bool('DEEPEP_CUPY_SHADOW_DEEP_EP')


def ep_dispatch_overlap() -> bool:
    """`DEEPEP_CUPY_EP_DISPATCH_OVERLAP` (bool, default on): a dispatch without CPU sync (or cached) runs its send and
    receive in one launch, the receive overlapping the send; off: a send launch, then a receive launch (as with CPU
    sync). A design knob (`DesignKnobs`)."""
    return _get_bool('DEEPEP_CUPY_EP_DISPATCH_OVERLAP', True)


def ep_fused_notify() -> Optional[bool]:
    """`DEEPEP_CUPY_EP_FUSED_NOTIFY` (bool; unset: where it is the faster design): a dispatch without CPU sync (not
    cached) runs the notify and the dispatch as ONE launch (kernels_cu/ep_fused.cu: the notify blocks publish the send
    positions and the receive layout to the other blocks of the launch through local flags) instead of the notify
    kernel, then the dispatch kernel. Unset (None): at one rank without expansion only, where the receivers count for
    themselves and need nothing from the notify blocks (the faster design there at prefill and decode sizes); on:
    wherever it can serve; off: never. Needs the dispatch in one launch (`DEEPEP_CUPY_EP_DISPATCH_OVERLAP` on, or one
    rank); calls it cannot serve (features/ep/fused.py `fused_refusal`) use the two kernels. A design knob
    (`DesignKnobs`)."""
    return _get_optional_bool('DEEPEP_CUPY_EP_FUSED_NOTIFY')


def ep_fused_cooperative() -> bool:
    """`DEEPEP_CUPY_EP_FUSED_COOPERATIVE` (bool, default on): launch the fused notify and dispatch
    (`DEEPEP_CUPY_EP_FUSED_NOTIFY`) cooperatively, so that the driver guarantees its blocks are co-resident (they wait
    for each other). Off: a plain launch of the same grid (at most one block per SM, as the dispatch and combine
    kernels are launched), for a setting that refuses cooperative launches (e.g. a graph capture). A design knob
    (`DesignKnobs`)."""
    return _get_bool('DEEPEP_CUPY_EP_FUSED_COOPERATIVE', True)


def always_comm_stream() -> bool:
    """`DEEPEP_CUPY_ALWAYS_COMM_STREAM` (bool, default off): run every call on the buffer's communication stream, as
    DeepEP does. Off: a synchronous call without `previous_event` whose outputs are allocated on the current stream
    runs on the current stream (the same order, without four event records / waits; runtime/streams.py). A design
    knob (`DesignKnobs`)."""
    return _get_bool('DEEPEP_CUPY_ALWAYS_COMM_STREAM')


def combine_cap_all_sms() -> bool:
    """`DEEPEP_CUPY_COMBINE_CAP_ALL_SMS` (bool, default off): a combine's `num_sms` (0: the dispatch's) caps every SM
    it takes, senders and reducers together (half each), for callers that overlap compute with it. Off: DeepEP's
    meaning, `num_sms` sending SMs, the reducers take the SMs left (features/ep/plan.py `combine_blocks`). A design
    knob (`DesignKnobs`)."""
    return _get_bool('DEEPEP_CUPY_COMBINE_CAP_ALL_SMS')


def check_tcp_secret(value: str) -> str:
    """`value` if it can serve as `DEEPEP_CUPY_TCP_SECRET` (at least 16 characters), else `ValueError`."""
    if not isinstance(value, str) or len(value) < 16:
        length = len(value) if isinstance(value, str) else type(value).__name__
        raise ValueError(f'DEEPEP_CUPY_TCP_SECRET must be a string of at least 16 characters (got {length}), the same '
                         f'on every rank, e.g. $(python -c "import secrets; print(secrets.token_hex(32))")')
    return value


def tcp_secret() -> Optional[str]:
    """`DEEPEP_CUPY_TCP_SECRET` (str of at least 16 characters, default unset): the secret every rank of a job shares
    to authenticate the TCP host group (jobs without torch and MPI; runtime/tcp_group.py): HMAC-SHA256 on the
    handshake and every frame. Unset: a job meeting at a loopback MASTER_ADDR gets a per-job secret from rank 0
    through a file only this user can read; a job meeting at another address is refused (launch/slurm_srun.sh sets
    one per job)."""
    value = os.environ.get('DEEPEP_CUPY_TCP_SECRET')
    return None if value is None or value == '' else check_tcp_secret(value)


# NCCL between ranks that share one GPU: NCCL refuses two ranks of a communicator on one GPU ("Duplicate GPU")
# unless each rank names its own host with NCCL_HOSTID; it then takes them for separate hosts and connects them
# with its socket transport over the loopback (logic tests only, never timings).
NCCL_SHARED_GPU_ENV = {'NCCL_P2P_DISABLE': '1', 'NCCL_SHM_DISABLE': '1', 'NCCL_IB_DISABLE': '1',
                       'NCCL_SOCKET_IFNAME': 'lo'}
NCCL_HOST_PER_RANK_ENV = 'DEEPEP_CUPY_NCCL_HOST_PER_RANK'


def nccl_hosts_emulated() -> bool:
    """Whether this rank names its own NCCL host (`NCCL_HOSTID`), so NCCL accepts it beside ranks on its GPU."""
    return bool(os.environ.get('NCCL_HOSTID', '').strip())


def nccl_host_per_rank() -> bool:
    """`DEEPEP_CUPY_NCCL_HOST_PER_RANK` (bool, default False): DeepEP's `init_dist`, and the runner for programs that
    bring their own, make every rank its own NCCL host (`emulate_nccl_host`) when ranks share GPUs."""
    return _get_bool(NCCL_HOST_PER_RANK_ENV)


def emulate_nccl_host(host: str) -> None:
    """Let NCCL run between ranks sharing a GPU: `NCCL_HOSTID=host` (unique per rank, or per would-be host) and the
    transports that need no second GPU (`NCCL_SHARED_GPU_ENV`; a variable the caller set keeps its value). Call it
    before NCCL's first communicator in this process."""
    if not host or any(c.isspace() for c in host):
        raise ValueError(f'host must be a non-empty name without spaces, got {host!r}')
    os.environ['NCCL_HOSTID'] = host
    for name, value in NCCL_SHARED_GPU_ENV.items():
        os.environ.setdefault(name, value)


@dataclass(frozen=True)
class DesignKnobs:
    """The knobs that choose a kernel design or a stream policy, which every rank of a buffer must set alike (the
    ranks of one exchange must run one protocol): read once when a buffer is made (`from_env`) and compared across its
    ranks then, with the rest of its configuration (buffers/base.py); its features read them here, not from the
    environment. Each field is the value of the function of the same name (the variable `DEEPEP_CUPY_<FIELD>`)."""

    ep_dispatch_overlap: bool = True
    ep_fused_notify: Optional[bool] = None
    ep_fused_cooperative: bool = True
    combine_cap_all_sms: bool = False
    always_comm_stream: bool = False
    hybrid_pipeline: bool = False
    hybrid_pipeline_rows: int = 0

    @classmethod
    def from_env(cls) -> 'DesignKnobs':
        return cls(ep_dispatch_overlap=ep_dispatch_overlap(), ep_fused_notify=ep_fused_notify(),
                   ep_fused_cooperative=ep_fused_cooperative(), combine_cap_all_sms=combine_cap_all_sms(),
                   always_comm_stream=always_comm_stream(), hybrid_pipeline=hybrid_pipeline(),
                   hybrid_pipeline_rows=hybrid_pipeline_rows())

    def wire(self) -> tuple:
        """The values as a plain tuple (what a host all-gather carries: the TCP group decodes no other classes)."""
        return astuple(self)

    @staticmethod
    def check_alike(gathered: Sequence[tuple], rank: int) -> None:
        """`ValueError` naming every knob whose value differs between the ranks' `wire()` tuples `gathered` (index:
        rank) and the ranks of each value; `rank`: this rank (for the message)."""
        problems = []
        for i, f in enumerate(fields(DesignKnobs)):
            ranks_of = {}
            for r, values in enumerate(gathered):
                ranks_of.setdefault(values[i], []).append(r)
            if len(ranks_of) > 1:
                shown = '; '.join(f'ranks {ranks}: {"unset" if v is None else repr(v)}'
                                  for v, ranks in ranks_of.items())
                problems.append(f'DEEPEP_CUPY_{f.name.upper()} ({shown})')
        if problems:
            raise ValueError(f'{", ".join(problems)}: these environment variables choose a kernel design or stream '
                             f'policy and must be set alike on every rank of a buffer (this is rank {rank})')
