"""A host process group over TCP sockets, for jobs without torch and without MPI (torchrun- or SLURM-style
environments): rank 0 listens on MASTER_ADDR:MASTER_PORT and relays every collective; each wait is bounded.

Nothing a peer sends is decoded before it is authenticated, and nothing authenticated can run code:

- The job's secret is `DEEPEP_CUPY_TCP_SECRET` (the same on every rank; `launch/slurm_srun.sh` makes one per job).
  Unset, a job that meets at a loopback address (one host, the default 127.0.0.1) gets a fresh random secret from rank
  0 through a file only this user can read (`_secret_path`); a job that meets at another address is refused.
- Handshake: rank 0 sends `MAGIC` and a random nonce; the joining rank answers with `HELLO` (its rank, the job size,
  its own nonce, HMAC-SHA256(secret, both nonces, rank, size)). The connection's key is another HMAC of the same
  fields, so nothing recorded on another connection or in another job verifies on this one.
- Then every frame is `HEADER` (kind, body length, capped at `MAX_FRAME_BYTES`), HMAC(connection key, sender,
  receiver, frame count, length, body), body. The MAC is checked before the body is decoded: a frame altered,
  replayed, reordered, sent to another rank or reflected back to its sender does not verify.
- The body is a pickle that `_Unpickler` decodes with every global refused but `SAFE_GLOBALS` (numpy arrays, dtypes
  and scalars; bytearray, complex, set, frozenset): even a rank that holds the secret cannot make a peer call
  anything. The sender checks the same types (`_Pickler`), so a collective given another type fails where it is called.

Rank 0 refuses a connection whose handshake fails (a stranger, another job, a wrong secret): it tells the peer why,
prints the peer's address and the reason, and keeps waiting for the job's ranks. A frame that fails its check on a
joined connection is fatal: `RefusedFrameError` names the peer, its address and the reason, and rank 0 aborts the
collective on every other rank.
"""

import hashlib
import hmac
import io
import ipaddress
import os
import pickle
import secrets
import socket
import stat
import struct
import sys
import tempfile
import time
from typing import Any, Dict, List, NamedTuple, Optional

from .. import envs
from .group import DEFAULT_CPU_TIMEOUT_SECS, ProcessGroup

MAGIC = b'DEEPEPt1'                         # rank 0's first bytes on every connection (wire format version 1)
NONCE_BYTES = 16
TAG_BYTES = 32                              # HMAC-SHA256
HELLO = struct.Struct('>8sII16s32s')        # MAGIC, rank, size, the joining rank's nonce, hello MAC
HEADER = struct.Struct('>BQ')               # frame kind, body bytes
KIND_DATA, KIND_REFUSAL = 1, 2              # a MAC'd pickle; rank 0's reason for refusing a handshake (plain text)
MAX_FRAME_BYTES = 1 << 30                   # one collective's objects (rank 0's reply carries every rank's)
MAX_REFUSAL_BYTES = 4096
HANDSHAKE_SECS = 10.0                       # rank 0's wait for a connection's hello (a rank answers at once)
PICKLE_PROTOCOL = 4
SECRET_VAR = 'DEEPEP_CUPY_TCP_SECRET'

# The only globals a frame may name: what pickle reduces numpy arrays, dtypes and scalars to (numpy 1 and 2 module
# names), and the builtins it reduces bytearray / complex / sets through. None of them runs code of the sender's
# choosing: the reconstructors build an array or a scalar from data, whose objects (object arrays) are decoded
# under the same rule.
SAFE_GLOBALS = frozenset({
    ('builtins', 'bytearray'), ('builtins', 'complex'), ('builtins', 'set'), ('builtins', 'frozenset'),
    ('numpy', 'dtype'), ('numpy', 'ndarray'),
    *((f'{core}.multiarray', name) for core in ('numpy.core', 'numpy._core') for name in ('_reconstruct', 'scalar')),
    *((f'{core}.numeric', '_frombuffer') for core in ('numpy.core', 'numpy._core')),
})
PLAIN_TYPES = ('None, bool, int, float, complex, str, bytes, bytearray, tuple, list, dict, set, frozenset, numpy '
               'arrays, dtypes and scalars')


