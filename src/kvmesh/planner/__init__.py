"""The planner: decides how many workers the fleet runs, in which roles, and how many
hot spares it keeps (``core``: pure decisions; the clock and the fleet are inputs)."""
