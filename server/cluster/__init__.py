"""`s2s cluster`: replicas of `s2s serve` behind HAProxy, with voice affinity under bounded load, spill on refusal,
and drain that waits out live conversations."""
