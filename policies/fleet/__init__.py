"""The fleet: replicas of the engine under one clock, with routers, failures, migration and P/D.

A fleet replays a trace through R replicas of ``policies.engine`` (each its own KV pool,
queue, prefix cache and cost model, so replicas may differ in GPU or TP), driven by one
event loop that follows the fleet contract of issue 8. The plain-Python reference
(``tests/policies/reference_fleet.py``) implements the same rules, and the kernel matches
it request by request:

* Events: arrivals (trace order), deliveries of requests moving between replicas
  (migration, P/D hand-off), failure downs and ups, migration ticks and, with P/D, the
  step ends of the replicas being watched. At the next event time t every alive replica
  runs the steps that start before t (``engine.advance``); then the events at t are
  processed: downs, ups, the fleet queue, deliveries, the migration tick, arrivals.
* The fleet queue (FIFO): an arrival, or a request a failure displaced, joins it; it is
  dispatched after the downs and ups, after the migration tick and at each arrival. The
  head is routed (``policies.routing``) to an alive replica (P/D: a prefill replica, once
  a decode replica promised it KV) and delivered there at t; with nowhere to go it waits,
  and ends at its deadline if that passes first, or FAILED when no replica comes back.
* Failures (``policies.failures``): at t_down the replica's requests, those in flight to
  it and, for a decode replica, those it promised KV lose their KV (generated tokens are
  kept: they were streamed) and rejoin the queue in trace order; they prefill again
  wherever they land. A step in flight at t_down completes (the engine commits a step
  when it starts it), so a request withdrawn from a replica whose clock is past t_down is
  not placed before that clock, and the FIFO queue waits for it. The replica returns
  empty at t_up.
* Migration (Llumnix, ``migration``): at each tick, per pool, replicas short of KV with a
  blocked queue head hand their newest running request, with its KV, to the freest
  replicas when moving it is quicker than the head has waited.
* P/D (``prefill_replicas`` P > 0): replicas 0..P-1 prefill, the rest decode. An arrival
  every prefill replica would reject EXCEEDS_CAPACITY (``engine.never_admits``) is
  rejected by the fleet at once, before it could hold a promise. A request leaves its
  prefill replica once it has sampled a token and reaches its decode replica with its KV
  after the transfer time. While P/D is on, each prefill replica's step end is an event,
  and so is each decode replica's while the queue holds requests. A promise that ends as
  those replicas start their steps at t, with requests queued, makes t an event again:
  its request may have been turned away on arrival by an idle prefill replica, which
  has no step end to come.

* Attention DP (``lockstep`` > 1): each run of ``lockstep`` consecutive replicas is one
  instance's ranks, advanced together (``engine.advance_group``: one clock, every step as
  long as the slowest rank's); the router places requests on ranks as on replicas, an
  instance's failure window stops all of its ranks, and P/D is refused.

The rules the contract leaves open are decided as the reference's docstring lists them.
Every replica runs with the run's seed: the only random draws (speculative verifies) are
keyed by (seed, request, token index), so a request draws the same outcomes wherever it
runs and a migrated one continues its own stream. One replica is exactly ``engine.simulate``.

State is structure-of-arrays: per request ``fi`` (owner, promise, destination in flight)
and the engine's carried rows (what a request takes from replica to replica), per replica
``fr``, run scalars ``fg``. Every array the loop touches is borrowed (``engine.borrowed``)
so the many small calls per event cost no reference counting.

Progress guard: every event of a correct run moves one of the run's progress counters
(arrivals and failure events taken, migration ticks, deliveries, steps of any replica),
so the event loop runs at most ``base + per * progress`` times (``progress_budget``, by
default ``engine.default_progress_budget`` of requests + failure events + replicas:
generous, derived from the trace); past that, or as soon as a replica's engine reports an
internal error (its own progress guard's among them), the run stops and ``simulate_fleet``
raises ``SimulationStalled`` naming the time, the replica and the fleet's state, instead
of hanging.

Modules, from the bottom up: ``state`` (the run's layout, buffers and state), ``guard``
(the progress guard), ``moves`` (delivery and requests in flight), ``routing`` (the
router's view and choice), ``queue`` (the fleet queue, and requests ending in it), ``pd``
(hand-offs and promises), ``failures``, ``migration``, ``loop`` (``fleet_kernel``, the
event loop), ``lists`` (the kernel's typed lists, built by cached kernels) and ``run``
(``simulate_fleet``, ``simulate_fleet_many``, ``warmup``). This
package re-exports the interface the rest of servetune uses.
"""

from policies.engine import SimulationStalled
from policies.fleet.loop import fleet_kernel
from policies.fleet.run import simulate_fleet, simulate_fleet_many, warmup
from policies.fleet.state import FleetBuffers

__all__ = [
    "FleetBuffers",
    "SimulationStalled",
    "fleet_kernel",
    "simulate_fleet",
    "simulate_fleet_many",
    "warmup",
]
