"""The ground floor for KV blocks: block hashing (:mod:`.hashing`) and the KV event
wire types (:mod:`.events`). Engines, the router, disaggregation and the replay all
import it; it imports nothing of kvmesh."""
