"""Well-known names shared by workers and their callers."""

__all__ = ["COMPONENT", "PREFILL_COMPONENT", "DISAGG_STATS", "GENERATE", "MODEL_FILES", "INFO", "KV_DUMP", "KV_EVENTS", "LOAD", "TUNE", "LORA", "FAULT", "KV_EVENTS_TOPIC", "LOAD_TOPIC", "METRICS", "HANDOFF"]

COMPONENT = "backend"  # the component every serving worker registers under
PREFILL_COMPONENT = "prefill"  # prefill workers (they pull the prefill queue; never routed to)

# endpoints of a worker
GENERATE = "generate"
MODEL_FILES = "model_files"
INFO = "info"
KV_DUMP = "kv_dump"
KV_EVENTS = "kv_events"
LOAD = "load"  # the engine's current LoadReport
TUNE = "tune"  # degradation actions on a worker (batch multiplier)
LORA = "lora"  # LoRA adapters: load / unload / list (a LoraCommand; answers a LoraState)
FAULT = "fault"  # switch an engine's fault injection (tests, drills)
DISAGG_STATS = "disagg_stats"  # remote/local prefills, KV transfer and migration counters
METRICS = "metrics"  # the worker's WorkerMetrics (engine, disaggregation, requests)
HANDOFF = "handoff"  # hand every in-flight request off with its KV (health ejection); a HandOffReport

# event-plane topics
KV_EVENTS_TOPIC = "kv_events"
LOAD_TOPIC = "load"
