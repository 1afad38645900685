"""The TCP host group (runtime/tcp_group.py) runs nothing a stranger sends: real ranks on 127.0.0.1 exchange data;
hand-made peers that speak its wire format byte by byte (the module docstring) send a wrong secret, a wrong MAC, a
pickle that would run a shell command (with and without a valid MAC), truncated and oversized frames and replays,
and every one is refused with an error naming the peer's address and the reason, within the timeout."""

import hashlib
import hmac
import os
import pickle
import re
import socket
import stat
import struct
import threading
import time

import numpy as np
import pytest

from deepep_cupy.runtime import group as _group  # noqa: F401  (runtime.group first: it imports tcp_group)
from deepep_cupy.runtime import tcp_group as tg

SECRET = 'test-secret-0123456789abcdef'
TIMEOUT = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def in_thread(fn):
    """Run `fn` on a thread; the returned callable joins it (bounded) and gives {'value': ...} or {'error': ...}."""
    box = {}

    def run():
        try:
            box['value'] = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            box['error'] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result(timeout=TIMEOUT + 10):
        thread.join(timeout)
        assert not thread.is_alive(), 'the rank hung'
        return box
    return result


def rank0(port, size=2, timeout=TIMEOUT, secret=SECRET):
    return in_thread(lambda: tg.TcpProcessGroup(0, size, '127.0.0.1', port, timeout=timeout, secret=secret))


def recv_exact(sock, num_bytes):
    data = b''
    while len(data) < num_bytes:
        chunk = sock.recv(num_bytes - len(data))
        if not chunk:
            raise ConnectionError(f'closed after {len(data)} of {num_bytes} bytes')
        data += chunk
    return data


def mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b''.join(parts), hashlib.sha256).digest()


