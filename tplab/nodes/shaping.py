"""The link between the nodes, made to look like a cluster's network with tc (Linux traffic control).

Each node's one network interface gets a queueing discipline on what it sends (egress), so every byte
that leaves a node for another passes it; loopback inside a node is left alone (fast, as shared memory
is on a real node). Both directions are shaped, each by its sender, as a full-duplex NIC is.

    rate     tbf (token bucket): at most ``rate`` bits per second leave the node, bursts of ~1 ms allowed
    latency  netem delay: every packet waits ``latency`` before it leaves. netem is a kernel module
             (sch_netem) that some kernels lack (minimal VM kernels): then the latency is *not* added,
             and ``Shaping.applied`` says so instead of pretending.

Units as tc writes them: rates "10gbit", "500mbit", "1gbps" (bytes), times "20us", "1ms", "0".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
              "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_rate(text: str) -> float:
    """'10gbit' -> 1e10 bits per second (tc's units; bps means bytes per second, as in tc)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", str(text).lower())
    if not match or match.group(2) not in RATE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"rate {text!r}: write a positive number and one of {', '.join(RATE_UNITS)} (e.g. 10gbit)")
    return float(match.group(1)) * RATE_UNITS[match.group(2)]


def parse_time(text: str) -> float:
    """'20us' -> 2e-5 seconds; '0' -> 0."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(text).lower())
    if not match or (match.group(2) or "s") not in TIME_UNITS:
        raise ValueError(f"latency {text!r}: write a number and one of {', '.join(TIME_UNITS)} (e.g. 20us)")
    return float(match.group(1)) * TIME_UNITS[match.group(2) or "s"]


@dataclass(frozen=True)
class Shaping:
    """What to do to each node's outgoing traffic; ``None`` leaves that part unshaped."""

    rate: str | None = "10gbit"
    latency: str | None = None

    def __post_init__(self):
        if self.rate is not None:
            parse_rate(self.rate)
        if self.latency is not None:
            parse_time(self.latency)

    @property
    def bits_per_second(self) -> float | None:
        return None if self.rate is None else parse_rate(self.rate)

    def tbf_args(self) -> list[str]:
        """tbf needs a bucket of at least one timer tick of traffic; ~1 ms of the rate (>= 64 KiB) is
        what keeps a fast rate from being cut to the bucket per tick."""
        burst = max(int(self.bits_per_second / 8 * 1e-3), 64 * 1024)
        return ["tbf", "rate", self.rate, "burst", str(burst), "latency", "50ms"]

    def commands(self, device: str, with_netem: bool) -> list[list[str]]:
        """The tc commands for ``device`` (run inside its namespace). netem (if wanted and present) is the
        root and tbf its child: packets are delayed, then paced."""
        delay = self.latency is not None and parse_time(self.latency) > 0
        tc = ["tc", "qdisc", "add", "dev", device]
        if delay and with_netem:
            out = [tc + ["root", "handle", "1:", "netem", "delay", self.latency]]
            if self.rate is not None:
                out.append(tc + ["parent", "1:1", "handle", "10:"] + self.tbf_args())
            return out
        return [tc + ["root", "handle", "1:"] + self.tbf_args()] if self.rate is not None else []

    def describe(self, with_netem: bool) -> str:
        rate = f"{self.rate} per direction per node (tbf)" if self.rate else "rate unshaped"
        if self.latency is None or parse_time(self.latency) == 0:
            latency = "no added latency"
        elif with_netem:
            latency = f"+{self.latency} per packet (netem)"
        else:
            latency = f"latency {self.latency} NOT added: this kernel has no netem (sch_netem)"
        return f"{rate}; {latency}"
