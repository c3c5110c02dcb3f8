"""The server's units of queued decode work: one `StepRequest` (a step of a stream) or a `StepGroup` (a device
channel frame's decode steps, one runtime task and one callback). `flatten_units` lays a batch's units out as one
request list for `engine.batcher.execute_steps` / `launch_steps`, `regroup` hands each unit its results, and
`PendingUnits` does so for a launched forward. The engine knows requests only; the grouping is the transport's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from corolla.engine.batcher import PendingSteps, StepResult, execute_steps
from corolla.engine.span_engine import SpanEngine, StepRequest


@dataclass(eq=False, slots=True)
class StepGroup:
    """Step requests queued and answered as one unit (a device channel frame's decode steps: one runtime task, one
    callback), in the order of their rows in the merged forward. Its result is a list with one `StepResult` per
    request (each step fails alone); a failure of the whole batch fails the unit."""

    requests: list[StepRequest]

    def run(self) -> list[StepResult]:
        """The unit outside a merged batch: its requests merged as `execute_steps` merges them."""
        if not self.requests:
            return []
        engine = self.requests[0].session.engine
        assert isinstance(engine, SpanEngine), "a step group runs on the span engine of its sessions"
        return execute_steps(engine, self.requests)


# per unit of a batch: 0 for a lone request (its result handed over as it is), n >= 1 for a `StepGroup` of n
UnitSizes = list[int]


def flatten_units(units: Sequence[StepRequest | StepGroup]) -> tuple[list[StepRequest], UnitSizes | None]:
    """The requests of a batch's units, in order, and each unit's size (None where every unit is a lone request:
    the results need no regrouping)."""
    requests: list[StepRequest] = []
    sizes: UnitSizes = []
    grouped = False
    for unit in units:
        if isinstance(unit, StepGroup):
            requests.extend(unit.requests)
            sizes.append(len(unit.requests))
            grouped = True
        else:
            requests.append(unit)
            sizes.append(0)
    return requests, sizes if grouped else None


def regroup(results: Sequence[StepResult], sizes: UnitSizes | None) -> list[StepResult | list[StepResult]]:
    """One result per unit from one per request (`flatten_units`' order): a lone request's own, a group's list."""
    if sizes is None:
        return list(results)
    expected = sum(max(size, 1) for size in sizes)
    if expected != len(results):
        raise RuntimeError(f"{len(results)} step results for units of {expected} requests")
    out: list[StepResult | list[StepResult]] = []
    start = 0
    for size in sizes:
        if size == 0:
            out.append(results[start])
            start += 1
        else:
            out.append(list(results[start : start + size]))
            start += size
    return out


class PendingUnits:
    """`PendingSteps` of a batch of units (`flatten_units`): `wait()` gives one result per unit (`regroup`)."""

    def __init__(self, pending: PendingSteps, sizes: UnitSizes | None):
        self._pending = pending
        self._sizes = sizes

    @property
    def device_s(self) -> float | None:
        return self._pending.device_s

    def wait(self) -> list[StepResult | list[StepResult]]:
        return regroup(self._pending.wait(), self._sizes)
