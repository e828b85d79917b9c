"""The parapilot bus wire format, version 1 (docs/wire-format.md), in pure Python.

Purpose: message classes for every frame type, their cereal PortableBinary payload codec, the
16-byte frame header with its CRC32C checksum, an incremental frame decoder, and the value-range
checks the C++ reference (transport/messages.cc, frame.cc) applies. Decoding never trusts the
input: truncated payloads, trailing bytes, counts beyond their limit or beyond the bytes left,
non-0/1 booleans and out-of-range values raise WireError before anything large is allocated.

Thread-safety: every function is pure; a FrameDecoder belongs to one connection.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

__all__ = [
    "WireError", "crc32c", "MessageType", "PeerRole", "CompressionMethod",
    "Hello", "Challenge", "Auth", "Welcome", "Heartbeat", "CollectiveStat", "LayerGradStat",
    "Telemetry", "LayerCompression", "Layout", "PlanPrepare", "PlanReady", "PlanCommit",
    "PlanAbort", "Ack", "Shutdown", "LayerInfo", "JobInfo", "Capability", "Message", "validate", "encode_payload", "decode_payload",
    "encode_frame", "decode_frame", "FrameDecoder", "FRAME_MAGIC", "WIRE_VERSION",
    "FRAME_HEADER_BYTES", "DEFAULT_MAX_FRAME_BYTES", "NO_RANK", "MAX_RANKS",
]


class WireError(ValueError):
    """A frame or payload that violates the wire format (the connection must be closed)."""


# ---- CRC32C (Castagnoli, reflected polynomial 0x82F63B78), table driven ----

def _make_crc_table() -> Tuple[int, ...]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return tuple(table)


_CRC_TABLE = _make_crc_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C of `data`; pass a previous result as `crc` to continue over more bytes."""
    table = _CRC_TABLE
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


# ---- constants (values are part of the wire format) ----

FRAME_MAGIC = 0x544C5050  # b"PPLT" little-endian
WIRE_VERSION = 2
FRAME_HEADER_BYTES = 16
DEFAULT_MAX_FRAME_BYTES = 1 << 20
MAX_NAME_BYTES = 128
MAX_TEXT_BYTES = 1024
MAX_COLLECTIVES = 256
MAX_FACTS = 64
MAX_LAYERS = 16384
MAX_RANKS = 1 << 20
NO_RANK = 0xFFFFFFFF
MAX_DURATION_MS = 1e9
NONCE_BYTES = 32


class MessageType:
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    WELCOME = 4
    HEARTBEAT = 5
    TELEMETRY = 6
    PLAN_PREPARE = 7
    PLAN_READY = 8
    PLAN_COMMIT = 9
    PLAN_ABORT = 10
    ACK = 11
    SHUTDOWN = 12
    JOB_INFO = 13


class PeerRole:
    WORKER = 1
    TRACE_REPLAY = 2
    SIMULATOR = 3
    TOOL = 4


class CompressionMethod:
    NONE = 0
    FP16 = 1
    TOPK = 2
    POWERSGD = 3
    NAMES = {0: "none", 1: "fp16", 2: "topk", 3: "powersgd"}


# ---- messages ----

@dataclass
class Hello:
    role: int = PeerRole.WORKER
    rank: int = NO_RANK
    name: str = "worker"
    client_nonce: bytes = bytes(32)
    TYPE = MessageType.HELLO


@dataclass
class Challenge:
    server_nonce: bytes = bytes(32)
    server_proof: bytes = bytes(32)
    TYPE = MessageType.CHALLENGE


@dataclass
class Auth:
    client_proof: bytes = bytes(32)
    TYPE = MessageType.AUTH


@dataclass
class Welcome:
    peer_id: int = 0
    heartbeat_interval_ms: int = 0
    max_frame_bytes: int = 0
    TYPE = MessageType.WELCOME


@dataclass
class Heartbeat:
    seq: int = 0
    send_time_ns: int = 0
    TYPE = MessageType.HEARTBEAT


@dataclass
class CollectiveStat:
    ms: float = 0.0
    bytes: int = 0
    calls: int = 0


