"""NPU telemetry under npu-exporter's names: what to collect (families), from where (sources), when (sampler)."""
