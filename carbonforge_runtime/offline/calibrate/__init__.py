"""``carbonforge-runtime calibrate``: fit a step-time model on the operator's own host and check it.

* :mod:`.design` holds the decisions as plain functions over plain data: the time budget and its
  split between phases, the calibration and check loads, the predicted-against-served table, the
  host block and the text of the local recipe.
* :mod:`.served` owns the one child process: the runtime serving the recipe, with a deadline on
  every wait and a kill path for every process it started.
* :mod:`.run` runs the phases in order and stops, naming the phase, what was done and what was
  written, when one fails.
"""
