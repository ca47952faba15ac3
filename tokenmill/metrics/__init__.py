"""Engine metrics with vLLM's names and shapes: `stats.EngineMetrics` records them in a
prometheus-client registry of the engine's own; `reader` turns a registry into vLLM's
`Counter` / `Gauge` / `Histogram` / `Vector` objects (what `LLM.get_metrics()` returns)."""
