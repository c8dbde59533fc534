"""An answer that holds beyond the window it was tuned on.

A capacity engineer acts on what ``tune`` prints, so the final choice, the GPU count and
every figure are made to survive fresh traffic of the same workload:

- ``variants``: the traffic variants a choice is scored on (time-window folds of the
  tuning part, each at x0.8 / x1 / x1.2 of its rate);
- ``choice``: candidates ranked by their gain over the engine's defaults across those
  variants, the defaults kept when no gain holds beyond the noise, and the knobs that
  carry the gain (every other knob back at the engine's default);
- ``modelerror``: the step-time model's measured error for the setup's calibration tier,
  and cost models scaled by it;
- ``fleetsize``: the fewest replicas whose simulated fleet meets the SLO-attainment
  target (not one replica's capacity scaled);
- ``answer``: all of it for one study, with the ranges every figure is printed with.
"""
