"""NVLink bandwidth of this host's GPUs, read once per process from `nvidia-smi nvlink -s` (the SM heuristics of
dispatch and load balancing use it). `deepep_cupy.utils.envs.get_nvlink_gbs` re-exports it."""

import functools
import re
import subprocess

_LINK_GBS = re.compile(r'Link \d+:\s*([\d.]+)\s*GB/s')


def parse_nvlink_gbs(text: str) -> float:
    """Sum of the per-link GB/s of the first GPU block in `nvidia-smi nvlink -s` output (0.0 if there is none)."""
    match = re.search(r'^GPU \d+:.*?(?=^GPU \d+:|^[ \t]*$|\Z)', text, re.MULTILINE | re.DOTALL)
    if match is None:
        return 0.0
    return sum(float(v) for v in _LINK_GBS.findall(match.group(0)))


@functools.lru_cache
def get_nvlink_gbs(factor: float = 0.9) -> float:
    """Usable NVLink bandwidth of one GPU: the sum of its links' GB/s (first GPU of `nvidia-smi nvlink -s`) × `factor`.

    Args:
        factor: the fraction of the link rate a kernel can reach.

    Returns:
        GB/s, or 0.0 when nvidia-smi is missing, fails or lists no NVLink (e.g. PCIe GPUs).
    """
    text = _run(['nvidia-smi', 'nvlink', '-s'])
    return 0.0 if text is None else parse_nvlink_gbs(text) * factor


def _run(args) -> 'str | None':
    """stdout of a short command, or None when it is missing or fails."""
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None
