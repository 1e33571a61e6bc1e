"""The capacity sweep's arithmetic and picture: which concurrency level is the knee, and the latency curve.

The knee is the highest throughput at which p95 latency (and the failure ratio) still meet the SLO. Past it a
closed-loop load test only queues: throughput flattens while latency climbs, which the plot makes obvious.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from load_tests.slo import TOTAL, Breach, EndpointStats

KNEE_METRICS = ("p95_ms", "max_failure_ratio")


@dataclass(frozen=True)
class Level:
    """One step of the sweep: the concurrency, its all-traffic stats, and what it breached."""

    users: int
    rps: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    failure_ratio: float
    breaches: tuple[str, ...]

    @property
    def meets_slo(self) -> bool:
        return not self.breaches

    @classmethod
    def from_stats(cls, users: int, stats: dict[str, EndpointStats], breaches: list[Breach]) -> Level:
        total = stats[TOTAL]
        return cls(users=users, rps=total.rps, p50_ms=total.p50_ms, p95_ms=total.p95_ms, p99_ms=total.p99_ms,
                   failure_ratio=total.failure_ratio, breaches=tuple(str(b) for b in breaches))

    def as_dict(self) -> dict:
        return {**asdict(self), "breaches": list(self.breaches), "meets_slo": self.meets_slo}


def parse_levels(spec: str) -> list[int]:
    """`1,2,4,8` to increasing user counts; anything else is a usage error worth a clear message."""
    try:
        levels = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"bad --sweep_users {spec!r}: expected increasing integers like 1,2,4,8") from None
    if not levels or levels[0] < 1 or any(b <= a for a, b in zip(levels, levels[1:], strict=False)):
        raise ValueError(f"bad --sweep_users {spec!r}: expected increasing integers >= 1 like 1,2,4,8")
    return levels


def find_knee(levels: list[Level]) -> Level | None:
    """The level with the highest throughput among those that meet the SLO, or None if none does."""
    passing = [level for level in levels if level.meets_slo]
    return max(passing, key=lambda level: level.rps) if passing else None


def plot(levels: list[Level], knee: Level | None, p95_limit_ms: float | None, path: Path, title: str) -> None:
    """Latency percentiles against throughput, each point labelled with its user count."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    measured = [level for level in levels if level.p50_ms is not None]
    rps = [level.rps for level in measured]
    for name, style in (("p50_ms", "o-"), ("p95_ms", "s-"), ("p99_ms", "^-")):
        ax.plot(rps, [getattr(level, name) for level in measured], style, label=name[:3])
    for level in measured:
        ax.annotate(f"{level.users}u", (level.rps, level.p95_ms), textcoords="offset points", xytext=(4, 6),
                    fontsize=8)
    if p95_limit_ms is not None:
        ax.axhline(p95_limit_ms, color="red", linestyle="--", linewidth=1, label=f"p95 SLO {p95_limit_ms:g} ms")
    if knee is not None:
        ax.axvline(knee.rps, color="green", linestyle=":", linewidth=1,
                   label=f"knee {knee.rps:.1f} req/s at {knee.users} users")
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