class RefusedFrameError(ConnectionError):
    """A peer's frame failed its check (MAC, size, kind, or a type the decoder refuses): the connection cannot be
    trusted any more."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in SAFE_GLOBALS:
            raise pickle.UnpicklingError(f'it names the global {module!r}.{name!r}, and the TCP group decodes only '
                                         f'{PLAIN_TYPES}')
        return super().find_class(module, name)


class _Pickler(pickle.Pickler):
    # Called for every object pickle has no fast path for (not for exact None, bool, int, float, str, bytes, tuple,
    # list, dict, set, frozenset): what `_Unpickler` would refuse fails here, on the rank that sent it.
    def reducer_override(self, obj):
        np = sys.modules.get('numpy')
        if type(obj) in (bytearray, complex, set, frozenset) or any(obj is g for g in _safe_global_objects()):
            return NotImplemented
        if np is not None and (type(obj) is np.ndarray or isinstance(obj, (np.dtype, np.generic))):
            return NotImplemented
        raise TypeError(f'the TCP process group carries {PLAIN_TYPES}; got {type(obj).__module__}.'
                        f'{type(obj).__qualname__} (convert it, e.g. to a tuple, a dict or a str)')


def _safe_global_objects() -> List[Any]:
    modules = ((sys.modules.get(module), name) for module, name in SAFE_GLOBALS)
    return [getattr(m, name) for m, name in modules if m is not None and hasattr(m, name)]


def encode(obj: Any) -> bytes:
    """`obj` as a frame body; `TypeError` for a type the receiving `decode` would refuse."""
    out = io.BytesIO()
    _Pickler(out, protocol=PICKLE_PROTOCOL).dump(obj)
    return out.getvalue()


def decode(body: bytes) -> Any:
    """A frame body back to its object; `pickle.UnpicklingError` (or another error of a malformed pickle) for
    anything outside `PLAIN_TYPES`, before any of it is called."""
    return _Unpickler(io.BytesIO(body)).load()


def hello_tag(secret: bytes, server_nonce: bytes, client_nonce: bytes, rank: int, size: int) -> bytes:
    return hmac.new(secret, b'deepep_cupy tcp hello\0' + server_nonce + client_nonce + struct.pack('>II', rank, size),
                    hashlib.sha256).digest()


def link_key(secret: bytes, server_nonce: bytes, client_nonce: bytes, rank: int, size: int) -> bytes:
    return hmac.new(secret, b'deepep_cupy tcp key\0' + server_nonce + client_nonce + struct.pack('>II', rank, size),
                    hashlib.sha256).digest()


def frame_tag(key: bytes, send_rank: int, recv_rank: int, frame_idx: int, body: bytes) -> bytes:
    fields = struct.pack('>IIQQ', send_rank, recv_rank, frame_idx, len(body))
    return hmac.new(key, b'deepep_cupy tcp frame\0' + fields + body, hashlib.sha256).digest()


class _Deadline(NamedTuple):
    at: float           # time.monotonic() value
    secs: float         # the bound it came from, quoted in errors

    @classmethod
    def after(cls, secs: float) -> '_Deadline':
        return cls(time.monotonic() + secs, secs)

    def left(self) -> float:
        return self.at - time.monotonic()


def _recv_exact(sock: socket.socket, num_bytes: int, deadline: _Deadline, what: str) -> bytes:
    chunks, received = [], 0
    while received < num_bytes:
        remaining = deadline.left()
        if remaining <= 0:
            raise TimeoutError(f'{what} did not arrive within {deadline.secs:g} s ({received} of {num_bytes} bytes '
                               f'came)')
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(num_bytes - received, 1 << 20))
        except socket.timeout:
            continue
        if not chunk:
            raise ConnectionError(f'{what}: the connection closed after {received} of {num_bytes} bytes (the peer '
                                  f'exited, failed or was refused)')
        chunks.append(chunk)
        received += len(chunk)
    return b''.join(chunks)


def _address(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f'{host}:{port}'
    except OSError:
        return 'an unknown address'


class _Link:
    """One authenticated connection: its socket, both ranks, the connection key and the frames counted each way."""

    def __init__(self, sock: socket.socket, key: bytes, own_rank: int, peer_rank: int, address: str):
        self.sock, self.key, self.own_rank, self.peer_rank, self.address = sock, key, own_rank, peer_rank, address
        self.num_sent = self.num_received = 0

    def send(self, obj: Any) -> None:
        body = encode(obj)
        if len(body) > MAX_FRAME_BYTES:
            raise ValueError(f'rank {self.own_rank}: a {len(body)}-byte object exceeds the TCP group\'s frame cap of '
                             f'{MAX_FRAME_BYTES} bytes')
        tag = frame_tag(self.key, self.own_rank, self.peer_rank, self.num_sent, body)
        self.num_sent += 1
        self.sock.sendall(HEADER.pack(KIND_DATA, len(body)) + tag + body)

    def recv(self, deadline: _Deadline, what: str, refusal_ok: bool = False) -> Any:
        what = f'rank {self.own_rank}: {what} from rank {self.peer_rank} at {self.address}'
        kind, num_bytes = HEADER.unpack(_recv_exact(self.sock, HEADER.size, deadline, what))
        if kind == KIND_REFUSAL and refusal_ok and num_bytes <= MAX_REFUSAL_BYTES:
            reason = _recv_exact(self.sock, num_bytes, deadline, what).decode('utf-8', 'replace')
            raise ConnectionRefusedError(f'{what}: rank 0 refused this rank: {reason!r}')
        if kind != KIND_DATA:
            raise RefusedFrameError(f'{what}: refused a frame of unknown kind {kind} ({num_bytes} bytes)')
        if num_bytes > MAX_FRAME_BYTES:
            raise RefusedFrameError(f'{what}: refused a {num_bytes}-byte frame, over the cap of {MAX_FRAME_BYTES} '
                                    f'bytes (not read)')
        tag = _recv_exact(self.sock, TAG_BYTES, deadline, what)
        body = _recv_exact(self.sock, num_bytes, deadline, what)
        if not hmac.compare_digest(tag, frame_tag(self.key, self.peer_rank, self.own_rank, self.num_received, body)):
            raise RefusedFrameError(f'{what}: refused frame {self.num_received}: its MAC does not verify (altered, '
                                    f'replayed, out of order, or not from this connection); nothing of it was decoded')
        self.num_received += 1
        try:
            return decode(body)
        except Exception as e:  # noqa: BLE001 (any malformed or forbidden pickle is the same refusal)
            raise RefusedFrameError(f'{what}: refused frame {self.num_received - 1} although its MAC verifies: '
                                    f'{type(e).__name__}: {e}') from None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class _HandshakeRefused(Exception):
    """Rank 0 refuses a connection before it joins (the reason goes back to the peer)."""


def is_loopback(addr: str) -> bool:
    """Whether `addr` is this host's loopback (`localhost` or a loopback IP; host names are not resolved)."""
    if addr == 'localhost':
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _secret_path(port: int) -> str:
    """Where rank 0 of a one-host job without `DEEPEP_CUPY_TCP_SECRET` leaves its secret: a file in a directory of
    this user's with mode 0700, named after the port (one job per port)."""
    directory = os.path.join(tempfile.gettempdir(), f'deepep_cupy-{os.getuid()}')
    os.makedirs(directory, mode=0o700, exist_ok=True)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f'{directory} must be a directory of this user with mode 0700 (it holds the TCP group\'s '
                              f'secrets): remove it, or set {SECRET_VAR} to the same value on every rank')
    return os.path.join(directory, f'tcp-group-{port}.secret')


