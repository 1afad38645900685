"""A host process group over TCP sockets, for jobs without torch and without MPI (torchrun- or SLURM-style
environments): rank 0 listens on MASTER_ADDR:MASTER_PORT and relays every collective; each wait is bounded."""

import pickle
import socket
import struct
import time
from typing import Any, Optional

from .. import envs
from .group import DEFAULT_CPU_TIMEOUT_SECS, ProcessGroup


class TcpProcessGroup(ProcessGroup):
    """A group over plain TCP sockets, for jobs started without MPI and without torch (SLURM `srun`, or RANK /
    WORLD_SIZE set by hand). Rank 0 listens on `master_addr:master_port`, every other rank connects to it; a
    collective sends every rank's object to rank 0, which sends the full list back. Every wait is bounded by the
    timeout and raises `TimeoutError` naming the ranks that did not arrive.

    Args:
        rank, size: this rank and the number of ranks.
        master_addr, master_port: where rank 0 listens.
        timeout: bound in seconds for the rendezvous and for every collective (default `DEEPEP_CUPY_CPU_TIMEOUT_SECS`,
            else 300).
        origin: what announced the job (launcher and variables), quoted in errors.
    """

    backend = 'tcp'

    def __init__(self, rank: int, size: int, master_addr: str, master_port: int, timeout: Optional[float] = None,
                 origin: str = 'the environment'):
        if not 0 <= rank < size:
            raise ValueError(f'rank {rank} is outside [0, {size}) ({origin})')
        self.master_addr, self.master_port, self.origin = master_addr, int(master_port), origin
        self.default_timeout = envs.cpu_timeout_secs(timeout or DEFAULT_CPU_TIMEOUT_SECS)
        self._seq = 0
        self._peers = {}        # rank 0: peer rank -> socket
        self._root = None       # other ranks: the socket to rank 0
        super().__init__(rank, size)
        deadline = time.monotonic() + self.default_timeout
        if size > 1:
            self._rendezvous(deadline)
        self._init_hosts()

    # Framing: 8-byte big-endian length, then a pickled (sequence number, payload) pair
    @staticmethod
    def _send(sock: socket.socket, obj: Any) -> None:
        data = pickle.dumps(obj)
        sock.sendall(struct.pack('>Q', len(data)) + data)

    def _recv(self, sock: socket.socket, deadline: float, what: str) -> Any:
        header = self._recv_exact(sock, 8, deadline, what)
        return pickle.loads(self._recv_exact(sock, struct.unpack('>Q', header)[0], deadline, what))

    def _recv_exact(self, sock: socket.socket, num_bytes: int, deadline: float, what: str) -> bytes:
        chunks, received = [], 0
        while received < num_bytes:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f'rank {self.rank}: {what} did not arrive within {self.default_timeout:g} s')
            sock.settimeout(remaining)
            try:
                chunk = sock.recv(min(num_bytes - received, 1 << 20))
            except socket.timeout:
                continue
            if not chunk:
                raise ConnectionError(f'rank {self.rank}: {what}: the connection closed (the peer exited or failed)')
            chunks.append(chunk)
            received += len(chunk)
        return b''.join(chunks)

    def _rendezvous(self, deadline: float) -> None:
        where = f'{self.master_addr}:{self.master_port}'
        if self.rank == 0:
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                server.bind(('', self.master_port))
            except OSError as e:
                raise RuntimeError(f'rank 0 cannot listen on port {self.master_port} ({e}); set MASTER_PORT to a free '
                                   f'port ({self.origin})') from e
            server.listen(self.size)
            try:
                while len(self._peers) < self.size - 1:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        missing = sorted(set(range(1, self.size)) - set(self._peers))
                        for sock in self._peers.values():
                            self._send(sock, (-1, f'ranks {missing} never joined'))
                        raise TimeoutError(
                            f'rank 0: {len(missing)} of {self.size} ranks did not join within '
                            f'{self.default_timeout:g} s (missing ranks {missing}); {self.origin} announced '
                            f'{self.size} ranks, so start all of them (e.g. srun -n {self.size}, torchrun '
                            f'--nproc-per-node {self.size}) or fix those variables')
                    server.settimeout(remaining)
                    try:
                        sock, _ = server.accept()
                    except socket.timeout:
                        continue
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    peer_rank, peer_size = self._recv(sock, deadline, 'a joining rank\'s hello')[1]
                    if peer_size != self.size or not 0 < peer_rank < self.size or peer_rank in self._peers:
                        self._send(sock, (-1, f'rank 0 expects ranks 1..{self.size - 1} of {self.size}'))
                        raise RuntimeError(f'rank 0: a process joined as rank {peer_rank} of {peer_size}, but this '
                                           f'job has {self.size} ranks and ranks {sorted(self._peers)} already joined '
                                           f'({self.origin})')
                    self._peers[peer_rank] = sock
            finally:
                server.close()
            for sock in self._peers.values():
                self._send(sock, (0, 'ready'))
            return

        delay = 0.01
        while True:
            try:
                sock = socket.create_connection((self.master_addr, self.master_port),
                                                timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                break
            except OSError as e:
                if time.monotonic() + delay > deadline:
                    raise TimeoutError(f'rank {self.rank}: could not reach rank 0 at {where} within '
                                       f'{self.default_timeout:g} s ({e}); {self.origin} announced {self.size} ranks: '
                                       f'start rank 0 too, or set MASTER_ADDR/MASTER_PORT to where it runs') from e
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send(sock, (0, (self.rank, self.size)))
        seq, reply = self._recv(sock, deadline, f'rank 0\'s go-ahead ({where})')
        if seq < 0:
            raise TimeoutError(f'rank {self.rank}: rank 0 gave up: {reply} ({self.origin})')
        self._root = sock

    def allgather_object(self, obj, timeout=None):
        deadline = time.monotonic() + (self.default_timeout if timeout is None else timeout)
        self._seq += 1
        if self.size == 1:
            return [obj]
        if self.rank != 0:
            self._send(self._root, (self._seq, obj))
            seq, values = self._recv(self._root, deadline, 'the all-gather result from rank 0')
            if seq != self._seq:
                raise RuntimeError(f'rank {self.rank}: collective {self._seq} got reply {seq} from rank 0: {values}')
            return values
        values = [obj] + [None] * (self.size - 1)
        for peer, sock in sorted(self._peers.items()):
            try:
                seq, values[peer] = self._recv(sock, deadline, f'rank {peer}\'s all-gather input')
            except TimeoutError as e:
                missing = [p for p in range(1, self.size) if p >= peer]
                raise TimeoutError(f'{e} (ranks not yet heard from: {missing}; a peer is hung, exited or called a '
                                   f'different collective)') from e
            if seq != self._seq:
                raise RuntimeError(f'rank 0: rank {peer} is at collective {seq}, rank 0 at {self._seq} (the ranks '
                                   f'called different collectives)')
        for sock in self._peers.values():
            self._send(sock, (self._seq, values))
        return values

    def close(self) -> None:
        for sock in [*self._peers.values(), *([self._root] if self._root is not None else [])]:
            try:
                sock.close()
            except OSError:
                pass
        self._peers, self._root = {}, None
