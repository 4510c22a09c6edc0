"""The continuous-batching core every step-loop engine shares: the KV block pool
(:mod:`.block_manager`) and the scheduler (:mod:`.scheduler`)."""
