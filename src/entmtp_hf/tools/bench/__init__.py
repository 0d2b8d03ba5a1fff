"""The benchmark harness: methods, interleaved runs, result JSON, reports and plots."""
