"""Test hosts in Linux network namespaces: N "hosts" joined by veth pairs to a bridge, each link
shaped with tc, for running a job's ranks across real (virtual) network links on one machine.

    with netns_hosts.Hosts(4, tag="ddp") as hosts:
        hosts.shape(2, rate_mbit=50)           # host 2's link: 50 Mbit/s each way (tbf)
        argv = hosts.exec_argv(0) + ["python3", "job.py"]   # run a process on host 0
        before = hosts.bytes(2)                # {"tx": ..., "rx": ...} on host 2's interface
        hosts.shape(2, None)                   # back to an unshaped link, mid-run

Layout: host i is the namespace pp-<tag>-<i> with loopback up and one interface IFNAME (the same
name on every host, so one GLOO_SOCKET_IFNAME fits all ranks) at 10.<subnet>.<i+1>/24; the
other end of its veth pair, pp-<tag>-<i>, is a port of the bridge pp-br in the switch namespace
pp-<tag>-sw. Shaping puts a tbf qdisc on both ends of a host's link (its upload on IFNAME, its
download on the switch port), so a limited host is limited both ways. Delay and loss need the
kernel's netem qdisc; where it is missing (has_netem False), asking for them raises
ShapingUnsupported. Byte counts are the kernel's interface counters (ip -s link), read from
inside the host's namespace: everything the host sent or received over its link, any protocol.

Everything created is torn down by close() (the context manager's exit), and at interpreter exit
(atexit) should close() not have run; only namespaces this object created are deleted. The tag
must be unique among the Hosts alive on the machine (default: the process id).

Errors: NetnsUnavailable (not root, no `ip`, or the kernel refuses a namespace; callers skip:
unavailable() says why beforehand, and main() exits 77), NetnsError (a command failed; the
message names it and its output), ValueError (bad arguments). Not thread-safe: one thread drives
a Hosts.

    python3 tests/python/netns_hosts.py    # self-check: 2 hosts, ping, shaping, counters
"""

import atexit
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

IFNAME = "pp-eth0"
SKIPPED = 77


class NetnsError(RuntimeError):
    """A namespace, link or qdisc command failed."""


class NetnsUnavailable(NetnsError):
    """Network namespaces cannot be made here (not root, no iproute2, or the kernel refuses)."""


class ShapingUnsupported(NetnsError):
    """The shaping asked for needs a qdisc this kernel does not have (netem for delay/loss)."""