@dataclass
class LayerGradStat:
    layer: int = 0
    norm: float = 0.0
    max_abs: float = 0.0
    nonfinite_count: int = 0


@dataclass
class Telemetry:
    rank: int = 0
    step: int = 0
    step_start_ns: int = 0
    step_end_ns: int = 0
    send_time_ns: int = 0
    compute_ms: float = 0.0
    queue_depth: int = 0
    collectives: Dict[str, CollectiveStat] = field(default_factory=dict)
    layers: List[LayerGradStat] = field(default_factory=list)
    counts: Dict[str, int] = field(default_factory=dict)  # whole-number facts ("info/...")
    measures: Dict[str, float] = field(default_factory=dict)  # real facts (the loss); finite
    TYPE = MessageType.TELEMETRY


@dataclass
class LayerCompression:
    first_layer: int = 0
    last_layer: int = 0
    method: int = CompressionMethod.NONE
    parameter: float = 0.0


@dataclass
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batches: int = 1
    dp_shares: List[int] = field(default_factory=list)
    compression: List[LayerCompression] = field(default_factory=list)


@dataclass
class PlanPrepare:
    plan_id: int = 0
    layout: Layout = field(default_factory=Layout)
    layout_name: str = ""
    deadline_ms: int = 0
    TYPE = MessageType.PLAN_PREPARE


@dataclass
class PlanReady:
    plan_id: int = 0
    rank: int = 0
    ok: bool = True
    detail: str = ""
    TYPE = MessageType.PLAN_READY


@dataclass
class PlanCommit:
    plan_id: int = 0
    switch_at_step: int = 0
    TYPE = MessageType.PLAN_COMMIT


@dataclass
class PlanAbort:
    plan_id: int = 0
    reason: str = ""
    TYPE = MessageType.PLAN_ABORT


@dataclass
class Ack:
    acked: int = MessageType.PLAN_COMMIT
    id: int = 0
    rank: int = NO_RANK
    TYPE = MessageType.ACK


@dataclass
class Shutdown:
    reason: str = ""
    TYPE = MessageType.SHUTDOWN


class Capability:
    """JobInfo.capabilities bits: what a job can switch without stopping."""
    DP_SHARES = 1 << 0
    COMPRESSION = 1 << 1
    TENSOR = 1 << 2
    PIPELINE = 1 << 3
    MICRO_BATCHES = 1 << 4
    KNOWN = (1 << 5) - 1


@dataclass
class LayerInfo:
    params: int = 0
    grad_bytes: int = 0


@dataclass
class JobInfo:
    rank: int = 0
    world_size: int = 1
    global_batch: int = 0
    capabilities: int = 0
    framework: str = ""
    layers: List[LayerInfo] = field(default_factory=list)
    TYPE = MessageType.JOB_INFO


Message = Union[Hello, Challenge, Auth, Welcome, Heartbeat, Telemetry, PlanPrepare, PlanReady,
                PlanCommit, PlanAbort, Ack, Shutdown, JobInfo]

_CLASSES = {c.TYPE: c for c in (Hello, Challenge, Auth, Welcome, Heartbeat, Telemetry,
                                PlanPrepare, PlanReady, PlanCommit, PlanAbort, Ack, Shutdown,
                                JobInfo)}

TYPE_NAMES = {1: "hello", 2: "challenge", 3: "auth", 4: "welcome", 5: "heartbeat",
              6: "telemetry", 7: "plan_prepare", 8: "plan_ready", 9: "plan_commit",
              10: "plan_abort", 11: "ack", 12: "shutdown", 13: "job_info"}

INTERNAL_TYPES = frozenset((1, 2, 3, 4, 5))


# ---- validation (mirrors transport/messages.cc validate()) ----

def _u(v: int, bits: int, name: str) -> Optional[str]:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v >= (1 << bits):
        return f"{name} is not a u{bits}"
    return None


def _duration(ms: float, name: str) -> Optional[str]:
    if math.isnan(ms):
        return f"{name} is NaN"
    if math.isinf(ms):
        return f"{name} is infinite"
    if ms < 0:
        return f"{name} is negative"
    if ms > MAX_DURATION_MS:
        return f"{name} is too large"
    return None