class Evil:
    """Unpickled by plain `pickle.loads`, this runs `touch marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f'touch {self.marker}',)


class RawRank:
    """A joining rank written from the wire format alone (not with tcp_group's helpers), to send what a real rank
    never would."""

    def __init__(self, port, rank, size, secret=SECRET):
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                self.sock = socket.create_connection(('127.0.0.1', port), timeout=TIMEOUT)
                break
            except OSError:
                assert time.monotonic() < deadline, 'rank 0 never listened'
                time.sleep(0.02)
        self.rank, self.size, self.secret = rank, size, secret.encode()
        head = recv_exact(self.sock, 8 + 16)
        assert head[:8] == b'DEEPEPt1', head
        self.server_nonce, self.client_nonce = head[8:], os.urandom(16)
        fields = self.server_nonce + self.client_nonce + struct.pack('>II', rank, size)
        self.key = mac(self.secret, b'deepep_cupy tcp key\0', fields)
        self.hello_bytes = struct.pack('>8sII16s32s', b'DEEPEPt1', rank, size, self.client_nonce,
                                       mac(self.secret, b'deepep_cupy tcp hello\0', fields))
        self.num_sent = self.num_received = 0

    def hello(self, data=None):
        self.sock.sendall(self.hello_bytes if data is None else data)

    def frame(self, body: bytes, tag=None, frame_idx=None) -> bytes:
        idx = self.num_sent if frame_idx is None else frame_idx
        tag = tag or mac(self.key, b'deepep_cupy tcp frame\0', struct.pack('>IIQQ', self.rank, 0, idx, len(body)), body)
        self.num_sent += 1
        return struct.pack('>BQ', 1, len(body)) + tag + body

    def send(self, obj) -> bytes:
        data = self.frame(pickle.dumps(obj))
        self.sock.sendall(data)
        return data

    def recv(self):
        """Rank 0's next frame, its MAC checked here (what rank 0 sends is in the documented format too)."""
        kind, num_bytes = struct.unpack('>BQ', recv_exact(self.sock, 9))
        assert kind == 1, kind
        tag, body = recv_exact(self.sock, 32), recv_exact(self.sock, num_bytes)
        fields = struct.pack('>IIQQ', 0, self.rank, self.num_received, num_bytes)
        assert hmac.compare_digest(tag, mac(self.key, b'deepep_cupy tcp frame\0', fields, body))
        self.num_received += 1
        return pickle.loads(body)

    def join(self):
        """Hello, rank 0's go-ahead, then this rank's part of the hosts all-gather the constructor runs."""
        self.hello()
        assert self.recv() == (0, 'ready')
        self.send((1, f'raw-host-{self.rank}'))

    def closed_within(self, secs=TIMEOUT) -> bool:
        """Whether rank 0 closes this connection (after its abort frame, if any) within `secs`."""
        self.sock.settimeout(secs)
        try:
            while self.sock.recv(1 << 16):
                pass
            return True
        except ConnectionResetError:            # closed with bytes of ours unread
            return True
        except socket.timeout:
            return False


def evil_pickle(marker) -> bytes:
    return pickle.dumps((1, Evil(marker)))


def test_the_evil_payload_runs_under_plain_pickle(tmp_path):
    """The control: the payload the refusals below are given does run a command when unpickled without them."""
    marker = tmp_path / 'control'
    pickle.loads(evil_pickle(marker))
    assert marker.exists()


# -------------------------------------------------------------------------------------------------------------------
# Real ranks


@pytest.mark.parametrize('secret', [SECRET, None], ids=['secret', 'no-secret-one-host'])
@pytest.mark.parametrize('num_ranks', [2, 3])
def test_ranks_exchange_plain_data(monkeypatch, secret, num_ranks):
    """2-3 ranks with the secret given, or none (rank 0 hands a per-job secret over a private file, removed once
    every rank joined): every type the collectives carry arrives equal."""
    monkeypatch.delenv('DEEPEP_CUPY_TCP_SECRET', raising=False)
    port = free_port()

    def rank(r):
        g = tg.TcpProcessGroup(r, num_ranks, '127.0.0.1', port, timeout=TIMEOUT, secret=secret)
        obj = (r, f'rank{r}', bytes([r]) * 128, None, True, 1.5, 2j, bytearray(b'ab'), [r, (r,)], frozenset({r}),
               {('pair', r): {r, r + 1}}, np.arange(r + 3, dtype=np.int32), np.float32(r), np.dtype('float16'))
        got = g.allgather_object(obj)
        token = g.broadcast_object(f'uid-{r}', root=0)
        g.barrier()
        g.close()
        return obj, got, token, g.size, g.local_size
    results = [in_thread(lambda r=r: rank(r)) for r in range(num_ranks)]
    outs = [res() for res in results]
    assert all('error' not in o for o in outs), [o.get('error') for o in outs]
    sent = [o['value'][0] for o in outs]
    for _, got, token, size, local_size in (o['value'] for o in outs):
        assert (token, size, local_size) == ('uid-0', num_ranks, num_ranks)
        for r, (a, b) in enumerate(zip(got, sent)):
            assert pickle.dumps(a) == pickle.dumps(b), f'rank {r}: expected {b}, got {a}'
    if secret is None:
        path = tg._secret_path(port)
        assert not os.path.exists(path), 'rank 0 left the job secret behind'
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


def test_a_wrong_secret_is_refused_and_rank0_keeps_waiting():
    port = free_port()
    result = rank0(port)
    with pytest.raises(ConnectionRefusedError, match=r'rank 0 at 127\.0\.0\.1:\d+: rank 0 refused this rank: '
                                                     r'.*MAC does not verify.*DEEPEP_CUPY_TCP_SECRET'):
        tg.TcpProcessGroup(1, 2, '127.0.0.1', port, timeout=TIMEOUT, secret='not-the-secret-at-all')
    good = tg.TcpProcessGroup(1, 2, '127.0.0.1', port, timeout=TIMEOUT, secret=SECRET)
    out = result()
    assert 'error' not in out, out
    refused, = out['value'].refused
    assert refused.startswith('127.0.0.1:') and 'MAC does not verify' in refused, refused
    good.close()
    out['value'].close()


def test_refusals_are_named_when_nobody_good_joins():
    port = free_port()
    result = rank0(port, timeout=3)
    with pytest.raises(ConnectionRefusedError):
        tg.TcpProcessGroup(1, 2, '127.0.0.1', port, timeout=TIMEOUT, secret='not-the-secret-at-all')
    error = result()['error']
    assert isinstance(error, TimeoutError) and 'missing ranks [1]' in str(error), error
    assert 'refused 1 connection(s): 127.0.0.1:' in str(error) and 'MAC does not verify' in str(error), error


def test_a_stranger_sending_a_pickle_is_refused_at_the_hello(tmp_path):
    """Something that connects and sends a pickle straight away: its bytes are read as a fixed-size hello (no
    decoding), refused, and rank 0 goes on to let the real rank 1 join."""
    marker = tmp_path / 'stranger'
    port = free_port()
    result = rank0(port)
    raw = RawRank(port, 1, 2)
    raw.hello(evil_pickle(marker) + b'\0' * 64)
    assert raw.closed_within()
    good = tg.TcpProcessGroup(1, 2, '127.0.0.1', port, timeout=TIMEOUT, secret=SECRET)
    out = result()
    assert 'error' not in out, out
    assert 'does not start with' in out['value'].refused[0], out['value'].refused
    assert not marker.exists()
    good.close()


def test_a_fake_rank0_is_refused_by_the_joining_rank(tmp_path):
    """The joining rank checks rank 0 too: a listener that does not hold the secret and sends a hostile frame."""
    marker = tmp_path / 'fake-root'
    server = socket.socket()
    server.bind(('127.0.0.1', 0))
    server.listen(1)

    def fake():
        sock, _ = server.accept()
        sock.sendall(b'DEEPEPt1' + os.urandom(16))
        recv_exact(sock, 64)
        body = evil_pickle(marker)
        sock.sendall(struct.pack('>BQ', 1, len(body)) + os.urandom(32) + body)
        return sock
    served = in_thread(fake)
    with pytest.raises(tg.RefusedFrameError, match=r'from rank 0 at 127\.0\.0\.1:\d+: refused frame 0: its MAC'):
        tg.TcpProcessGroup(1, 2, '127.0.0.1', server.getsockname()[1], timeout=TIMEOUT, secret=SECRET)
    served()['value'].close()
    server.close()
    assert not marker.exists()


def test_a_listener_that_is_not_rank0_is_named():
    server = socket.socket()
    server.bind(('127.0.0.1', 0))
    server.listen(1)
    served = in_thread(lambda: server.accept()[0].sendall(b'HTTP/1.1 400 Bad Request\r\n\r\n'))
    with pytest.raises(ConnectionError, match=r'127\.0\.0\.1:\d+ is not rank 0 of a deepep_cupy TCP group'):
        tg.TcpProcessGroup(1, 2, '127.0.0.1', server.getsockname()[1], timeout=TIMEOUT, secret=SECRET)
    served()
    server.close()


# -------------------------------------------------------------------------------------------------------------------
# Joined peers sending what a rank never would


def test_a_wrong_mac_is_refused():
    port = free_port()
    result = rank0(port)
    raw = RawRank(port, 1, 2)
    raw.hello()
    assert raw.recv() == (0, 'ready')
    raw.sock.sendall(raw.frame(pickle.dumps((1, 'host')), tag=bytes(32)))
    error = result()['error']
    assert isinstance(error, tg.RefusedFrameError), error
    assert re.search(r'from rank 1 at 127\.0\.0\.1:\d+: refused frame 0: its MAC does not verify', str(error)), error
    assert raw.closed_within()


@pytest.mark.parametrize('valid_mac', [True, False], ids=['valid-mac', 'wrong-mac'])
def test_a_hostile_pickle_is_refused_and_never_runs(tmp_path, valid_mac):
    """A joined rank (it holds the secret) sends a pickle whose __reduce__ runs `touch`: with a valid MAC the decoder
    refuses the global; with a wrong one nothing is decoded. Either way the marker never appears."""
    marker = tmp_path / 'marker'
    port = free_port()
    result = rank0(port)
    raw = RawRank(port, 1, 2)
    raw.hello()
    assert raw.recv() == (0, 'ready')
    body = evil_pickle(marker)
    raw.sock.sendall(raw.frame(body, tag=None if valid_mac else os.urandom(32)))
    error = result()['error']
    assert isinstance(error, tg.RefusedFrameError), error
    assert 'rank 1 at 127.0.0.1:' in str(error), error
    if valid_mac:
        assert "although its MAC verifies: UnpicklingError: it names the global 'posix'.'system'" in str(error), error
    else:
        assert 'its MAC does not verify' in str(error) and 'nothing of it was decoded' in str(error), error
    assert raw.closed_within()
    assert not marker.exists()


def test_an_oversized_frame_is_refused_without_reading_it():
    port = free_port()
    result = rank0(port)
    raw = RawRank(port, 1, 2)
    raw.hello()
    assert raw.recv() == (0, 'ready')
    start = time.monotonic()
    raw.sock.sendall(struct.pack('>BQ', 1, tg.MAX_FRAME_BYTES + 1))
    error = result()['error']
    assert isinstance(error, tg.RefusedFrameError), error
    assert f'over the cap of {tg.MAX_FRAME_BYTES} bytes (not read)' in str(error), error
    assert time.monotonic() - start < TIMEOUT / 2


def test_the_sender_keeps_to_the_cap(monkeypatch):
    a, b = socket.socketpair()
    monkeypatch.setattr(tg, 'MAX_FRAME_BYTES', 1000)
    link = tg._Link(a, bytes(32), 1, 0, 'a socket pair')
    with pytest.raises(ValueError, match=r"\d+-byte object exceeds the TCP group's frame cap of 1000 bytes"):
        link.send(bytes(2000))
    a.close()
    b.close()


def test_a_truncated_hello_is_refused_and_rank0_keeps_waiting():
    port = free_port()
    result = rank0(port)
    raw = RawRank(port, 1, 2)
    raw.hello(raw.hello_bytes[:30])
    raw.sock.shutdown(socket.SHUT_WR)
    assert raw.closed_within()
    good = tg.TcpProcessGroup(1, 2, '127.0.0.1', port, timeout=TIMEOUT, secret=SECRET)
    out = result()
    assert 'error' not in out, out
    assert 'closed after 30 of 64 bytes' in out['value'].refused[0], out['value'].refused
    good.close()


@pytest.mark.parametrize('then', ['close', 'stall'])
def test_a_truncated_frame_is_refused_within_the_timeout(then):
    port = free_port()
    timeout = 4.0
    result = rank0(port, timeout=timeout)
    raw = RawRank(port, 1, 2)
    raw.hello()
    assert raw.recv() == (0, 'ready')
    raw.sock.sendall(raw.frame(pickle.dumps((1, 'x' * 100)))[:9 + 10])
    start = time.monotonic()
    if then == 'close':
        raw.sock.shutdown(socket.SHUT_WR)
    error = result()['error']
    assert 'rank 1 at 127.0.0.1:' in str(error), error
    if then == 'close':
        assert isinstance(error, ConnectionError) and 'closed after 10 of 32 bytes' in str(error), error
    else:
        assert isinstance(error, TimeoutError) and 'did not arrive within 4 s (10 of 32 bytes came)' in str(error)
    assert time.monotonic() - start < timeout + 5


def test_a_replayed_frame_is_refused():
    """The same frame again on its connection: the frame count is in the MAC."""
    port = free_port()
    result = rank0(port)
    raw = RawRank(port, 1, 2)
    raw.hello()
    assert raw.recv() == (0, 'ready')
    recorded = raw.send((1, 'raw-host'))
    assert raw.recv()[0] == 1                   # the hosts all-gather went through
    group = result()['value']
    gather = in_thread(lambda: group.allgather_object('again', timeout=TIMEOUT))
    raw.sock.sendall(recorded)
    error = gather()['error']
    assert isinstance(error, tg.RefusedFrameError) and 'refused frame 1: its MAC does not verify' in str(error), error


def test_a_frame_replayed_by_another_rank_is_refused():
    """Rank 1's frame sent again on rank 2's connection: each connection has its own key, and the ranks are in
    the MAC."""
    port = free_port()
    result = rank0(port, size=3)
    raw1 = RawRank(port, 1, 3)
    raw1.hello()                                # rank 0 shakes hands with one connection at a time
    raw2 = RawRank(port, 2, 3)
    raw2.hello()
    recorded = raw1.send((1, 'raw-host'))
    raw2.sock.sendall(recorded)
    error = result()['error']
    assert isinstance(error, tg.RefusedFrameError), error
    assert re.search(r'from rank 2 at 127\.0\.0\.1:\d+: refused frame 0: its MAC does not verify', str(error)), error
    assert raw1.closed_within() and raw2.closed_within()


def test_a_hello_replayed_into_another_job_is_refused():
    """A hello recorded on one job's connection, sent on another's: the MAC covers rank 0's fresh nonce."""
    port = free_port()
    result = rank0(port)
    raw = RawRank(port, 1, 2)
    raw.join()
    assert raw.recv()[0] == 1
    result()['value'].close()
    port = free_port()
    result = rank0(port)
    replay = RawRank(port, 1, 2)
    replay.hello(raw.hello_bytes)
    assert replay.closed_within()
    good = tg.TcpProcessGroup(1, 2, '127.0.0.1', port, timeout=TIMEOUT, secret=SECRET)
    out = result()
    assert 'error' not in out and 'MAC does not verify' in out['value'].refused[0], out
    good.close()


# -------------------------------------------------------------------------------------------------------------------
# Without sockets


def test_a_job_off_this_host_needs_the_secret(monkeypatch):
    monkeypatch.delenv('DEEPEP_CUPY_TCP_SECRET', raising=False)
    with pytest.raises(RuntimeError, match=r'meets at 10\.1\.2\.3:\d+, not a loopback address, and '
                                           r'DEEPEP_CUPY_TCP_SECRET is not set'):
        tg.TcpProcessGroup(0, 2, '10.1.2.3', free_port(), timeout=5)
    monkeypatch.setenv('DEEPEP_CUPY_TCP_SECRET', 'short')
    with pytest.raises(ValueError, match='DEEPEP_CUPY_TCP_SECRET must be a string of at least 16 characters'):
        tg.TcpProcessGroup(0, 2, '10.1.2.3', free_port(), timeout=5)
    assert [tg.is_loopback(a) for a in ('127.0.0.1', 'localhost', '127.0.1.1', '::1', '10.1.2.3', 'gpu07')] == \
        [True, True, True, True, False, False]


def test_the_encoder_and_decoder_keep_to_plain_data(tmp_path):
    values = [(1, 'a', b'b', None, [1.5, 2j], {'k': frozenset({1})}), np.array([1, 'x', None], dtype=object),
              np.zeros((2, 3), dtype=np.float32)[:, ::2], np.int64(7), np.dtype([('a', '<f4'), ('b', '<i8')])]
    for v in values:
        assert pickle.dumps(tg.decode(tg.encode(v))) == pickle.dumps(v)

    class Custom:
        pass
    for bad in (Custom(), object(), os.system, np.array([Custom()], dtype=object), type):
        with pytest.raises(TypeError, match='the TCP process group carries None, bool'):
            tg.encode(bad)
    marker = tmp_path / 'decoded'
    with pytest.raises(pickle.UnpicklingError, match="'posix'.'system'"):
        tg.decode(evil_pickle(marker))
    assert not marker.exists()