def _publish_secret(path: str) -> bytes:
    secret = secrets.token_hex(32)
    tmp = f'{path}.{os.getpid()}.{secrets.token_hex(4)}'
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, 'w') as f:
        f.write(secret)
    os.replace(tmp, path)
    return secret.encode()


class TcpProcessGroup(ProcessGroup):
    """A group over plain TCP sockets, for jobs started without MPI and without torch (SLURM `srun`, or RANK /
    WORLD_SIZE set by hand). Rank 0 listens on `master_addr:master_port` (on the loopback only when that is a
    loopback address), every other rank connects to it and proves it holds the job's secret; a collective sends every
    rank's object to rank 0, which sends the full list back, each frame authenticated (see the module docstring).
    Every wait is bounded by the timeout and raises `TimeoutError` naming the ranks that did not arrive.

    Args:
        rank, size: this rank and the number of ranks.
        master_addr, master_port: where rank 0 listens.
        timeout: bound in seconds for the rendezvous and for every collective (default `DEEPEP_CUPY_CPU_TIMEOUT_SECS`,
            else 300).
        origin: what announced the job (launcher and variables), quoted in errors.
        secret: the job's secret, the same on every rank (default `DEEPEP_CUPY_TCP_SECRET`; unset: rank 0 makes one
            and hands it over a private file, for a loopback `master_addr` only).

    Attributes:
        refused: rank 0's refused connections, `'address: reason'` each.
    """

    backend = 'tcp'

    def __init__(self, rank: int, size: int, master_addr: str, master_port: int, timeout: Optional[float] = None,
                 origin: str = 'the environment', secret: Optional[str] = None):
        if not 0 <= rank < size:
            raise ValueError(f'rank {rank} is outside [0, {size}) ({origin})')
        self.master_addr, self.master_port, self.origin = master_addr, int(master_port), origin
        self.default_timeout = envs.cpu_timeout_secs(timeout or DEFAULT_CPU_TIMEOUT_SECS)
        self.loopback = is_loopback(master_addr)
        secret = envs.tcp_secret() if secret is None else envs.check_tcp_secret(secret)
        self._secret = None if secret is None else secret.encode()
        if size > 1 and self._secret is None and not self.loopback:
            raise RuntimeError(
                f'rank {rank}: this {size}-rank job meets at {master_addr}:{self.master_port}, not a loopback address, '
                f'and {SECRET_VAR} is not set, so nothing would tell its ranks from a stranger: export the same random '
                f'value on every rank, e.g. {SECRET_VAR}=$(python -c "import secrets; print(secrets.token_hex(32))") '
                f'in the job script before srun (launch/slurm_srun.sh does this) ({origin})')
        self._seq = 0
        self._peers: Dict[int, _Link] = {}      # rank 0: peer rank -> link
        self._root: Optional[_Link] = None      # other ranks: the link to rank 0
        self._failed: Optional[str] = None
        self.refused: List[str] = []
        super().__init__(rank, size)
        deadline = _Deadline.after(self.default_timeout)
        if size > 1 and rank == 0:
            self._serve(deadline)
        elif size > 1:
            self._join(deadline)
        self._init_hosts()

    # -- rendezvous, rank 0 -----------------------------------------------------------------------------------------
    def _serve(self, deadline: _Deadline) -> None:
        bind_addr = ('127.0.0.1' if self.master_addr == 'localhost' else self.master_addr) if self.loopback else ''
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        secret_path = None
        try:
            try:
                server.bind((bind_addr, self.master_port))
            except OSError as e:
                raise RuntimeError(f'rank 0 cannot listen on {bind_addr or "every interface"} port {self.master_port} '
                                   f'({e}); set MASTER_PORT to a free port ({self.origin})') from e
            secret = self._secret
            if secret is None:      # written before listen(): whoever reaches this port reads this job's secret
                secret_path = _secret_path(self.master_port)
                secret = _publish_secret(secret_path)
            server.listen(self.size)
            while len(self._peers) < self.size - 1:
                if deadline.left() <= 0:
                    missing = sorted(set(range(1, self.size)) - set(self._peers))
                    refused = (f'; refused {len(self.refused)} connection(s): {"; ".join(self.refused)}'
                               if self.refused else '')
                    self._abort(f'ranks {missing} never joined')
                    raise TimeoutError(
                        f'rank 0: {len(missing)} of {self.size} ranks did not join within {self.default_timeout:g} s '
                        f'(missing ranks {missing}); {self.origin} announced {self.size} ranks, so start all of them '
                        f'(e.g. srun -n {self.size}, torchrun --nproc-per-node {self.size}) or fix those variables'
                        f'{refused}')
                server.settimeout(deadline.left())
                try:
                    sock, _ = server.accept()
                except socket.timeout:
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                address = _address(sock)
                try:
                    link, peer_size = self._accept(sock, address, secret, deadline)
                except _HandshakeRefused as e:
                    self._refuse(sock, address, str(e))
                    continue
                if peer_size != self.size or not 0 < link.peer_rank < self.size or link.peer_rank in self._peers:
                    self._refuse(sock, address, f'rank 0 expects ranks 1..{self.size - 1} of {self.size}, and ranks '
                                                f'{sorted(self._peers)} already joined')
                    self._abort(f'a process joined as rank {link.peer_rank} of {peer_size}')
                    raise RuntimeError(f'rank 0: a process at {address} joined as rank {link.peer_rank} of '
                                       f'{peer_size}, but this job has {self.size} ranks and ranks '
                                       f'{sorted(self._peers)} already joined ({self.origin})')
                self._peers[link.peer_rank] = link
        finally:
            if secret_path is not None:     # every rank read it (or the rendezvous failed); before the port is free
                try:
                    os.unlink(secret_path)
                except OSError:
                    pass
            server.close()
        for link in self._peers.values():
            link.send((0, 'ready'))

    def _accept(self, sock: socket.socket, address: str, secret: bytes, deadline: _Deadline):
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        hello_deadline = _Deadline.after(max(0.01, min(HANDSHAKE_SECS, deadline.left())))
        try:
            sock.settimeout(hello_deadline.left())
            sock.sendall(MAGIC + server_nonce)
            data = _recv_exact(sock, HELLO.size, hello_deadline, 'its hello')
        except (OSError, TimeoutError) as e:      # ConnectionError is an OSError
            raise _HandshakeRefused(str(e)) from None
        magic, peer_rank, peer_size, client_nonce, tag = HELLO.unpack(data)
        if magic != MAGIC:
            raise _HandshakeRefused(f'its hello does not start with {MAGIC!r} (not a deepep_cupy rank, or another '
                                    f'version of it)')
        if not hmac.compare_digest(tag, hello_tag(secret, server_nonce, client_nonce, peer_rank, peer_size)):
            raise _HandshakeRefused(f'its hello\'s MAC does not verify: it does not hold this job\'s secret '
                                    f'({SECRET_VAR} differs between the ranks, or it is another job\'s rank or a '
                                    f'replay)')
        key = link_key(secret, server_nonce, client_nonce, peer_rank, peer_size)
        return _Link(sock, key, 0, peer_rank, address), peer_size

    def _refuse(self, sock: socket.socket, address: str, reason: str) -> None:
        self.refused.append(f'{address}: {reason}')
        print(f'deepep_cupy: rank 0 of the TCP group ({self.master_addr}:{self.master_port}) refused a connection '
              f'from {address}: {reason}', file=sys.stderr, flush=True)
        text = reason.encode()[:MAX_REFUSAL_BYTES]
        try:
            sock.settimeout(1.0)
            sock.sendall(HEADER.pack(KIND_REFUSAL, len(text)) + text)
        except OSError:
            pass
        sock.close()

    # -- rendezvous, other ranks ------------------------------------------------------------------------------------
    def _join(self, deadline: _Deadline) -> None:
        where = f'{self.master_addr}:{self.master_port}'
        delay = 0.01
        while True:
            try:
                sock = socket.create_connection((self.master_addr, self.master_port),
                                                timeout=max(0.1, min(5.0, deadline.left())))
                break
            except OSError as e:
                if time.monotonic() + delay > deadline.at:
                    raise TimeoutError(f'rank {self.rank}: could not reach rank 0 at {where} within '
                                       f'{self.default_timeout:g} s ({e}); {self.origin} announced {self.size} ranks: '
                                       f'start rank 0 too, or set MASTER_ADDR/MASTER_PORT to where it runs') from e
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            head = _recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline, f'rank {self.rank}: rank 0\'s challenge '
                                                                           f'({where})')
            if head[:len(MAGIC)] != MAGIC:
                raise ConnectionError(f'rank {self.rank}: {where} is not rank 0 of a deepep_cupy TCP group (it sent '
                                      f'{head[:len(MAGIC)]!r}, not {MAGIC!r}): another service or version on '
                                      f'MASTER_PORT? ({self.origin})')
            secret = self._secret if self._secret is not None else self._read_secret(where)
            server_nonce, client_nonce = head[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
            tag = hello_tag(secret, server_nonce, client_nonce, self.rank, self.size)
            sock.sendall(HELLO.pack(MAGIC, self.rank, self.size, client_nonce, tag))
            link = _Link(sock, link_key(secret, server_nonce, client_nonce, self.rank, self.size), self.rank, 0, where)
            seq, reply = link.recv(deadline, 'the go-ahead', refusal_ok=True)
        except BaseException:
            sock.close()
            raise
        if seq < 0:
            link.close()
            raise TimeoutError(f'rank {self.rank}: rank 0 gave up: {reply} ({self.origin})')
        self._root = link

    def _read_secret(self, where: str) -> bytes:
        path = _secret_path(self.master_port)
        try:
            with open(path) as f:
                secret = f.read().strip()
        except OSError as e:
            raise ConnectionError(f'rank {self.rank}: rank 0 at {where} listens, but its secret file cannot be read '
                                  f'({e}); without {SECRET_VAR} the ranks of one host share a per-job secret through '
                                  f'{os.path.dirname(path)}: ranks that do not share it (containers, another TMPDIR) '
                                  f'or a rank 0 that has {SECRET_VAR} need it set to the same value on every rank '
                                  f'({self.origin})') from e
        return secret.encode()

    # -- collectives ------------------------------------------------------------------------------------------------
    def _abort(self, reason: str) -> None:
        """Rank 0: tell every joined rank that the group failed (best effort), then close the links."""
        for link in self._peers.values():
            try:
                link.sock.settimeout(1.0)
                link.send((-1, reason))
            except (OSError, ValueError, TypeError):
                pass
        self.close()
        self._failed = reason

    def allgather_object(self, obj, timeout=None):
        deadline = _Deadline.after(self.default_timeout if timeout is None else timeout)
        self._seq += 1
        if self.size == 1:
            return [obj]
        if self._failed is not None:
            raise RuntimeError(f'rank {self.rank}: this TCP group failed earlier ({self._failed}); it cannot run '
                               f'collective {self._seq}')
        if self.rank != 0:
            try:
                self._root.send((self._seq, obj))
                seq, values = self._root.recv(deadline, 'the all-gather result')
            except (RefusedFrameError, ConnectionError) as e:     # the link to rank 0 cannot be trusted or is gone
                self.close()
                self._failed = str(e)
                raise
            if seq < 0:
                self.close()
                self._failed = values
                raise RuntimeError(f'rank {self.rank}: rank 0 aborted collective {self._seq}: {values}')
            if seq != self._seq:
                raise RuntimeError(f'rank {self.rank}: collective {self._seq} got reply {seq} from rank 0: {values}')
            return values
        values = [obj] + [None] * (self.size - 1)
        try:
            for peer, link in sorted(self._peers.items()):
                try:
                    seq, values[peer] = link.recv(deadline, 'the all-gather input')
                except TimeoutError as e:
                    missing = [p for p in range(1, self.size) if p >= peer]
                    raise TimeoutError(f'{e} (ranks not yet heard from: {missing}; a peer is hung, exited or called '
                                       f'a different collective)') from e
                if seq != self._seq:
                    raise RuntimeError(f'rank 0: rank {peer} is at collective {seq}, rank 0 at {self._seq} (the ranks '
                                       f'called different collectives)')
            for link in self._peers.values():
                link.send((self._seq, values))
        except Exception as e:
            self._abort(f'rank 0 failed collective {self._seq}: {e}')
            raise
        return values

    def close(self) -> None:
        for link in [*self._peers.values(), *([self._root] if self._root is not None else [])]:
            link.close()
        self._peers, self._root = {}, None
