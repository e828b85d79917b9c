"""Bus client: connects to the parapilot agent, authenticates, and exchanges messages.

Purpose: the Python twin of transport::Client (transport/bus.h). One background thread owns the
socket: it connects, runs the HMAC challenge-response handshake (checking the server's proof
first), writes queued frames (coalesced into one write), sends heartbeats when idle, declares the
server dead after heartbeat_timeout_ms of silence (at least twice the heartbeat interval the
server announces in its Welcome: a healthy server is silent for up to one interval, so a
timeout no longer than that would drop live connections), and reconnects with exponential backoff and
jitter until stopped. Telemetry is best effort: it waits in a bounded buffer that drops the
oldest telemetry when full; control messages are never dropped. Messages keep their send order,
except that messages sent from inside on_connect are written first on that connection (before
anything queued earlier), so a client can introduce itself before its buffered telemetry.

Thread-safety: every public method may be called from any thread. Handlers run on the client's
I/O thread, one at a time, in arrival order; a slow handler delays the following messages.
"""

from __future__ import annotations

import collections
import hmac
import itertools
import logging
import os
import random
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Deque, Optional, Tuple, Union

from . import wire
from .auth import Secret, client_proof, server_proof
from .wire import MessageType, WireError

Logger = Callable[[str, str], None]  # (level, line)


def stderr_logger(min_level: str = "warn") -> Logger:
    order = {"debug": 0, "info": 1, "warn": 2, "error": 3}

    def log(level: str, line: str) -> None:
        if order.get(level, 3) >= order[min_level]:
            print(f"parapilot [{level}] {line}", file=sys.stderr, flush=True)

    return log


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
           "warning": logging.WARNING, "error": logging.ERROR}


def logging_logger(logger: Union[logging.Logger, str] = "parapilot", prefix: str = ""
                   ) -> Logger:
    """A Logger that writes each (level, line) to the standard `logging` logger (a Logger or its
    name), "warn" as WARNING, unknown levels as ERROR, with `prefix` before the line. Configures
    no handler or level: that is the application's choice."""
    target = logging.getLogger(logger) if isinstance(logger, str) else logger

    def log(level: str, line: str) -> None:
        target.log(_LEVELS.get(level, logging.ERROR), "%s%s", prefix, line)

    return log


@dataclass
class ClientStats:
    connects: int = 0           #: successful handshakes.
    messages_sent: int = 0      #: frames handed to the socket.
    messages_received: int = 0  #: frames delivered to on_message.
    telemetry_dropped: int = 0  #: oldest telemetry evicted from a full buffer.
    queued: int = 0             #: messages waiting to be written now.
    bytes_sent: int = 0
    bytes_received: int = 0