def _rank(rank: int, name: str, allow_none: bool) -> Optional[str]:
    if allow_none and rank == NO_RANK:
        return None
    if rank >= MAX_RANKS:
        return f"{name} {rank} is out of range"
    return None


def _text(s: str, limit: int, name: str) -> Optional[str]:
    if len(s.encode("utf-8")) > limit:
        return f"{name} is longer than {limit} bytes"
    return None


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def validate(m: Message) -> str:
    """Returns "" when `m` is valid, otherwise the first violation (same words as the C++)."""
    return _validate(m) or ""


def _validate(m: Message) -> Optional[str]:  # noqa: C901 - one branch per message
    t = type(m)
    if t is Hello:
        if m.role not in (1, 2, 3, 4):
            return f"hello.role {m.role} is unknown"
        raw = m.name.encode("utf-8")
        if not raw:
            return "hello.name is empty"
        if len(raw) > MAX_NAME_BYTES:
            return "hello.name is longer than 128 bytes"
        if any(b < 0x21 or b > 0x7E for b in raw):
            return "hello.name has a byte outside printable ASCII"
        if len(m.client_nonce) != 32:
            return "hello.client_nonce is not 32 bytes"
        return _u(m.rank, 32, "hello.rank") or _rank(m.rank, "hello.rank", True)
    if t is Challenge:
        if len(m.server_nonce) != 32 or len(m.server_proof) != 32:
            return "challenge fields are not 32 bytes"
        return None
    if t is Auth:
        return None if len(m.client_proof) == 32 else "auth.client_proof is not 32 bytes"
    if t is Welcome:
        return "welcome.peer_id is 0" if m.peer_id == 0 else None
    if t is Heartbeat:
        return _u(m.seq, 64, "heartbeat.seq") or _u(m.send_time_ns, 64, "heartbeat.send_time_ns")
    if t is Telemetry:
        e = (_u(m.rank, 32, "telemetry.rank") or _rank(m.rank, "telemetry.rank", False)
             or _u(m.step, 64, "telemetry.step")
             or _u(m.step_start_ns, 64, "telemetry.step_start_ns")
             or _u(m.step_end_ns, 64, "telemetry.step_end_ns")
             or _u(m.send_time_ns, 64, "telemetry.send_time_ns")
             or _u(m.queue_depth, 32, "telemetry.queue_depth"))
        if e:
            return e
        if m.step_end_ns < m.step_start_ns:
            return "telemetry.step_end_ns is before step_start_ns"
        e = _duration(m.compute_ms, "telemetry.compute_ms")
        if e:
            return e
        if len(m.collectives) > MAX_COLLECTIVES:
            return "telemetry.collectives has too many entries"
        for name, c in m.collectives.items():
            if not name:
                return "telemetry.collectives has an empty name"
            e = (_text(name, MAX_NAME_BYTES, "telemetry.collectives name")
                 or _duration(c.ms, "telemetry.collectives.ms")
                 or _u(c.bytes, 64, "telemetry.collectives.bytes")
                 or _u(c.calls, 32, "telemetry.collectives.calls"))
            if e:
                return e
        if len(m.layers) > MAX_LAYERS:
            return "telemetry.layers has too many entries"
        for l in m.layers:
            for v, n in ((l.norm, "telemetry.layers.norm"), (l.max_abs, "telemetry.layers.max_abs")):
                if not math.isfinite(v) or not math.isfinite(_f32(v)):
                    return f"{n} is not finite"
                if v < 0:
                    return f"{n} is negative"
        for facts, what in ((m.counts, "telemetry.counts"), (m.measures, "telemetry.measures")):
            if len(facts) > MAX_FACTS:
                return f"{what} has too many entries"
            for name, v in facts.items():
                if not name:
                    return f"{what} has an empty name"
                e = _text(name, MAX_NAME_BYTES, f"{what} name")
                if e:
                    return e
                if facts is m.counts:
                    e = _u(v, 64, what)
                    if e:
                        return e
                elif not math.isfinite(v):
                    return f"{what}.{name} is not finite"
        return None
    if t is PlanPrepare:
        lay = m.layout
        if lay.dp == 0 or lay.tp == 0 or lay.pp == 0:
            return "plan_prepare.layout has a zero degree"
        if lay.dp * lay.tp * lay.pp > MAX_RANKS:
            return "plan_prepare.layout needs too many ranks"
        if lay.micro_batches == 0 or lay.micro_batches > 65536:
            return "plan_prepare.layout.micro_batches is out of range"
        if lay.dp_shares:
            if len(lay.dp_shares) != lay.dp:
                return "plan_prepare.layout.dp_shares does not have dp entries"
            for s in lay.dp_shares:
                if s == 0 or s > (1 << 24):
                    return "plan_prepare.layout.dp_shares entry is out of range"
        if len(lay.compression) > MAX_LAYERS:
            return "plan_prepare.layout.compression has too many entries"
        for c in lay.compression:
            if c.first_layer > c.last_layer or c.last_layer >= MAX_LAYERS:
                return "plan_prepare.layout.compression has a bad layer range"
            p = _f32(c.parameter)
            if c.method in (CompressionMethod.NONE, CompressionMethod.FP16):
                if p != 0:
                    return "plan_prepare.layout.compression parameter must be 0"
            elif c.method == CompressionMethod.TOPK:
                if not math.isfinite(p) or not (0 < p < 1):
                    return "plan_prepare.layout.compression topk ratio is out of (0, 1)"
            elif c.method == CompressionMethod.POWERSGD:
                if not math.isfinite(p) or p < 1 or p > 1024 or p != math.floor(p):
                    return "plan_prepare.layout.compression powersgd rank is out of [1, 1024]"
            else:
                return "plan_prepare.layout.compression method is unknown"
        return _text(m.layout_name, MAX_NAME_BYTES, "plan_prepare.layout_name")
    if t is PlanReady:
        return (_rank(m.rank, "plan_ready.rank", False)
                or _text(m.detail, MAX_TEXT_BYTES, "plan_ready.detail"))
    if t is PlanCommit:
        return None
    if t is PlanAbort:
        return _text(m.reason, MAX_TEXT_BYTES, "plan_abort.reason")
    if t is Ack:
        if not 1 <= m.acked <= 13:
            return "ack.acked is not a message type"
        return _rank(m.rank, "ack.rank", True)
    if t is Shutdown:
        return _text(m.reason, MAX_TEXT_BYTES, "shutdown.reason")
    if t is JobInfo:
        for v, bits, name in ((m.rank, 32, "job_info.rank"), (m.world_size, 32,
                              "job_info.world_size"), (m.global_batch, 32, "job_info.global_batch"),
                              (m.capabilities, 32, "job_info.capabilities")):
            if _u(v, bits, name):
                return _u(v, bits, name)
        if m.world_size == 0 or m.world_size > MAX_RANKS:
            return "job_info.world_size is out of range"
        if m.rank >= m.world_size:
            return "job_info.rank is not below job_info.world_size"
        if m.global_batch > (1 << 30):
            return "job_info.global_batch is too large"
        if m.capabilities & ~Capability.KNOWN:
            return "job_info.capabilities has unknown bits"
        if len(m.layers) > MAX_LAYERS:
            return "job_info.layers has too many entries"
        for l in m.layers:
            if _u(l.params, 64, "layer_info.params") or _u(l.grad_bytes, 64, "layer_info.grad_bytes"):
                return "job_info.layers has a value that is not a u64"
        return _text(m.framework, MAX_NAME_BYTES, "job_info.framework")
    return f"not a message: {t.__name__}"


