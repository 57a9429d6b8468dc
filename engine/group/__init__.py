"""One model over several processes: the ranks' lock-step ticks."""
