"""What the planner knows of a machine: its description and the TOML presets in ``presets/``
(:mod:`~tetrad.plan.machine.description`) and the hierarchical alpha-beta network model of one
collective (:mod:`~tetrad.plan.machine.network`)."""