# ---- payload encoding ----

def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def encode_payload(m: Message) -> bytes:
    """The cereal PortableBinary payload of `m` (prologue byte included). Does not validate."""
    t = type(m)
    out = [b"\x01"]
    if t is Hello:
        out += [struct.pack("<BI", m.role, m.rank), _string(m.name), bytes(m.client_nonce)]
    elif t is Challenge:
        out += [bytes(m.server_nonce), bytes(m.server_proof)]
    elif t is Auth:
        out.append(bytes(m.client_proof))
    elif t is Welcome:
        out.append(struct.pack("<QII", m.peer_id, m.heartbeat_interval_ms, m.max_frame_bytes))
    elif t is Heartbeat:
        out.append(struct.pack("<QQ", m.seq, m.send_time_ns))
    elif t is Telemetry:
        out.append(struct.pack("<IQQQQdI", m.rank, m.step, m.step_start_ns, m.step_end_ns,
                               m.send_time_ns, m.compute_ms, m.queue_depth))
        # std::map order: ascending bytes of the key.
        items = sorted(((k.encode("utf-8"), v) for k, v in m.collectives.items()),
                       key=lambda kv: kv[0])
        out.append(struct.pack("<Q", len(items)))
        for k, c in items:
            out += [struct.pack("<Q", len(k)), k, struct.pack("<dQI", c.ms, c.bytes, c.calls)]
        out.append(struct.pack("<Q", len(m.layers)))
        for l in m.layers:
            out.append(struct.pack("<IffI", l.layer, l.norm, l.max_abs, l.nonfinite_count))
        for facts, fmt in ((m.counts, "<Q"), (m.measures, "<d")):
            items = sorted(((k.encode("utf-8"), v) for k, v in facts.items()), key=lambda kv: kv[0])
            out.append(struct.pack("<Q", len(items)))
            for k, v in items:
                out += [struct.pack("<Q", len(k)), k, struct.pack(fmt, v)]
    elif t is PlanPrepare:
        lay = m.layout
        out.append(struct.pack("<QIIII", m.plan_id, lay.dp, lay.tp, lay.pp, lay.micro_batches))
        out.append(struct.pack("<Q", len(lay.dp_shares)))
        out.append(struct.pack(f"<{len(lay.dp_shares)}I", *lay.dp_shares))
        out.append(struct.pack("<Q", len(lay.compression)))
        for c in lay.compression:
            out.append(struct.pack("<IIBf", c.first_layer, c.last_layer, c.method, c.parameter))
        out += [_string(m.layout_name), struct.pack("<I", m.deadline_ms)]
    elif t is PlanReady:
        out += [struct.pack("<QIB", m.plan_id, m.rank, 1 if m.ok else 0), _string(m.detail)]
    elif t is PlanCommit:
        out.append(struct.pack("<QQ", m.plan_id, m.switch_at_step))
    elif t is PlanAbort:
        out += [struct.pack("<Q", m.plan_id), _string(m.reason)]
    elif t is Ack:
        out.append(struct.pack("<BQI", m.acked, m.id, m.rank))
    elif t is Shutdown:
        out.append(_string(m.reason))
    elif t is JobInfo:
        out += [struct.pack("<IIII", m.rank, m.world_size, m.global_batch, m.capabilities),
                _string(m.framework), struct.pack("<Q", len(m.layers))]
        for l in m.layers:
            out.append(struct.pack("<QQ", l.params, l.grad_bytes))
    else:
        raise TypeError(f"not a message: {t.__name__}")
    return b"".join(out)


