"""Process wiring: what each kvmesh process is built from, in one place, above the
parts it builds (frontend, worker, planner) and below the command line that parses a
config and hands it here (see docs/structure.md)."""
