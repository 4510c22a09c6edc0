"""Disaggregated prefill and decode: conditional remote prefill, the global prefill
queue, KV transfer between workers, and KV-carrying migration on drain."""
