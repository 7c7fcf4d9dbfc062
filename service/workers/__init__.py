"""Workers: claim jobs from the store, run each conversion in a child process, record the outcome."""
