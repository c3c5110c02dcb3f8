"""Server churn: heavy-tailed session lengths (lognormal with a given median and mean: most volunteers stay briefly,
a few for days, so few of those online at a time leave each hour), Poisson arrivals that keep the population
steady, and the share of departures that are crashes (no goodbye) rather than graceful leaves."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ChurnConfig:
    """median_session_s / mean_session_s: of a server's time online (mean > median makes the tail heavy);
    crash_fraction: departures without announcing OFFLINE; enabled False = servers stay for the whole run."""

    enabled: bool = True
    median_session_s: float = 2 * 3600.0
    mean_session_s: float = 10 * 3600.0
    crash_fraction: float = 0.3

    def __post_init__(self) -> None:
        if self.enabled and not 0 < self.median_session_s <= self.mean_session_s:
            raise ValueError(f"need 0 < median <= mean session, got {self.median_session_s}, {self.mean_session_s}")
        if not 0 <= self.crash_fraction <= 1:
            raise ValueError(f"crash_fraction must be in [0, 1], got {self.crash_fraction}")

    @property
    def sigma(self) -> float:
        # lognormal: median = e^mu, mean = e^(mu + sigma^2 / 2)
        return math.sqrt(2 * math.log(self.mean_session_s / self.median_session_s))

    def session_s(self, rng: random.Random) -> float:
        """A new server's time online."""
        return rng.lognormvariate(math.log(self.median_session_s), self.sigma)

    def residual_s(self, rng: random.Random) -> float:
        """Time left for a server already online when the run starts: a length-biased session (lognormal with mu +
        sigma^2) times a uniform age fraction, so the starting population is already in its steady state."""
        sigma = self.sigma
        return rng.random() * rng.lognormvariate(math.log(self.median_session_s) + sigma**2, sigma)

    def join_rate_per_s(self, population: int) -> float:
        """Arrivals that balance departures in a population of `population` (Little's law)."""
        return population / self.mean_session_s if self.enabled else 0.0

    def leaving_per_hour(self) -> float:
        """Share of the online servers that leave in an hour at steady state."""
        return 3600.0 / self.mean_session_s if self.enabled else 0.0
