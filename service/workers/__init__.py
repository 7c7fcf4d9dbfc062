"""Workers: claim jobs from the store, run each conversion in a spawned child, record the outcome."""