# ---- payload decoding ----

class _Reader:
    __slots__ = ("buf", "pos", "what")

    def __init__(self, buf: bytes, what: str):
        self.buf = buf
        self.pos = 0
        self.what = what

    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int) -> bytes:
        if n > self.remaining():
            raise WireError(f"{self.what} payload is truncated")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def unpack(self, fmt: str, size: int) -> tuple:
        return struct.unpack(fmt, self.take(size))

    def count(self, name: str, limit: int, min_elem_bytes: int) -> int:
        (n,) = self.unpack("<Q", 8)
        if n > limit:
            raise WireError(f"{name} length {n} exceeds limit {limit}")
        if n * min_elem_bytes > self.remaining():
            raise WireError(f"{name} length {n} exceeds the remaining payload")
        return n

    def string(self, name: str, limit: int) -> str:
        n = self.count(name, limit, 1)
        raw = self.take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # The C++ side carries bytes; keep them visible rather than failing the connection.
            return raw.decode("utf-8", errors="replace")

    def boolean(self, name: str) -> bool:
        (b,) = self.unpack("<B", 1)
        if b > 1:
            raise WireError(f"{name} is not a boolean ({b})")
        return b == 1


def decode_payload(msg_type: int, payload: bytes) -> Message:
    """Parses one payload of type `msg_type`; raises WireError on anything the C++ rejects."""
    if msg_type not in _CLASSES:
        raise WireError(f"unknown message type {msg_type}")
    if not payload:
        raise WireError("empty payload")
    if payload[0] != 0x01:
        raise WireError("payload endianness marker is not 0x01")
    r = _Reader(bytes(payload), TYPE_NAMES[msg_type])
    r.pos = 1
    if msg_type == MessageType.HELLO:
        role, rank = r.unpack("<BI", 5)
        name = r.string("hello.name", MAX_NAME_BYTES)
        m: Message = Hello(role, rank, name, r.take(32))
    elif msg_type == MessageType.CHALLENGE:
        m = Challenge(r.take(32), r.take(32))
    elif msg_type == MessageType.AUTH:
        m = Auth(r.take(32))
    elif msg_type == MessageType.WELCOME:
        m = Welcome(*r.unpack("<QII", 16))
    elif msg_type == MessageType.HEARTBEAT:
        m = Heartbeat(*r.unpack("<QQ", 16))
    elif msg_type == MessageType.TELEMETRY:
        head = r.unpack("<IQQQQdI", 48)
        n = r.count("telemetry.collectives", MAX_COLLECTIVES, 8 + 20)
        coll: Dict[str, CollectiveStat] = {}
        for _ in range(n):
            key = r.string("telemetry.collectives", MAX_NAME_BYTES)
            if key in coll:
                raise WireError("telemetry.collectives has a duplicate key")
            coll[key] = CollectiveStat(*r.unpack("<dQI", 20))
        n = r.count("telemetry.layers", MAX_LAYERS, 16)
        layers = [LayerGradStat(*r.unpack("<IffI", 16)) for _ in range(n)]
        facts: List[Dict] = []
        for what, fmt in (("telemetry.counts", "<Q"), ("telemetry.measures", "<d")):
            n = r.count(what, MAX_FACTS, 8 + 8)
            got: Dict = {}
            for _ in range(n):
                key = r.string(what, MAX_NAME_BYTES)
                if key in got:
                    raise WireError(f"{what} has a duplicate key")
                (got[key],) = r.unpack(fmt, 8)
            facts.append(got)
        m = Telemetry(*head, collectives=coll, layers=layers, counts=facts[0], measures=facts[1])
    elif msg_type == MessageType.PLAN_PREPARE:
        plan_id, dp, tp, pp, mb = r.unpack("<QIIII", 24)
        n = r.count("plan_prepare.layout.dp_shares", MAX_RANKS, 4)
        shares = list(r.unpack(f"<{n}I", 4 * n))
        n = r.count("plan_prepare.layout.compression", MAX_LAYERS, 13)
        comp = [LayerCompression(*r.unpack("<IIBf", 13)) for _ in range(n)]
        name = r.string("plan_prepare.layout_name", MAX_NAME_BYTES)
        (deadline,) = r.unpack("<I", 4)
        m = PlanPrepare(plan_id, Layout(dp, tp, pp, mb, shares, comp), name, deadline)
    elif msg_type == MessageType.PLAN_READY:
        plan_id, rank = r.unpack("<QI", 12)
        ok = r.boolean("plan_ready.ok")
        m = PlanReady(plan_id, rank, ok, r.string("plan_ready.detail", MAX_TEXT_BYTES))
    elif msg_type == MessageType.PLAN_COMMIT:
        m = PlanCommit(*r.unpack("<QQ", 16))
    elif msg_type == MessageType.PLAN_ABORT:
        (plan_id,) = r.unpack("<Q", 8)
        m = PlanAbort(plan_id, r.string("plan_abort.reason", MAX_TEXT_BYTES))
    elif msg_type == MessageType.ACK:
        m = Ack(*r.unpack("<BQI", 13))
    elif msg_type == MessageType.SHUTDOWN:
        m = Shutdown(r.string("shutdown.reason", MAX_TEXT_BYTES))
    else:
        head = r.unpack("<IIII", 16)
        framework = r.string("job_info.framework", MAX_NAME_BYTES)
        n = r.count("job_info.layers", MAX_LAYERS, 16)
        m = JobInfo(*head, framework=framework,
                    layers=[LayerInfo(*r.unpack("<QQ", 16)) for _ in range(n)])
    if r.remaining():
        raise WireError(f"{TYPE_NAMES[msg_type]} payload has {r.remaining()} trailing bytes")
    why = _validate(m)
    if why:
        raise WireError(why)
    return m