def _run(argv: List[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and p.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` exited {p.returncode}: {p.stderr.strip()}")
    return p


def unavailable() -> Optional[str]:
    """Why namespaces cannot be made here, or None when they can (probes by making one)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"pp-probe-{os.getpid()}"
    p = _run(["ip", "netns", "add", probe], check=False)
    if p.returncode != 0:
        return f"`ip netns add` failed: {p.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def _probe_netem(ns: str, dev: str) -> bool:
    """Whether the kernel has netem: add it on dev in ns, then remove it again."""
    p = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem",
              "delay", "1ms"], check=False)
    if p.returncode != 0:
        return False
    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
    return True


# Hosts.relay's process: accept on argv[1]:argv[2], connect each to 127.0.0.1:argv[3], pump
# both ways (no delay on small messages); a connection ends when either side closes.
_RELAY = """
import socket, sys, threading
ls = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("up", flush=True)
def pump(a, b):
    try:
        while True:
            d = a.recv(65536)
            if not d:
                break
            b.sendall(d)
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
while True:
    c, _ = ls.accept()
    try:
        u = socket.create_connection(("127.0.0.1", int(sys.argv[3])))
    except OSError:
        c.close()
        continue
    for s in (c, u):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for x, y in ((c, u), (u, c)):
        threading.Thread(target=pump, args=(x, y), daemon=True).start()
"""


class Hosts:
    """N hosts on one switch (see the module docstring). Raises NetnsUnavailable when namespaces
    cannot be made, NetnsError when setting up fails (what was made is torn down first)."""

    def __init__(self, n: int, tag: Optional[str] = None, subnet: int = 77):
        if not 1 <= n <= 200:
            raise ValueError(f"hosts: n must be in 1..200, not {n}")
        if not 0 <= subnet <= 255:
            raise ValueError(f"hosts: subnet must be in 0..255, not {subnet}")
        tag = str(os.getpid()) if tag is None else tag
        # The switch ports are named pp-<tag>-<i>: an interface name has at most 15 characters.
        if not tag or len(f"pp-{tag}-{n - 1}") > 15 or not tag.replace("_", "").isalnum():
            raise ValueError(f"hosts: tag {tag!r} must be alphanumeric and short (pp-TAG-I fits "
                             "in 15 characters)")
        why = unavailable()
        if why is not None:
            raise NetnsUnavailable(why)
        self.n, self.tag = n, tag
        self.switch = f"pp-{tag}-sw"
        self.names = [f"pp-{tag}-{i}" for i in range(n)]
        self.addresses = [f"10.{subnet}.0.{i + 1}" for i in range(n)]
        self.ifname = IFNAME
        self.rates: Dict[int, Optional[float]] = {i: None for i in range(n)}
        self._made: List[str] = []
        self._relays: List[subprocess.Popen] = []
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.has_netem = _probe_netem(self.names[0], IFNAME)

    def _ns(self, ns: str, *argv: str) -> subprocess.CompletedProcess:
        return _run(["ip", "netns", "exec", ns, *argv])

    def _build(self) -> None:
        for ns in [self.switch] + self.names:
            if ns in _run(["ip", "netns", "list"]).stdout.split():
                raise NetnsError(f"namespace {ns} exists already (another Hosts with tag "
                                 f"{self.tag!r}?)")
            _run(["ip", "netns", "add", ns])
            self._made.append(ns)
            self._ns(ns, "ip", "link", "set", "lo", "up")
        self._ns(self.switch, "ip", "link", "add", "pp-br", "type", "bridge")
        self._ns(self.switch, "ip", "link", "set", "pp-br", "up")
        for i, ns in enumerate(self.names):
            port = self.names[i]
            _run(["ip", "link", "add", "name", IFNAME, "netns", ns, "type", "veth", "peer",
                  "name", port, "netns", self.switch])
            self._ns(self.switch, "ip", "link", "set", port, "master", "pp-br")
            self._ns(self.switch, "ip", "link", "set", port, "up")
            self._ns(ns, "ip", "addr", "add", f"{self.addresses[i]}/24", "dev", IFNAME)
            self._ns(ns, "ip", "link", "set", IFNAME, "up")

    def exec_argv(self, i: int) -> List[str]:
        """The argv prefix that runs a command on host i (`ip netns exec pp-TAG-I`)."""
        self._check(i)
        return ["ip", "netns", "exec", self.names[i]]

    def _check(self, i: int) -> None:
        if not 0 <= i < self.n:
            raise ValueError(f"hosts: no host {i} (there are {self.n})")
        if not self._made:
            raise NetnsError("hosts: closed")

    def shape(self, i: int, rate_mbit: Optional[float] = None, delay_ms: float = 0.0,
              loss_pct: float = 0.0) -> None:
        """Shapes host i's link both ways: rate_mbit (tbf; None: unlimited), delay_ms and
        loss_pct (netem; ShapingUnsupported when the kernel has none). Replaces any earlier
        shaping; may be called while traffic flows."""
        self._check(i)
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"hosts: rate_mbit must be > 0 or None, not {rate_mbit}")
        if delay_ms < 0 or not 0 <= loss_pct <= 100:
            raise ValueError(f"hosts: delay_ms {delay_ms} / loss_pct {loss_pct} out of range")
        if (delay_ms or loss_pct) and not self.has_netem:
            raise ShapingUnsupported("hosts: delay and loss need the netem qdisc, which this "
                                     "kernel does not have (only rate limits, tbf, work here)")
        for ns, dev in ((self.names[i], IFNAME), (self.switch, self.names[i])):
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                 check=False)
            parent = ["root"]
            if delay_ms or loss_pct:
                netem = ["netem"] + (["delay", f"{delay_ms}ms"] if delay_ms else []) + \
                    (["loss", f"{loss_pct}%"] if loss_pct else [])
                self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem)
                parent = ["parent", "1:1"]
            if rate_mbit is not None:
                # burst: at least one timer tick's worth at the rate (and 32 KiB); the queue
                # holds up to 100 ms at the rate before tbf drops (TCP then backs off).
                burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 250))
                self._ns(ns, "tc", "qdisc", "add", "dev", dev, *parent, "tbf", "rate",
                         f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms")
        self.rates[i] = rate_mbit

    def bytes(self, i: int) -> Dict[str, int]:
        """Host i's interface counters: {"tx": bytes sent, "rx": bytes received} since setup."""
        self._check(i)
        p = self._ns(self.names[i], "ip", "-j", "-s", "link", "show", "dev", IFNAME)
        stats = json.loads(p.stdout)[0]["stats64"]
        return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}

    def all_bytes(self) -> List[Dict[str, int]]:
        return [self.bytes(i) for i in range(self.n)]

    def relay(self, i: int, port: int, target_port: int) -> str:
        """Makes a server that listens on host i's loopback only (127.0.0.1:target_port, e.g.
        the scripted agent) reachable from the other hosts: a TCP relay on host i's address at
        `port` (closed with the hosts). Returns "ADDRESS:PORT" to connect to."""
        self._check(i)
        proc = subprocess.Popen(self.exec_argv(i) + [sys.executable, "-c", _RELAY,
                                                     self.addresses[i], str(port),
                                                     str(target_port)],
                                stdout=subprocess.PIPE, text=True)
        self._relays.append(proc)
        if proc.stdout.readline().strip() != "up":
            raise NetnsError(f"hosts: the relay on host {i} port {port} did not start "
                             f"(exit {proc.wait()})")
        return f"{self.addresses[i]}:{port}"

    def close(self) -> None:
        """Deletes the namespaces this object made (their interfaces go with them). Idempotent."""
        for proc in self._relays:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
        self._relays = []
        made, self._made = self._made, []
        for ns in reversed(made):
            _run(["ip", "netns", "del", ns], check=False)
        atexit.unregister(self.close)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_SINK = ("import socket,sys\n"
         "s=socket.create_server((sys.argv[1],int(sys.argv[2])));print('up',flush=True)\n"
         "c,_=s.accept();n=0\n"
         "while (b:=c.recv(65536)):n+=len(b)\n"
         "print(n,flush=True)\n")
_SOURCE = ("import socket,sys\n"
           "c=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=10)\n"
           "c.sendall(b'x'*int(sys.argv[3]));c.close()\n")


def _send(h: Hosts, src: int, dst: int, n: int, port: int = 7999) -> int:
    """Sends n bytes over TCP from host src to host dst; returns what dst received."""
    sink = subprocess.Popen(h.exec_argv(dst) + [sys.executable, "-c", _SINK, h.addresses[dst],
                                                str(port)], stdout=subprocess.PIPE, text=True)
    try:
        sink.stdout.readline()
        _run(h.exec_argv(src) + [sys.executable, "-c", _SOURCE, h.addresses[dst], str(port),
                                 str(n)])
        out, _ = sink.communicate(timeout=30)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    return int(out.strip())


def main() -> int:
    """Self-check: host 0 sends to host 1 over TCP across the switch, the counters see it, and a rate
    limit shows as tbf on both ends of the link. Prints what it found as JSON."""
    why = unavailable()
    if why is not None:
        print(f"netns_hosts: skipped: {why}")
        return SKIPPED
    with Hosts(2, tag=f"sc{os.getpid() % 10000}") as h:
        before = h.bytes(1)
        _send(h, 0, 1, 200_000)
        after = h.bytes(1)
        h.shape(1, rate_mbit=8)
        qdiscs = [_run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev]).stdout
                  for ns, dev in ((h.names[1], IFNAME), (h.switch, h.names[1]))]
        shaped = all("tbf" in q and "8Mbit" in q for q in qdiscs)
        # 1 MB into the 8 Mbit/s host takes at least 1 s less the 32 KiB burst: a lower bound
        # that the limiter sets, not the machine.
        t0 = time.monotonic()
        _send(h, 0, 1, 1_000_000)
        shaped_s = time.monotonic() - t0
        print(json.dumps({"netem": h.has_netem, "rx": after["rx"] - before["rx"],
                          "tx": after["tx"] - before["tx"], "tbf_both_ends": shaped,
                          "shaped_1mb_s": round(shaped_s, 3)}))
        ok = after["rx"] >= 200_000 and after["tx"] > before["tx"] and shaped and shaped_s > 0.9
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