def split_address(address: str) -> Tuple[str, int]:
    """"host:port" -> (host, port); raises ValueError naming the address."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"agent address '{address}': expected HOST:PORT")
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ValueError(f"agent address '{address}': bad port")
    return host.strip("[]"), port


class _Disconnect(Exception):
    pass


class Client:
    """A bus client that connects in the background and keeps reconnecting until stop().

    Parameters mirror transport::ClientOptions (times in milliseconds). `on_message(msg)` gets
    every message from the server except heartbeats; `on_connect(peer_id)` runs after each
    successful handshake, before anything else is written on that connection: what it sends goes
    out first (and is dropped, not resent, if that connection fails before writing it);
    `on_disconnect(reason)` runs after each loss or failed attempt. autostart=False: nothing
    happens until start() (lets callbacks use the Client object itself).
    """

    def __init__(self, address: str, secret: Secret, *, name: str = "worker",
                 role: int = wire.PeerRole.WORKER, rank: int = wire.NO_RANK,
                 on_message: Optional[Callable[[wire.Message], None]] = None,
                 on_connect: Optional[Callable[[int], None]] = None,
                 on_disconnect: Optional[Callable[[str], None]] = None,
                 max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
                 reconnect_initial_ms: int = 50, reconnect_max_ms: int = 5000,
                 connect_timeout_ms: int = 5000, heartbeat_interval_ms: int = 1000,
                 heartbeat_timeout_ms: int = 5000, telemetry_buffer_capacity: int = 8192,
                 telemetry_linger_ms: int = 20, logger: Optional[Logger] = None,
                 autostart: bool = True):
        self.host, self.port = split_address(address)
        if not isinstance(secret, Secret) or len(secret) < 16:
            raise ValueError("the bus secret must be a Secret of at least 16 bytes")
        hello = wire.Hello(role, rank, name, bytes(32))
        why = wire.validate(hello)
        if why:
            raise ValueError(f"client identity: {why}")
        if telemetry_buffer_capacity < 1:
            raise ValueError("telemetry_buffer_capacity must be >= 1")
        self._secret = secret
        self.name, self.role, self.rank = name, role, rank
        self._on_message = on_message
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._max_frame = max_frame_bytes
        self._server_max_frame = max_frame_bytes
        self._reconnect_initial = reconnect_initial_ms / 1000
        self._reconnect_max = reconnect_max_ms / 1000
        self._connect_timeout = connect_timeout_ms / 1000
        self._hb_interval = heartbeat_interval_ms / 1000
        self._hb_timeout_asked = heartbeat_timeout_ms / 1000
        self._hb_timeout = self._hb_timeout_asked  # per connection: see _connect
        self._log = logger or stderr_logger()

        self._lock = threading.Condition()
        self._seq = itertools.count()
        self._control: Deque[Tuple[int, wire.Message]] = collections.deque()
        self._telemetry: Deque[Tuple[int, wire.Message]] = collections.deque()
        self._first: Deque[Tuple[int, wire.Message]] = collections.deque()  # from on_connect
        self._announcing = False  # the I/O thread is inside on_connect
        self._telemetry_cap = telemetry_buffer_capacity
        # Telemetry waits up to this long to be written with later messages: one wake-up of the
        # I/O thread per batch instead of per message (fewer GIL hand-offs on the training
        # thread). Control messages and flush() are written at once.
        self._linger = telemetry_linger_ms / 1000
        self._flush_requested = False
        self._in_flight = 0  # messages popped from the queues but not yet fully written
        self._stats = ClientStats()
        self._connected = False
        self._peer_id = 0
        self._stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=f"parapilot-bus-{name}",
                                        daemon=True)
        self._started = False
        if autostart:
            self.start()

    # ---- public API ----

    def start(self) -> None:
        """Starts the background thread (connect, serve, reconnect). Idempotent."""
        with self._lock:
            if self._started or self._stopping:
                return
            self._started = True
        self._thread.start()

    def send(self, m: wire.Message) -> bool:
        """Queues `m`; False if it is invalid, internal (handshake/heartbeat) or stopped.
        Never blocks on the network."""
        if m.TYPE in wire.INTERNAL_TYPES or wire.validate(m):
            return False
        with self._lock:
            if self._stopping:
                return False
            item = (next(self._seq), m, time.monotonic())
            if self._announcing and threading.current_thread() is self._thread:
                self._first.append(item)
                return True  # the I/O thread writes it as soon as on_connect returns
            if m.TYPE == MessageType.TELEMETRY:
                was_empty = not self._telemetry
                if len(self._telemetry) >= self._telemetry_cap:
                    self._telemetry.popleft()
                    self._stats.telemetry_dropped += 1
                self._telemetry.append(item)
                if not was_empty and self._linger > 0:
                    return True  # the I/O thread already waits to write the batch
            else:
                self._control.append(item)
        self._wake()
        return True

    @property
    def connected(self) -> bool:
        with self._lock:
            return self._connected

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame this connection may carry (the smaller of ours and the server's)."""
        with self._lock:
            return self._server_max_frame

    @property
    def peer_id(self) -> int:
        with self._lock:
            return self._peer_id

    def wait_connected(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._connected:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping:
                    return False
                self._lock.wait(left)
            return True

    def flush(self, timeout: float) -> bool:
        """Waits until everything queued so far was handed to the socket, up to `timeout` s."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._flush_requested = True
        self._wake()
        with self._lock:
            while self._control or self._telemetry or self._first or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping:
                    return False
                self._lock.wait(min(left, 0.05))
            return True

    def stats(self) -> ClientStats:
        with self._lock:
            s = ClientStats(**vars(self._stats))
            s.queued = (len(self._control) + len(self._telemetry) + len(self._first) +
                        self._in_flight)
            return s

    def stop(self) -> None:
        """Closes the connection without flushing. Idempotent. Not from a handler."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._lock.notify_all()
        self._wake()
        if threading.current_thread() is not self._thread and self._started:
            self._thread.join(timeout=10)
        for s in (self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- I/O thread ----

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass

    def _stopped(self) -> bool:
        with self._lock:
            return self._stopping

    def _run(self) -> None:
        backoff = self._reconnect_initial
        while not self._stopped():
            sock = None
            try:
                sock = self._connect()
                backoff = self._reconnect_initial
                self._serve(sock)
                reason = "stopped"
            except _Disconnect as e:
                reason = str(e)
            except (OSError, WireError) as e:
                reason = f"{type(e).__name__}: {e}"
            except Exception as e:  # a handler raised: log it, keep the connection logic alive
                reason = f"error: {type(e).__name__}: {e}"
                self._log("error", f"bus client: {reason}")
            finally:
                if sock is not None:
                    try:
                        sock.close()
                    except OSError:
                        pass
            was_connected = False
            with self._lock:
                was_connected = self._connected
                self._connected = False
                self._in_flight = 0
                self._first.clear()  # they belonged to that connection
                self._lock.notify_all()
            if self._stopped():
                break
            if self._on_disconnect:
                try:
                    self._on_disconnect(reason)
                except Exception as e:  # noqa: BLE001
                    self._log("error", f"on_disconnect raised {type(e).__name__}: {e}")
            self._log("info" if not was_connected else "warn",
                      f"bus: disconnected from {self.host}:{self.port} ({reason})")
            delay = backoff * (1 - 0.5 * random.random())
            backoff = min(backoff * 2, self._reconnect_max)
            self._sleep(delay)

    def _sleep(self, seconds: float) -> None:
        try:
            select.select([self._wake_r], [], [], max(0.0, seconds))
            self._drain_wake()
        except (OSError, ValueError):
            time.sleep(min(seconds, 0.05))

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _recv_message(self, sock: socket.socket, decoder: wire.FrameDecoder,
                      deadline: float) -> wire.Message:
        while True:
            m = decoder.next()
            if m is not None:
                return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Disconnect("handshake timed out")
            sock.settimeout(left)
            try:
                data = sock.recv(65536)
            except socket.timeout:
                raise _Disconnect("handshake timed out") from None
            if not data:
                raise _Disconnect("server closed the connection during the handshake")
            decoder.feed(data)

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self._connect_timeout
        sock = socket.create_connection((self.host, self.port), timeout=self._connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_nonce = os.urandom(32)
            sock.sendall(wire.encode_frame(
                wire.Hello(self.role, self.rank, self.name, client_nonce), self._max_frame))
            decoder = wire.FrameDecoder(self._max_frame)
            challenge = self._recv_message(sock, decoder, deadline)
            if not isinstance(challenge, wire.Challenge):
                raise _Disconnect(f"expected challenge, got {wire.TYPE_NAMES[challenge.TYPE]}")
            expected = server_proof(self._secret, client_nonce, challenge.server_nonce)
            if not hmac.compare_digest(expected, challenge.server_proof):
                raise _Disconnect("server proof mismatch (wrong server or wrong secret)")
            proof = client_proof(self._secret, challenge.server_nonce, client_nonce)
            sock.sendall(wire.encode_frame(wire.Auth(proof), self._max_frame))
            welcome = self._recv_message(sock, decoder, deadline)
            if not isinstance(welcome, wire.Welcome):
                raise _Disconnect(f"expected welcome, got {wire.TYPE_NAMES[welcome.TYPE]}")
        except BaseException:
            sock.close()
            raise
        sock.setblocking(False)
        # The server sends a heartbeat after one announced interval of idleness: silence that
        # long is normal, so the timeout must leave it room (twice: one interval of its own
        # scheduling and the network's delay on top).
        self._hb_timeout = max(self._hb_timeout_asked, 2 * welcome.heartbeat_interval_ms / 1000)
        self._decoder = decoder  # may already hold frames that followed the Welcome
        with self._lock:
            self._connected = True
            self._peer_id = welcome.peer_id
            self._server_max_frame = min(self._max_frame, welcome.max_frame_bytes or
                                         self._max_frame)
            self._stats.connects += 1
            self._lock.notify_all()
        self._log("info", f"bus: connected to {self.host}:{self.port} as peer {welcome.peer_id}")
        if self._on_connect:
            with self._lock:
                self._announcing = True
            try:
                self._on_connect(welcome.peer_id)
            except Exception as e:  # noqa: BLE001 - a handler bug must not kill the bus
                self._log("error", f"on_connect raised {type(e).__name__}: {e}")
            finally:
                with self._lock:
                    self._announcing = False
        return sock

    def _take_batch(self, limit_bytes: int) -> bytes:
        """Pops queued messages in send order and encodes them, up to about limit_bytes."""
        out = []
        size = 0
        with self._lock:
            while (self._first or self._control or self._telemetry) and size < limit_bytes:
                if self._first:
                    _, m, _ = self._first.popleft()
                elif self._control and (not self._telemetry or
                                      self._control[0][0] < self._telemetry[0][0]):
                    _, m, _ = self._control.popleft()
                else:
                    _, m, _ = self._telemetry.popleft()
                self._in_flight += 1
                try:
                    frame = wire.encode_frame(m, self._server_max_frame)
                except WireError as e:
                    self._in_flight -= 1
                    self._log("error", f"bus: dropped an unsendable message: {e}")
                    continue
                out.append(frame)
                size += len(frame)
        return b"".join(out)

    def _serve(self, sock: socket.socket) -> None:
        decoder = self._decoder
        pending = b""  # encoded bytes not yet written
        pending_msgs = 0
        last_rx = time.monotonic()
        last_tx = last_rx
        hb_seq = 0
        while True:
            if self._stopped():
                return
            # Deliver everything already decoded.
            while True:
                m = decoder.next()  # raises WireError on a bad frame: the connection closes
                if m is None:
                    break
                self._deliver(m)
            now = time.monotonic()
            if not pending:
                with self._lock:
                    oldest = self._telemetry[0][2] if self._telemetry else None
                    due = bool(self._first or self._control or self._flush_requested or
                               (oldest is not None and now - oldest >= self._linger))
                    self._flush_requested = False
                if due:
                    pending = self._take_batch(256 << 10)
                    oldest = None
                    with self._lock:
                        pending_msgs = self._in_flight
            if not pending and now - last_tx >= self._hb_interval:
                hb_seq += 1
                pending = wire.encode_frame(wire.Heartbeat(hb_seq, time.monotonic_ns()))
            wait = max(0.0, min(self._hb_interval - (now - last_tx),
                                self._hb_timeout - (now - last_rx)))
            if oldest is not None:  # telemetry lingering: wake when it is due
                wait = min(wait, max(0.0, oldest + self._linger - now))
            rlist, wlist, _ = select.select([sock, self._wake_r], [sock] if pending else [], [],
                                            min(wait, 1.0) if pending else wait)
            if self._wake_r in rlist:
                self._drain_wake()
            if sock in rlist:
                try:
                    data = sock.recv(1 << 16)
                except (BlockingIOError, InterruptedError):
                    data = None
                if data is not None:
                    if not data:
                        raise _Disconnect("server closed the connection")
                    last_rx = time.monotonic()
                    with self._lock:
                        self._stats.bytes_received += len(data)
                    decoder.feed(data)
            if pending and sock in wlist:
                try:
                    n = sock.send(pending)
                except (BlockingIOError, InterruptedError):
                    n = 0
                if n:
                    last_tx = time.monotonic()
                    pending = pending[n:]
                    with self._lock:
                        self._stats.bytes_sent += n
                        if not pending:
                            self._stats.messages_sent += pending_msgs
                            self._in_flight = 0
                            pending_msgs = 0
                            self._lock.notify_all()
            if time.monotonic() - last_rx > self._hb_timeout:
                raise _Disconnect("heartbeat timeout")

    def _deliver(self, m: wire.Message) -> None:
        if m.TYPE == MessageType.HEARTBEAT:
            return
        if m.TYPE in wire.INTERNAL_TYPES:
            raise _Disconnect(f"unexpected {wire.TYPE_NAMES[m.TYPE]} after the handshake")
        with self._lock:
            self._stats.messages_received += 1
        if self._on_message:
            try:
                self._on_message(m)
            except Exception as e:  # noqa: BLE001 - a handler bug must not kill the bus
                self._log("error", f"on_message raised {type(e).__name__}: {e}")