# ---- frames ----

_HEAD = struct.Struct("<IBBHI")


def encode_frame(m: Message, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """One frame carrying `m`; raises WireError if `m` is invalid or too large."""
    why = _validate(m)
    if why:
        raise WireError(f"invalid message: {why}")
    payload = encode_payload(m)
    if FRAME_HEADER_BYTES + len(payload) > max_frame_bytes:
        raise WireError(f"message too large for a frame ({FRAME_HEADER_BYTES + len(payload)} > "
                        f"{max_frame_bytes} bytes)")
    return frame_raw(m.TYPE, payload)


def frame_raw(msg_type: int, payload: bytes) -> bytes:
    """Frames raw payload bytes (no validation); the checksum is computed."""
    head = _HEAD.pack(FRAME_MAGIC, WIRE_VERSION, msg_type, 0, len(payload))
    return head + struct.pack("<I", crc32c(payload, crc32c(head))) + payload


def check_header(magic: int, version: int, msg_type: int, flags: int, length: int,
                 max_frame_bytes: int) -> Optional[str]:
    if magic != FRAME_MAGIC:
        return f"bad magic 0x{magic:08x}"
    if version != WIRE_VERSION:
        return f"unsupported version {version}"
    if not 1 <= msg_type <= 13:
        return f"unknown message type {msg_type}"
    if flags != 0:
        return "reserved flags set"
    if length == 0:
        return "empty payload"
    if length + FRAME_HEADER_BYTES > max_frame_bytes:
        return (f"oversized frame ({length + FRAME_HEADER_BYTES} > {max_frame_bytes} bytes)")
    return None


class FrameDecoder:
    """Incremental decoder for a byte stream. After the first error it stays failed."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self.error: Optional[str] = None

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def buffered_bytes(self) -> int:
        return len(self._buf)

    def next(self) -> Optional[Message]:
        """The next complete message, or None when more bytes are needed. Raises WireError."""
        if self.error:
            raise WireError(self.error)
        buf = self._buf
        if len(buf) < FRAME_HEADER_BYTES:
            return None
        magic, version, msg_type, flags, length = _HEAD.unpack_from(buf, 0)
        why = check_header(magic, version, msg_type, flags, length, self.max_frame_bytes)
        if why:
            self.error = why
            raise WireError(why)
        if len(buf) < FRAME_HEADER_BYTES + length:
            return None
        (checksum,) = struct.unpack_from("<I", buf, 12)
        payload = bytes(buf[FRAME_HEADER_BYTES:FRAME_HEADER_BYTES + length])
        computed = crc32c(payload, crc32c(bytes(buf[:12])))
        if computed != checksum:
            self.error = f"bad checksum (got 0x{checksum:08x}, computed 0x{computed:08x})"
            raise WireError(self.error)
        try:
            m = decode_payload(msg_type, payload)
        except WireError as e:
            self.error = f"bad {TYPE_NAMES[msg_type]} payload: {e}"
            raise WireError(self.error) from None
        del buf[:FRAME_HEADER_BYTES + length]
        return m


def decode_frame(frame: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """Decodes exactly one complete frame."""
    d = FrameDecoder(max_frame_bytes)
    d.feed(frame)
    m = d.next()
    if m is None:
        raise WireError("truncated frame")
    if d.buffered_bytes:
        raise WireError("trailing bytes after the frame")
    return m
