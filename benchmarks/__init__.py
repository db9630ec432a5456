"""tfdist benchmarks: each script measures one figure side by side and records it in RESULTS.md."""
