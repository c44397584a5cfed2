"""GPU energy: per-request attribution (engine side) and the clock/power controller (runtime side).

``policy`` and ``attribution`` are pure; ``actuator`` is the controller's only writer to the GPUs;
``meter`` samples the energy counter in the engine process; ``controller`` runs the control loop.
"""
